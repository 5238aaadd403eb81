"""A fast tier's durable side on an object store (``s3://`` roots).

The same facts as :mod:`daemon.store._tiercoord`, as objects under
``ROOT/.ckptd-tiers/`` (``create_once`` is a create-only PUT, ``If-None-Match: *``), and
the drain's copy (:mod:`daemon.store._tiercopy`'s, for objects): each file read once
from the fast tier, hashed and paced as it is read, uploaded (one PUT up to
:data:`PART` bytes, a multipart upload beyond), then read back and hashed; both must
match the part's checksum.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from typing import Final

from ..base._errors import VerificationError
from ..config._root import RootConfig
from ._s3client import Bucket, Precondition
from ._tierpace import Throttle, in_drain_threads

__all__ = ["copy_part", "create_once", "list_names", "read_fact", "remove_fact", "write_fact"]

PART: Final = 64 << 20
"""Bytes a file is uploaded in (the part size of a multipart upload)."""
_COORD: Final = ".ckptd-tiers"

_buckets: dict[str, Bucket] = {}
_lock = threading.Lock()


def bucket(root: RootConfig) -> Bucket:
    """The root's bucket client (one per root, shared by the threads)."""
    with _lock:
        found = _buckets.get(root.path)
        if found is None:
            found = _buckets[root.path] = Bucket(root.path, root.s3)
        return found


def _name(rel: str) -> str:
    if ".." in rel.split("/") or rel.startswith("/"):
        raise ValueError(f"{rel!r} is not inside {_COORD}")
    return f"{_COORD}/{rel}"


def write_fact(root: RootConfig, rel: str, data: bytes) -> None:
    """Write (or replace) the fact ``rel``."""
    bucket(root).put(_name(rel), data)


def create_once(root: RootConfig, rel: str, data: bytes) -> bool:
    """Create the fact ``rel`` unless it exists; whether this call created it."""
    try:
        bucket(root).put(_name(rel), data, create=True)
    except Precondition:
        return False
    return True


def read_fact(root: RootConfig, rel: str) -> bytes | None:
    """The fact ``rel``'s contents; None if it does not exist."""
    found = bucket(root).get(_name(rel))
    return None if found is None else found[0]


def list_names(root: RootConfig, rel: str) -> list[str]:
    """The facts (and sub-directories of facts) in ``rel``, sorted."""
    names = set()
    for item in bucket(root).listing(_name(rel), delimiter=True):
        key = item if isinstance(item, str) else item.key
        names.add(key.rstrip("/").rsplit("/", 1)[-1])
    return sorted(names)


def remove_fact(root: RootConfig, rel: str) -> None:
    """Remove the fact ``rel``, or every fact under it."""
    b = bucket(root)
    under = [i.key for i in b.listing(_name(rel)) if not isinstance(i, str)]
    b.delete_many([_name(rel), *under])


def copy_part(
    root: RootConfig,
    src_dir: str,
    dst: str,
    files: list[tuple[str, int, str]],
    *,
    threads: int,
    rate: float,
    ionice: str,
) -> int:
    """Upload a part's ``files`` (path, size, sha256) under ``dst`` (a URL in ``root``).

    Returns:
        The bytes uploaded.

    Raises:
        VerificationError: the source or the uploaded object does not match.
        OSError: a read or a request failed.
    """
    b = bucket(root)
    prefix = dst[len(root.path) + 1 :]
    throttle = Throttle(rate)

    def one(entry: tuple[str, int, str]) -> int:
        path, size, sha = entry
        name = f"{prefix}/{path}"
        digest = hashlib.sha256()
        b.upload(name, _pieces(f"{src_dir}/{path}", digest, throttle))
        if digest.hexdigest() != sha:
            raise VerificationError(f"{src_dir}/{path} no longer matches its checksum")
        back = hashlib.sha256()
        got = 0
        for data in b.download(name):
            back.update(data)
            got += len(data)
        if got != size or back.hexdigest() != sha:
            raise VerificationError(f"the upload of {path} to {dst} does not match its checksum")
        return size

    return in_drain_threads(one, files, threads, ionice)


def write_small(root: RootConfig, url: str, data: bytes) -> None:
    """Write the object at ``url`` (inside ``root``)."""
    bucket(root).put(url[len(root.path) + 1 :], data)


def _pieces(path: str, digest: hashlib._Hash, throttle: Throttle) -> Iterator[bytes]:
    with open(path, "rb", buffering=0) as f:
        while data := f.read(PART):
            throttle.take(len(data))
            digest.update(data)
            yield data

"""``ckptd verify --deep``: re-check a step's recorded checksums, on either tier.

A fast-tier step carries its node's part file (``.ckptd-tier/part.json``: every file's
size and SHA-256, computed once when the part was sealed); a step drained to the durable
root carries ``.ckptd-sums/NODE.json`` for each node's part, copied with it. Each file
named there is read in full and hashed again. On an object store the checksums are the
``.ckptd-sums/`` objects of the committed attempt (those its commit object names), and
each object is streamed and hashed (:func:`deep_verify_url`).
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING

import msgspec

from ._tier import PART, hash_file, read_part

if TYPE_CHECKING:
    from ._s3 import S3Storage
    from ._s3client import Bucket
    from ._s3commit import Commit

__all__ = ["deep_verify", "deep_verify_objects", "deep_verify_url"]

_SUMS = ".ckptd-sums"


def deep_verify(path: str) -> tuple[int, list[str]]:
    """How many files were re-hashed under ``path``, and each problem found.

    A step with no recorded checksums (not saved through a fast tier) is one problem.
    """
    sums: dict[str, tuple[int | None, str]] = {}
    part = read_part(path)
    if part is not None:
        sums = {f.path: (f.size, f.sha256) for f in part.files()}
    else:
        try:
            names = sorted(os.listdir(os.path.join(path, _SUMS)))
        except (FileNotFoundError, NotADirectoryError):
            names = []
        for name in names:
            try:
                with open(os.path.join(path, _SUMS, name), "rb") as f:
                    recorded = msgspec.json.decode(f.read(), type=dict[str, str])
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                return 0, [f"{_SUMS}/{name}: unreadable ({exc})"]
            sums.update({rel: (None, sha) for rel, sha in recorded.items()})
    if not sums:
        why = f"no checksums recorded ({PART} or {_SUMS}/): --deep checks fast-tier steps"
        return 0, [why]
    problems = []
    for rel, (size, sha) in sorted(sums.items()):
        try:
            got_size, got = hash_file(os.path.join(path, rel))
        except OSError as exc:
            problems.append(f"{rel}: {exc.strerror or exc}")
            continue
        if size is not None and got_size != size:
            problems.append(f"{rel}: {got_size} bytes, {size} recorded")
        elif got != sha:
            problems.append(
                f"{rel}: SHA-256 {got[:16]}... does not match the recorded {sha[:16]}..."
            )
    return len(sums), problems


def deep_verify_url(storage: S3Storage, path: str) -> tuple[int, list[str]]:
    """:func:`deep_verify` of the committed step an ``s3://`` URL names.

    Raises:
        StoreError: the store could not be read.
    """
    from . import _s3commit as commits

    try:
        root, step, _ = storage.root_of(path)
    except FileNotFoundError:
        return 0, [f"{path} names no step of an s3:// root"]
    if step is None:
        return 0, [f"{path} names no step"]
    bucket = storage.bucket(root)
    found = commits.read_commit(bucket, root, step)
    if found is None:
        return 0, [f"{root.final_dir(step)} has no commit object: it is not a checkpoint"]
    commit = found[0]
    return deep_verify_objects(bucket, commits.attempt_name(root, step, commit.attempt), commit)


def deep_verify_objects(bucket: Bucket, base: str, commit: Commit) -> tuple[int, list[str]]:
    """Re-hash every object the committed attempt's ``.ckptd-sums/`` objects name.

    Only the checksum objects the commit names count (an object written under the
    attempt's prefix after the commit is no part of the checkpoint). Each object is
    streamed (8 MiB at a time) and hashed; its size is compared with the commit's.
    """
    objects = commit.objects
    sums: dict[str, str] = {}
    for name in sorted(rel for rel in objects if rel.startswith(f"{_SUMS}/")):
        got = bucket.get(f"{base}/{name}")
        if got is None:
            return 0, [f"{name}: missing, though the commit names it"]
        try:
            sums.update(msgspec.json.decode(got[0], type=dict[str, str]))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return 0, [f"{name}: unreadable ({exc})"]
    if not sums:
        why = f"no checksums recorded ({_SUMS}/): --deep checks steps drained from a fast tier"
        return 0, [why]
    problems = []
    for rel, sha in sorted(sums.items()):
        digest, size = hashlib.sha256(), 0
        try:
            for piece in bucket.download(f"{base}/{rel}"):
                digest.update(piece)
                size += len(piece)
        except OSError as exc:  # missing (FileNotFoundError), or the store failed
            problems.append(f"{rel}: {exc.strerror or exc}")
            continue
        recorded = objects.get(rel)
        if recorded is not None and recorded[0] != size:
            problems.append(f"{rel}: {size} bytes, {recorded[0]} at the commit")
        elif digest.hexdigest() != sha:
            problems.append(
                f"{rel}: SHA-256 {digest.hexdigest()[:16]}... does not match the recorded "
                f"{sha[:16]}..."
            )
    return len(sums), problems

"""Pointers (``latest``, ``best``) and other small records on an object store, by CAS.

A pointer is one small object naming a committed step, its attempt and the URL readers
load. It moves only by a conditional write: ``If-None-Match: *`` for the first, then
``If-Match`` with the ETag it was read at. ``latest`` moves forward only: a writer that
finds a newer committed step there leaves it. A lost race (412, or 409 when the store
saw concurrent conditional writes) is read again and retried, a bounded number of times.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Final

import msgspec

from ._s3client import Bucket, Precondition

__all__ = ["Pointer", "advance", "read_pointer", "remove_pointer", "write_pointer"]

_RETRIES: Final = 64


class Pointer(msgspec.Struct, frozen=True, kw_only=True):
    """What a pointer object holds."""

    format: str = "ckptd-pointer/1"
    step: int
    attempt: str
    url: str
    """Where readers load the checkpoint (``FsspecReader(url)``)."""
    written: str = ""


def read_pointer(bucket: Bucket, name: str) -> tuple[Pointer, str] | None:
    """The pointer object ``name`` and its ETag; None if absent or not a pointer."""
    got = bucket.get(name)
    if got is None:
        return None
    try:
        return msgspec.json.decode(got[0], type=Pointer), got[1]
    except msgspec.DecodeError:
        return None


def _write(bucket: Bucket, name: str, pointer: Pointer, etag: str | None) -> None:
    # Never a plain PUT: an object there that is no pointer of ours is never replaced.
    data = msgspec.json.encode(pointer)
    if etag is None:
        bucket.put(name, data, create=True)
    else:
        bucket.put(name, data, match=etag)


def advance(bucket: Bucket, name: str, step: int, attempt: str, url: str) -> bool:
    """Point ``name`` at ``step`` unless it names a newer step; whether it now names ``step``.

    Raises:
        Precondition: the pointer kept changing under every retry.
        StoreError: the store failed a request.
    """
    return _move(bucket, name, Pointer(step=step, attempt=attempt, url=url), forward=True)


def write_pointer(bucket: Bucket, name: str, step: int, attempt: str, url: str) -> None:
    """Point ``name`` at ``step`` (older or newer), by CAS on what was read."""
    _move(bucket, name, Pointer(step=step, attempt=attempt, url=url), forward=False)


def _move(bucket: Bucket, name: str, pointer: Pointer, *, forward: bool) -> bool:
    pointer = msgspec.structs.replace(pointer, written=datetime.now(UTC).isoformat())
    last: Precondition | None = None
    for _ in range(_RETRIES):
        current = read_pointer(bucket, name)
        if current is not None:
            now, etag = current
            if now.step == pointer.step and now.attempt == pointer.attempt:
                return True
            if forward and now.step > pointer.step:
                return False
        try:
            _write(bucket, name, pointer, None if current is None else current[1])
        except Precondition as exc:
            last = exc  # another writer moved it first: read it again
            continue
        return True
    assert last is not None
    raise last


def remove_pointer(bucket: Bucket, name: str) -> bool:
    """Remove the pointer ``name`` if it is one of ours; whether it did."""
    if read_pointer(bucket, name) is None:
        return False
    bucket.delete(name)
    return True

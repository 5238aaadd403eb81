"""The start-up probe of an object store: does it honour conditional writes?

Everything ckptd promises on an object store rests on two headers: ``If-None-Match: *``
(a second create fails with 412) and ``If-Match`` (a write from a stale ETag fails with
412). Some S3-compatible servers have shipped ignoring them, which would let two daemons
both commit a step, or a pointer move backwards, silently. So before a root is used the
daemon checks both, and a short race of create-only writes to one key (exactly one may
win), under ``.ckptd/probe/`` in the root; a store that fails any is refused.
"""

from __future__ import annotations

import errno
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Final

from ._s3client import Bucket, Precondition, StoreError

__all__ = ["PROBE_PREFIX", "StoreRefused", "probe"]

PROBE_PREFIX: Final = ".ckptd/probe"
_RACERS: Final = 8


class StoreRefused(StoreError):
    """The store ignores a conditional write: ckptd cannot commit there safely."""


def probe(bucket: Bucket) -> None:
    """Check that the store honours ``If-None-Match`` and ``If-Match``; clean up after.

    Raises:
        StoreRefused: it does not, saying which header it ignored.
        StoreError: the store cannot be reached, the bucket is missing or the
            credentials are refused (what the error says).
    """
    run = uuid.uuid4().hex
    key, race = f"{PROBE_PREFIX}/{run}", f"{PROBE_PREFIX}/{run}.race"
    where = f"the store at {bucket.endpoint} (root {bucket.url})"
    bucket.check()
    try:
        first = bucket.put(key, b"1", create=True)
        try:
            bucket.put(key, b"2", create=True)
        except Precondition:
            pass
        else:
            raise StoreRefused(
                errno.EPROTO,
                f"{where} ignores If-None-Match: a second create-only PUT of one key "
                "succeeded; ckptd refuses this root (two commits of one step could both win)",
            )
        bucket.put(key, b"3", match=first)
        try:
            bucket.put(key, b"4", match=first)
        except Precondition:
            pass
        else:
            raise StoreRefused(
                errno.EPROTO,
                f"{where} ignores If-Match: a PUT from a stale ETag succeeded; ckptd refuses "
                "this root (a pointer could move backwards)",
            )
        wins = _race(bucket, race)
        if wins != 1:
            raise StoreRefused(
                errno.EPROTO,
                f"{where} let {wins} of {_RACERS} racing create-only PUTs of one key succeed "
                "(exactly one may); ckptd refuses this root",
            )
    finally:
        try:
            bucket.delete_many([key, race])
        except StoreError:
            pass  # a probe left behind is harmless, and never read


def _race(bucket: Bucket, key: str) -> int:
    def attempt(i: int) -> bool:
        try:
            bucket.put(key, str(i).encode(), create=True)
        except Precondition:
            return False
        return True

    with ThreadPoolExecutor(max_workers=_RACERS, thread_name_prefix="s3-probe") as pool:
        return sum(pool.map(attempt, range(_RACERS)))

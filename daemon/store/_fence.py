"""Fences that keep two daemons on one shared root from both promoting or both moving a pointer.

On a local disk one daemon owns a root and its lock serialises everything. A root on a
shared filesystem is written by a daemon on every node, and there
``renameat2(RENAME_NOREPLACE)`` fails with ``EINVAL`` (NFS, FUSE), so the rename's own
check cannot fence it. Both fences here rest on one operation shared filesystems do
make atomic, ``open(O_CREAT | O_EXCL)``:

- :func:`claim`: ``tmp_step_N/.ckptd-claim`` names the node and attempt promoting the
  step. Only its holder renames; it travels into ``step_N`` with the rename.
- :func:`pointer_lock`: ``ROOT/.ckptd-pointer.lock`` is held while the ``latest``
  pointer is read and replaced, so a newer step's pointer is never overwritten by an
  older one's.

Blocking I/O only.
"""

from __future__ import annotations

import errno
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

import msgspec

from ..config._config import RootConfig
from ._durable import fsync_dir
from ._markers import CLAIM, now_iso

__all__ = ["Claim", "ClaimedError", "claim", "claimed", "pointer_lock", "release"]

POINTER_LOCK: Final = ".ckptd-pointer.lock"
_LOCK_WAIT: Final = 10.0
"""Seconds a pointer move waits for another node's to finish."""
_LOCK_STALE: Final = 60.0
"""A pointer lock older than this was left by a crash: it is broken."""


class Claim(msgspec.Struct, frozen=True, kw_only=True):
    """Who promotes a step."""

    node: str
    attempt: str
    written: str = ""


class ClaimedError(FileExistsError):
    """Raised by :func:`claim` when another node (or attempt) holds the step's claim."""


def claim(root: RootConfig, step: int, node: str, attempt: str, tmp: str | None = None) -> None:
    """Claim the promotion of ``tmp_step_N`` for ``node`` and ``attempt``, durably.

    Idempotent for the same holder (a restarted leader resuming its promotion). ``tmp``
    is the directory to promote if not ``tmp_step_N`` (a rescue from the trash).

    Raises:
        ClaimedError: another holder's claim is there; the message names it.
        OSError: the claim cannot be written.
    """
    tmp = tmp or root.tmp_dir(step)
    path = os.path.join(tmp, CLAIM)
    data = msgspec.json.encode(Claim(node=node, attempt=attempt, written=now_iso()))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        held = _holder(path)
        if held is not None and held.node == node and held.attempt == attempt:
            return
        who = "an unreadable claim" if held is None else f"node {held.node} ({held.written})"
        raise ClaimedError(
            errno.EEXIST,
            f"step {step} is claimed for promotion by {who}; if that node is gone for good, "
            f"remove {path} and promote again",
        ) from None
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(tmp)


def release(root: RootConfig, step: int, node: str, attempt: str, tmp: str | None = None) -> None:
    """Drop this holder's claim (verification failed: nothing was renamed)."""
    path = os.path.join(tmp or root.tmp_dir(step), CLAIM)
    held = _holder(path)
    if held is not None and held.node == node and held.attempt == attempt:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def claimed(root: RootConfig, step: int) -> bool:
    """Whether ``tmp_step_N`` carries a claim (readable or not)."""
    return os.path.lexists(os.path.join(root.tmp_dir(step), CLAIM))


def _holder(path: str) -> Claim | None:
    try:
        with open(path, "rb") as fh:
            return msgspec.json.decode(fh.read(65536), type=Claim)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


@contextmanager
def pointer_lock(root: RootConfig, node: str) -> Iterator[None]:
    """Hold ``ROOT/.ckptd-pointer.lock`` while the pointer is read and moved.

    Waits for another holder; breaks a lock older than a minute (its holder crashed).

    Raises:
        OSError: (``EBUSY``) another node held it for longer than the wait.
    """
    path = os.path.join(root.path, POINTER_LOCK)
    deadline = time.monotonic() + _LOCK_WAIT
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            _break_if_stale(path)
            if time.monotonic() > deadline:
                raise OSError(errno.EBUSY, f"{path} is held by another node", path) from None
            time.sleep(0.02)  # another node's pointer move takes milliseconds
            continue
        break
    try:
        os.write(fd, f"{node} {now_iso()}\n".encode())
    finally:
        os.close(fd)
    try:
        yield
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _break_if_stale(path: str) -> None:
    try:
        age = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return
    if age < _LOCK_STALE:
        return
    # Renamed away first: of two nodes breaking it at once, one wins the rename.
    aside = f"{path}.{uuid.uuid4().hex}.stale"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    os.unlink(aside)

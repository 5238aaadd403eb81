"""Which attempt owns a ``tmp_step_N``: its marker, and moving other attempts' files aside.

An attempt is one run of a job saving a step. Before the daemon acknowledges a new
attempt it makes ``tmp_step_N`` that attempt's directory (:func:`prepare`): files a
trainer wrote there before its ``begin`` (NeMo-RL's ``training_info.json``) stay and
belong to the attempt; a directory that carries another attempt's marker (one the daemon
replaced, or one it never knew because its journal was lost) is moved into the root's
trash first. When an attempt fails, its directory goes to the trash before the failure
is reported (:func:`set_aside`), so the next attempt starts in a fresh directory.

Blocking filesystem calls only; the server runs them in worker threads under the root's
lock. Trash entries are named ``<tmp dir name>.attempt-<id>`` so that ``ckptd promote``
and ``gc`` can find them by step and attempt even without a journal.
"""

from __future__ import annotations

import os
import secrets
import uuid
from datetime import UTC, datetime
from typing import Final

import msgspec

from orchestrator.protocol import ATTEMPT_MARKER, AttemptMarker

from ..config._config import RootConfig
from ._durable import Staged, fsync_dir, stage, write_atomic

__all__ = [
    "TRASH",
    "Prepared",
    "StagedMarker",
    "encode_marker",
    "new_attempt_id",
    "prepare",
    "stage_marker",
    "read_marker",
    "set_aside",
    "set_aside_dirs",
    "trash_name",
]

TRASH: Final = ".ckptd-trash"
"""Directory inside each root where set-aside and removed saves go."""

_UNKNOWN: Final = "unknown"


def new_attempt_id() -> str:
    """A fresh attempt id: 16 hex digits, unique across restarts and nodes."""
    return secrets.token_hex(8)


class Prepared(msgspec.Struct, frozen=True):
    """What :func:`prepare` did.

    Attributes:
        moved: Where another attempt's directory went, if one was in the way.
        foreign: The attempt that directory's marker named ("unknown" if unreadable).
        created: Whether ``tmp_step_N`` had to be created.
        unsynced: Directories whose entries the caller must still flush (``sync=False``)
            before the attempt is acknowledged.
    """

    moved: str | None = None
    foreign: str | None = None
    created: bool = False
    unsynced: tuple[str, ...] = ()


class StagedMarker:
    """An attempt's marker, encoded, and where it can, written and flushed unnamed.

    Made by :func:`stage_marker` before the root's lock is taken, so that under it
    :func:`prepare` only links the flushed file into ``tmp_step_N``. :meth:`close` it
    once :func:`prepare` returned, whether or not it was used.
    """

    def __init__(self, data: bytes, file: Staged | None) -> None:
        self.data = data
        """The marker's bytes (what :func:`prepare` writes when nothing was staged)."""
        self.file = file
        """The flushed unnamed file holding :attr:`data`; None where there is none."""

    def close(self) -> None:
        """Release the unnamed file, if any."""
        if self.file is not None:
            self.file.close()
            self.file = None


def stage_marker(
    root: RootConfig, step: int, attempt: str, world_size: int, run: str = ""
) -> StagedMarker:
    """Attempt ``attempt``'s marker for step ``step``, flushed ahead of :func:`prepare`.

    Needs no lock: the file has no name until :func:`prepare` links it into place.

    Raises:
        OSError: the unnamed file cannot be written or synced.
    """
    data = encode_marker(root, step, attempt, world_size, run)
    return StagedMarker(data, stage(root.staging_dir, data))


def encode_marker(root: RootConfig, step: int, attempt: str, world_size: int, run: str) -> bytes:
    """Attempt ``attempt``'s marker for step ``step`` of ``root``, created now, as JSON."""
    marker = AttemptMarker(
        attempt=attempt,
        root=root.path,
        step=step,
        world_size=world_size,
        created=datetime.now(UTC).isoformat(),
        run=run,
    )
    return msgspec.json.encode(marker)


def read_marker(tmp: str) -> AttemptMarker | None:
    """The marker in ``tmp``; None if there is none.

    An unreadable marker reads as an attempt named "unknown": it is not this attempt's.
    """
    path = os.path.join(tmp, ATTEMPT_MARKER)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:
        return _unknown_marker()
    try:
        data = os.read(fd, 65536)
    finally:
        os.close(fd)
    try:
        return msgspec.json.decode(data, type=AttemptMarker)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _unknown_marker()


def prepare(
    root: RootConfig,
    step: int,
    attempt: str,
    world_size: int,
    run: str = "",
    *,
    sync: bool = True,
    staged: StagedMarker | None = None,
) -> Prepared:
    """Make ``tmp_step_N`` attempt ``attempt``'s directory, durably. Idempotent.

    A directory already marked for ``attempt`` is left as it is. One marked for any other
    attempt is moved into the trash and a fresh one created. An unmarked one (a trainer's
    files written before its ``begin``) is kept and marked. The marker records ``run``,
    the run of the job the attempt belongs to. The marker is written to a
    unique temporary name, fsynced and renamed into place, and the directory fsynced.

    Without ``sync``, only the marker's contents are flushed (before its rename, so a
    crash never leaves a torn one): its directory, and the root and the trash when a
    directory was created or moved there, are left for the caller to flush
    (:attr:`Prepared.unsynced`), outside the root's lock, where the flushes of
    concurrent new attempts overlap or are shared.

    With ``staged`` (:func:`stage_marker`, for this attempt), its already flushed file
    is linked into place instead, so the only flush left is the directories'; where it
    cannot be linked (no unnamed file, another filesystem), its bytes are written as
    above.

    Raises:
        OSError: the directory cannot be moved, created or marked.
    """
    tmp = root.tmp_dir(step)
    found = read_marker(tmp)
    if found is not None and found.attempt == attempt:
        return Prepared()
    moved = None
    unsynced: list[str] = []
    if found is not None:
        moved = _to_trash(root, step, found.attempt, sync=sync)
        unsynced += [] if sync else [os.path.join(root.path, TRASH)]
    created = False
    try:
        os.mkdir(tmp, 0o755)
        created = True
    except FileExistsError:
        pass
    path = os.path.join(tmp, ATTEMPT_MARKER)
    if staged is None or not _link(staged, path, sync=sync):
        if staged is None:
            staged = StagedMarker(encode_marker(root, step, attempt, world_size, run), None)
        write_atomic(path, staged.data, sync_dir=sync)
    if not sync:
        unsynced.insert(0, tmp)
    if created or moved is not None:
        # The new directory's entry is in the staging directory; the trash's in the root.
        changed = [root.staging_dir] if moved is None else list(_changed_by_move(root))
        if sync:
            for directory in changed:
                fsync_dir(directory)
        else:
            unsynced += changed
    foreign = None if found is None else found.attempt
    return Prepared(moved=moved, foreign=foreign, created=created, unsynced=tuple(unsynced))


def _link(staged: StagedMarker, path: str, *, sync: bool) -> bool:
    """Link the staged marker in as ``path``; False where it cannot be (write it instead)."""
    if staged.file is None:
        return False
    try:
        staged.file.place(path)
    except OSError:
        return False
    if sync:
        fsync_dir(os.path.dirname(path))
    return True


def set_aside(root: RootConfig, step: int, attempt: str, *, sync: bool = True) -> str | None:
    """Move failed attempt ``attempt``'s ``tmp_step_N`` into the trash.

    Only a directory that is this attempt's (its marker names it, or it has no marker:
    the attempt never got to mark it) is moved; one that a newer attempt already owns
    stays. Without ``sync``, the caller flushes :func:`set_aside_dirs` once it moved.

    Returns:
        Where it went, or None if there was nothing of this attempt's to move.

    Raises:
        OSError: the directory cannot be moved.
    """
    tmp = root.tmp_dir(step)
    if not os.path.isdir(tmp) or os.path.islink(tmp):
        return None
    found = read_marker(tmp)
    if found is not None and found.attempt != attempt:
        return None
    moved = _to_trash(root, step, attempt, sync=sync)
    if sync:
        for directory in _changed_by_move(root):
            fsync_dir(directory)
    return moved


def set_aside_dirs(root: RootConfig) -> tuple[str, ...]:
    """The directories a set-aside changes: the trash, the root, a staging directory.

    The staging directory (the one the tmp directory left) only when the root has one.
    """
    return (os.path.join(root.path, TRASH), *_changed_by_move(root))


def _changed_by_move(root: RootConfig) -> tuple[str, ...]:
    """The directories whose entries a move of a tmp directory into the trash changes."""
    return (root.path, root.staging) if root.staging else (root.path,)


def trash_name(root: RootConfig, step: int, attempt: str) -> str:
    """The trash entry a set-aside attempt's directory gets (unique per call)."""
    base = os.path.basename(root.tmp_dir(step))
    tag = attempt or _UNKNOWN
    return os.path.join(root.path, TRASH, f"{base}.attempt-{tag}-{uuid.uuid4().hex[:8]}")


def _to_trash(root: RootConfig, step: int, attempt: str, *, sync: bool = True) -> str:
    trash = os.path.join(root.path, TRASH)
    os.makedirs(trash, mode=0o700, exist_ok=True)
    target = trash_name(root, step, attempt)
    os.rename(root.tmp_dir(step), target)
    if sync:
        fsync_dir(trash)
    return target


def _unknown_marker() -> AttemptMarker:
    return AttemptMarker(attempt=_UNKNOWN, root="", step=-1, world_size=0, created="")

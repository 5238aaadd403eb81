"""Removing one doomed trash entry: many unlinks from several threads, never a mount.

Blocking; :mod:`daemon.store._trash` runs it in each root's remover thread. What fails
is sorted into errors that clear by themselves (:data:`TRANSIENT`, retried with a
growing delay) and the rest (reported); a mount point inside the entry is never crossed.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

__all__ = ["TRANSIENT", "WORKERS", "Removal", "remove_entry"]

WORKERS: Final = 8
"""Threads unlinking one entry's files at once."""

TRANSIENT: Final = frozenset({errno.EBUSY, errno.ENOTEMPTY, errno.ESTALE, errno.EAGAIN})
"""Errors that clear by themselves (a file in use, a directory refilled, NFS)."""

_NFS_SILLY: Final = ".nfs"

_SYNC_EVERY: Final = 32
"""Unlinks per thread between flushes of their directory (see :func:`_flush_parent`).

Measured with `bench/retention.py` (100,000 files, 2-vCPU VM, ext4): every 256 the next
promotion took 1.34x its median without retention, every 32 about 1.0x."""


@dataclass(slots=True)
class Removal:
    """What one pass over a doomed entry achieved.

    Byte and entry counts are of what this pass deleted; a retry counts only its own.
    """

    bytes: int = 0
    """Sizes of the files (and symlinks) this pass unlinked."""
    entries: int = 0
    """Files, symlinks and directories this pass removed."""
    gone: bool = False
    """Whether the entry no longer exists."""
    busy: list[str] = field(default_factory=list)
    """Why parts could not be removed yet (transient; retried)."""
    errors: list[str] = field(default_factory=list)
    """Why parts could not be removed at all (not retried on their own)."""


def remove_entry(
    path: str,
    *,
    workers: int = WORKERS,
    mounts: Iterable[str] = (),
    gate: threading.Event | None = None,
) -> Removal:
    """Delete ``path`` and everything under it, as far as one pass can. Blocking I/O.

    Symlinks are unlinked, never followed. Directories on another filesystem than
    ``path`` or in ``mounts`` (mount points) are not entered and not removed.

    Args:
        path: The doomed entry.
        workers: Threads unlinking files at once.
        mounts: Mount points, as in the mount table.
        gate: When given, every unlink, ``rmdir`` and directory listing waits until it
            is set: cleared while the root promotes (:meth:`TrashRemover.pause`).
    """
    result = Removal()
    try:
        top = os.lstat(path)
    except OSError as exc:
        result.gone = exc.errno == errno.ENOENT
        _problem(result, path, exc)
        return result
    mount_points = set(mounts)
    if path in mount_points:
        result.busy.append(f"{path} is a mount point")
        return result
    if not stat.S_ISDIR(top.st_mode):
        _unlink_all([path], 1, result, gate)
        result.gone = not result.busy and not result.errors
        return result
    files: list[str] = []
    dirs: list[str] = []  # parents before their children
    blocked: set[str] = set()  # directories that cannot be empty this pass
    stack = [path]
    while stack:
        directory = stack.pop()
        dirs.append(directory)
        if gate is not None:
            gate.wait()
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    try:
                        if not entry.is_dir(follow_symlinks=False):
                            files.append(entry.path)
                        elif _mount_point(entry, top.st_dev, mount_points):
                            result.busy.append(f"{entry.path} is a mount point")
                            _block(blocked, directory, path)
                        else:
                            stack.append(entry.path)
                    except OSError as exc:
                        if exc.errno != errno.ENOENT:  # gone meanwhile: nothing to do
                            _problem(result, entry.path, exc)
                            _block(blocked, directory, path)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                _problem(result, directory, exc)
                _block(blocked, directory, path)
    _unlink_all(files, workers, result, gate)
    for directory in reversed(dirs):
        if directory in blocked:
            continue
        if gate is not None:
            gate.wait()
        try:
            os.rmdir(directory)
        except FileNotFoundError:
            continue
        except OSError as exc:
            _problem(result, directory, exc)
            if directory != path:
                _block(blocked, os.path.dirname(directory), path)
            continue
        result.entries += 1
    result.gone = not os.path.lexists(path)
    return result


def _mount_point(entry: os.DirEntry[str], device: int, mount_points: set[str]) -> bool:
    """Whether ``entry`` (a directory) is where another filesystem is mounted."""
    # As ``rm --one-file-system``: another device is another filesystem. The lstat is
    # answered by the mounted filesystem (a hung one keeps this thread waiting). A bind
    # mount of the same filesystem shares its device, hence the mount table too.
    return entry.stat(follow_symlinks=False).st_dev != device or entry.path in mount_points


def _block(blocked: set[str], directory: str, top: str) -> None:
    """Mark ``directory`` and its ancestors up to ``top`` as unremovable this pass."""
    while directory not in blocked:
        blocked.add(directory)
        if len(directory) <= len(top):
            return
        directory = os.path.dirname(directory)


def _problem(result: Removal, path: str, exc: OSError) -> None:
    if exc.errno == errno.ENOENT:
        return
    why = f"{path}: {os.strerror(exc.errno) if exc.errno else exc}"
    if exc.errno == errno.EBUSY and os.path.basename(path).startswith(_NFS_SILLY):
        why += " (an NFS client's placeholder for a file still open somewhere)"
    (result.busy if exc.errno in TRANSIENT else result.errors).append(why)


def _flush_parent(path: str) -> None:
    """Commit the unlinks so far (fsync their directory), a few at a time.

    On a journaling filesystem the next ``fsync`` of anything commits every metadata
    change still pending: flushed here, in the deletion's thread, a promotion's first
    flush does not pay for thousands of unlinks at once.
    """
    try:
        fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # only an optimisation; the removal stands either way
    finally:
        os.close(fd)


def _unlink_all(
    paths: list[str], workers: int, result: Removal, gate: threading.Event | None = None
) -> None:
    """Unlink ``paths`` from up to ``workers`` threads, adding to ``result``."""
    queue = deque(paths)
    lock = threading.Lock()

    def work() -> None:
        done = size = 0
        problems: list[tuple[str, OSError]] = []
        while True:
            try:
                path = queue.popleft()
            except IndexError:
                break
            if gate is not None:
                gate.wait()
            try:
                length = os.lstat(path).st_size
                os.unlink(path)
            except OSError as exc:
                problems.append((path, exc))
                continue
            done += 1
            size += length
            if gate is not None and done % _SYNC_EVERY == 0:
                _flush_parent(path)
        with lock:
            result.entries += done
            result.bytes += size
            for failed, error in problems:
                _problem(result, failed, error)

    # About 64 files per thread: a thread for a handful of files costs more than it saves.
    count = max(1, min(workers, len(paths) // 64))
    threads = [threading.Thread(target=work, daemon=True) for _ in range(count - 1)]
    for thread in threads:
        thread.start()
    work()
    for thread in threads:
        thread.join()

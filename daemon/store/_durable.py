"""Durable small writes: a file replaced atomically, a directory's entries flushed.

Blocking I/O, shared by everything that writes the daemon's own small files (attempt
markers, layout files, manifests, the journal's directory).

Concurrent flushes of one directory share the disk's work (:func:`fsync_dir`): many
saves beginning or failing at once each add an entry to the root, and one ``fsync`` of
the root that starts after all of their changes makes every one of them durable. A
caller returns only once an ``fsync`` that began after its call ended without error, so
no promise is weaker than with a flush of its own.
"""

from __future__ import annotations

import errno
import os
import threading
import uuid
from dataclasses import dataclass, field

__all__ = ["Staged", "fsync_dir", "make_dir", "probe_write", "stage", "write_atomic"]


def write_atomic(path: str, data: bytes, *, sync_dir: bool = True) -> None:
    """Replace ``path`` with ``data``: a unique temp file, fsync, rename over ``path``.

    A reader sees the old contents or the new, never a part. With ``sync_dir`` the
    directory is fsynced too, so the new contents survive a crash from here on;
    without, the caller fsyncs the directory afterwards.

    Raises:
        OSError: the file cannot be written, synced or renamed (the temp file is gone).
    """
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        _write_synced(fd, data)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(os.path.dirname(path))


class Staged:
    """A small file's contents, written and flushed under no name yet (:func:`stage`).

    :meth:`place` gives it its name in one call, so a caller that must hold a lock while
    the name appears does only that under it, and the contents' flush overlaps the
    flushes of other callers'. :meth:`close` when done with it, placed or not.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def place(self, path: str) -> None:
        """Name the contents ``path``, which must not exist; atomic like a rename.

        The new name is durable once its directory is fsynced.

        Raises:
            OSError: ``path`` exists (``FileExistsError``), is on another filesystem
                (``EXDEV``), or cannot be linked.
        """
        # linkat(AT_SYMLINK_FOLLOW) of the fd's /proc entry: os.link uses linkat only
        # when given a directory fd (plain link(2) would link the /proc symlink itself).
        fds = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.link(str(self._fd), path, src_dir_fd=fds, follow_symlinks=True)
        finally:
            os.close(fds)

    def close(self) -> None:
        """Release the unnamed file (gone with it unless :meth:`place` named it)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def stage(directory: str, data: bytes) -> Staged | None:
    """``data`` written and fsynced into an unnamed file (``O_TMPFILE``) in ``directory``.

    A crash leaves nothing behind. None where the filesystem has no unnamed files (NFS,
    most FUSE servers): the caller then writes the file by :func:`write_atomic`.

    Raises:
        OSError: the file cannot be created, written or synced.
    """
    try:
        fd = os.open(directory, os.O_WRONLY | os.O_TMPFILE | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            return None
        raise
    try:
        _write_synced(fd, data)
    except BaseException:
        os.close(fd)
        raise
    return Staged(fd)


def _write_synced(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.fsync(fd)


@dataclass
class _Flushes:
    """The flushes of one directory: the last begun, the last ended, how each ended."""

    begun: int = 0
    ended: int = 0
    running: bool = False
    errors: dict[int, OSError] = field(default_factory=dict)
    waiting: int = 0


_flushes: dict[str, _Flushes] = {}
_flushes_changed = threading.Condition(threading.Lock())


def fsync_dir(path: str) -> None:
    """Flush the entries of directory ``path`` (``""`` is the working directory).

    Returns once an ``fsync`` of it that began after this call has succeeded: the one
    this call starts, or, while another thread's flush of the directory runs, the next
    one, which every caller arriving meanwhile shares.

    Raises:
        OSError: it cannot be opened or synced (every caller sharing that flush gets it).
    """
    key = os.path.abspath(path or ".")
    with _flushes_changed:
        state = _flushes.setdefault(key, _Flushes())
        # A flush under way may have begun before our change: the next one covers it.
        need = state.begun + 1
        state.waiting += 1
        try:
            while state.ended < need:
                if state.running:
                    _flushes_changed.wait()
                    continue
                state.running = True
                state.begun += 1
                ours = state.begun
                _flushes_changed.release()
                error: OSError | None = None
                try:
                    _flush(key)
                except OSError as exc:
                    error = exc
                finally:
                    _flushes_changed.acquire()
                    state.running = False
                    state.ended = ours
                    if error is not None:
                        state.errors[ours] = error
                    _flushes_changed.notify_all()
            failed = state.errors.get(need)
        finally:
            state.waiting -= 1
            if not state.waiting and not state.running:
                del _flushes[key]  # nobody shares its flushes now; keep the table small
    if failed is not None:
        raise OSError(failed.errno, failed.strerror, failed.filename)


def _flush(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dir(parent: str, name: str) -> str:
    """``parent/name``, created (mode 0755) if missing, with ``parent`` fsynced if it was.

    Returns:
        The directory's path.
    """
    directory = os.path.join(parent, name)
    try:
        os.mkdir(directory, 0o755)
    except FileExistsError:
        pass
    else:
        fsync_dir(parent)
    return directory


def probe_write(directory: str) -> None:
    """Create a file in ``directory`` and write a byte to it; leave nothing behind.

    The one check that sees a filesystem the kernel stopped writing to without
    flagging its mount (ext4 after an I/O error under ``errors=remount-ro``: ``statvfs``
    shows no ``ST_RDONLY`` and ``access`` says writable, yet every write is refused).
    An unnamed file (``O_TMPFILE``) where the filesystem has them, so a crash leaves no
    name; else a unique name, removed at once. Not synced: this asks whether the
    filesystem takes writes, and costs no flush.

    Raises:
        OSError: the file cannot be created or written (``EROFS``, ``EIO``, ``ENOSPC``...).
    """
    flags = os.O_WRONLY | os.O_CLOEXEC
    name = None
    try:
        fd = os.open(directory, flags | os.O_TMPFILE, 0o600)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
        name = os.path.join(directory, f".ckptd-probe.{uuid.uuid4().hex}.tmp")
        fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, b"\0")
    finally:
        os.close(fd)
        if name is not None:
            os.unlink(name)

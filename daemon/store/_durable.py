"""Durable small writes: a file replaced atomically, a directory's entries flushed.

Blocking I/O, shared by everything that writes the daemon's own small files (attempt
markers, layout files, manifests, the journal's directory).
"""

from __future__ import annotations

import errno
import os
import uuid

__all__ = ["fsync_dir", "make_dir", "probe_write", "write_atomic"]


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
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(os.path.dirname(path))


def fsync_dir(path: str) -> None:
    """Flush the entries of directory ``path`` (``""`` is the working directory).

    Raises:
        OSError: it cannot be opened or synced.
    """
    fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
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

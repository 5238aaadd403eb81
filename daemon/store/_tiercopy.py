"""Copying a fast-tier part to the durable root: checked, throttled, at low IO priority.

Each file is read once from the fast tier, hashed as it is read (the copy is of the
bytes the part file's checksum was computed over, or the copy fails), written to the
durable root's save directory and flushed; then the copy is read back and hashed, and
must match. A drain's bandwidth is capped by a token bucket shared by its threads, and
each thread lowers its own IO priority (``ioprio_set``) first.
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Final

from ..base._errors import VerificationError
from ..config._root import RootConfig
from ._tierpace import Throttle, in_drain_threads, lower_io_priority

__all__ = [
    "Throttle",
    "copy_checked",
    "copy_part",
    "drain_files",
    "drain_small",
    "lower_io_priority",
    "write_small",
]

_CHUNK: Final = 4 << 20
_PACED_CHUNK: Final = 1 << 20  # under a bandwidth cap: smaller steps, a smoother pace


def copy_checked(
    src: str, dst: str, size: int, sha256: str, throttle: Throttle, *, read_back: bool = True
) -> int:
    """Copy ``src`` to a new ``dst`` (parents made), checked against ``size``/``sha256``.

    The source is hashed as it is read; the copy is read back and hashed as it is
    written (a second thread follows the writer, so reading back overlaps writing, as
    on a full-duplex network filesystem), then flushed; both must match the checksum.

    Returns:
        The bytes copied.

    Raises:
        VerificationError: the source or the copy is not what the checksum says.
        OSError: a read or write failed (the partial copy is removed).
    """
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    chunk = _CHUNK if throttle.rate <= 0 else _PACED_CHUNK
    digest = hashlib.sha256()
    copied = 0
    tmp = f"{dst}.ckptd-drain.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    follower = _ReadBack(tmp) if read_back else None
    try:
        with open(src, "rb", buffering=0) as f:
            buf = bytearray(chunk)
            view = memoryview(buf)
            while n := f.readinto(buf):
                throttle.take(n)
                digest.update(view[:n])
                written = 0
                while written < n:
                    written += os.write(fd, view[written:n])
                copied += n
                if follower is not None:
                    follower.advance(copied)
        back = follower.finish() if follower is not None else sha256
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        if follower is not None:
            follower.finish()
        os.unlink(tmp)
        raise
    os.close(fd)
    if copied != size or digest.hexdigest() != sha256:
        os.unlink(tmp)
        raise VerificationError(
            f"{src} no longer matches its checksum (fast tier damaged since it was sealed)"
        )
    if back != sha256:
        os.unlink(tmp)
        raise VerificationError(f"the copy of {src} at {dst} does not match its checksum")
    os.replace(tmp, dst)
    return copied


class _ReadBack:
    """Reads a file back, as far as it has been written, in a thread; its SHA-256."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._digest = hashlib.sha256()
        self._written = 0
        self._ended = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="ckptd-drain-check")
        self._thread.start()

    def advance(self, written: int) -> None:
        with self._cond:
            self._written = written
            self._cond.notify()

    def finish(self) -> str:
        with self._cond:
            self._ended = True
            self._cond.notify()
        self._thread.join()
        os.close(self._fd)
        if self._error is not None:
            raise self._error
        return self._digest.hexdigest()

    def _run(self) -> None:
        offset = 0
        try:
            while True:
                with self._cond:
                    while offset >= self._written and not self._ended:
                        self._cond.wait()
                    target, ended = self._written, self._ended
                while offset < target:
                    data = os.pread(self._fd, min(_CHUNK, target - offset), offset)
                    if not data:
                        raise OSError(f"the copy ends at {offset} bytes, {target} written")
                    self._digest.update(data)
                    offset += len(data)
                if ended and offset >= self._written:
                    return
        except BaseException as exc:  # reported by finish()
            self._error = exc


def copy_part(
    src_dir: str,
    dst_dir: str,
    files: list[tuple[str, int, str]],
    *,
    threads: int,
    rate: float,
    ionice: str,
) -> int:
    """Copy a part's ``files`` (path, size, sha256) from ``src_dir`` into ``dst_dir``.

    ``threads`` files at a time, in threads of their own at IO priority ``ionice``,
    together at most ``rate`` bytes a second (0: uncapped). A file already there with
    the right checksum (a drain resumed) is not copied again.

    Returns:
        The bytes copied.

    Raises:
        VerificationError, OSError: as :func:`copy_checked`; the first one met.
    """
    throttle = Throttle(rate)

    def one(entry: tuple[str, int, str]) -> int:
        path, size, sha = entry
        dst = os.path.join(dst_dir, path)
        if _matches(dst, size, sha):
            return 0
        return copy_checked(os.path.join(src_dir, path), dst, size, sha, throttle)

    return in_drain_threads(one, files, threads, ionice)


def _matches(path: str, size: int, sha256: str) -> bool:
    try:
        if os.stat(path).st_size != size:
            return False
        digest = hashlib.sha256()
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
        return digest.hexdigest() == sha256
    except OSError:
        return False


def write_small(path: str, data: bytes) -> None:
    """Write a small file (parents made) and flush it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def drain_files(
    root: RootConfig,
    src_dir: str,
    dst: str,
    files: list[tuple[str, int, str]],
    *,
    threads: int,
    rate: float,
    ionice: str,
) -> int:
    """Copy a part's files into ``dst``, the durable save of ``root``; the bytes copied.

    :func:`copy_part` on a filesystem; uploads on an object store
    (:func:`daemon.store._tierobj.copy_part`).
    """
    if root.on_object_store:
        from . import _tierobj

        return _tierobj.copy_part(
            root, src_dir, dst, files, threads=threads, rate=rate, ionice=ionice
        )
    return copy_part(src_dir, dst, files, threads=threads, rate=rate, ionice=ionice)


def drain_small(root: RootConfig, path: str, data: bytes) -> None:
    """Write a small file of a drain (the checksums) at ``path`` in ``root``'s save."""
    if root.on_object_store:
        from . import _tierobj

        _tierobj.write_small(root, path, data)
    else:
        write_small(path, data)

"""A rate-limited FUSE passthrough: a durable root well below the local disk's speed.

``python -m bench._throttlefs BACKING MOUNT --mb-s 40`` serves ``BACKING`` at ``MOUNT``
(foreground, until unmounted) with reads and writes each capped at ``--mb-s`` MB/s,
like a network filesystem's link (full duplex). ``direct_io`` keeps the kernel's page
cache out of it, so every read crosses the cap, as a restart on another node would.
Uses fusepy (libfuse 2), a benchmark-only dependency.
"""

from __future__ import annotations

import argparse
import errno
import os
import threading
import time
from typing import Any

from fuse import FUSE, FuseOSError, Operations  # type: ignore[import-untyped]


class _Bucket:
    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.lock = threading.Lock()
        self.next = time.monotonic()

    def take(self, n: int) -> None:
        with self.lock:
            now = time.monotonic()
            start = max(self.next, now - 0.05)
            self.next = start + n / self.rate
            wait = self.next - now
        if wait > 0:
            time.sleep(wait)


class Throttled(Operations):  # type: ignore[misc]
    """Passthrough of ``backing`` with every read and write paced."""

    def __init__(self, backing: str, rate: float) -> None:
        self.backing = backing
        self.reads = _Bucket(rate)
        self.writes = _Bucket(rate)

    def _p(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def access(self, path: str, mode: int) -> None:
        if not os.access(self._p(path), mode):
            raise FuseOSError(errno.EACCES)

    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        st = os.lstat(self._p(path))
        keys = ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink")
        return {k: getattr(st, k) for k in (*keys, "st_size", "st_uid")}

    def readdir(self, path: str, fh: Any) -> list[str]:
        return [".", "..", *os.listdir(self._p(path))]

    def readlink(self, path: str) -> str:
        return os.readlink(self._p(path))

    def mkdir(self, path: str, mode: int) -> None:
        os.mkdir(self._p(path), mode)

    def rmdir(self, path: str) -> None:
        os.rmdir(self._p(path))

    def unlink(self, path: str) -> None:
        os.unlink(self._p(path))

    def symlink(self, target: str, source: str) -> None:
        os.symlink(source, self._p(target))

    def rename(self, old: str, new: str) -> None:
        os.rename(self._p(old), self._p(new))

    def link(self, target: str, source: str) -> None:
        os.link(self._p(source), self._p(target))

    def chmod(self, path: str, mode: int) -> None:
        os.chmod(self._p(path), mode)

    def chown(self, path: str, uid: int, gid: int) -> None:
        os.chown(self._p(path), uid, gid)

    def utimens(self, path: str, times: Any = None) -> None:
        os.utime(self._p(path), times)

    def statfs(self, path: str) -> dict[str, Any]:
        st = os.statvfs(self._p(path))
        keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree")
        return {k: getattr(st, k) for k in (*keys, "f_files", "f_flag", "f_frsize", "f_namemax")}

    def open(self, path: str, flags: int) -> int:
        return os.open(self._p(path), flags)

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        return os.open(self._p(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        data = os.pread(fh, size, offset)
        self.reads.take(len(data))
        return data

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        self.writes.take(len(data))
        return os.pwrite(fh, data, offset)

    def truncate(self, path: str, length: int, fh: Any = None) -> None:
        os.truncate(self._p(path), length)

    def flush(self, path: str, fh: int) -> None:
        pass

    def release(self, path: str, fh: int) -> None:
        os.close(fh)

    def fsync(self, path: str, datasync: bool, fh: int) -> None:
        os.fsync(fh)

    def fsyncdir(self, path: str, datasync: bool, fh: Any) -> None:
        fd = os.open(self._p(path), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def main() -> None:
    """Serve until unmounted."""
    parser = argparse.ArgumentParser()
    parser.add_argument("backing")
    parser.add_argument("mount")
    parser.add_argument("--mb-s", type=float, default=40.0)
    args = parser.parse_args()
    FUSE(
        Throttled(os.path.abspath(args.backing), args.mb_s * 1e6),
        args.mount,
        foreground=True,
        nothreads=False,
        allow_other=True,
        direct_io=True,
        big_writes=True,
        max_write=1 << 20,
    )


if __name__ == "__main__":
    main()

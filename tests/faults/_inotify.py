"""Acting the instant a name appears in a directory (Linux inotify, through ctypes).

For a test that must write a file the moment the daemon moves a directory into place,
as a trainer on another thread would: the kernel wakes the watcher on the rename itself,
with no polling and no sleep.
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
import time
from typing import Final

__all__ = ["Appearance"]

_IN_CREATE: Final = 0x100
_IN_MOVED_TO: Final = 0x80
_EVENT: Final = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name

_libc = ctypes.CDLL(None, use_errno=True)


class Appearance:
    """Watches ``directory`` for ``name`` being created in it or renamed into it.

    Args:
        directory: The directory to watch; the watch starts at once.
        name: The entry to wait for.

    Raises:
        OSError: inotify refused (e.g. no watches left).
    """

    def __init__(self, directory: str, name: str) -> None:
        self._name = os.fsencode(name)
        self._fd = _libc.inotify_init1(os.O_CLOEXEC | os.O_NONBLOCK)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        mask = _IN_CREATE | _IN_MOVED_TO
        if _libc.inotify_add_watch(self._fd, os.fsencode(directory), mask) < 0:
            err = ctypes.get_errno()
            os.close(self._fd)
            raise OSError(err, f"inotify_add_watch {directory}")

    def wait(self, timeout: float) -> bool:
        """Block until the name appears; False if ``timeout`` seconds pass first."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([self._fd], [], [], left)
            if ready and self._name in self._names(os.read(self._fd, 65536)):
                return True

    @staticmethod
    def _names(data: bytes) -> list[bytes]:
        names, at = [], 0
        while at + _EVENT.size <= len(data):
            _wd, _mask, _cookie, length = _EVENT.unpack_from(data, at)
            at += _EVENT.size
            names.append(data[at : at + length].rstrip(b"\0"))
            at += length
        return names

    def close(self) -> None:
        """Stop watching."""
        os.close(self._fd)

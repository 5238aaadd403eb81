"""A drain's pace: a shared bandwidth cap and a low IO priority for its threads."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Final

__all__ = ["Throttle", "lower_io_priority"]

_IOPRIO_WHO_PROCESS: Final = 1
_IOPRIO_CLASS_SHIFT: Final = 13
_CLASSES: Final = {"best-effort": (2, 7), "idle": (3, 0)}
_SYS_IOPRIO_SET: Final = {"x86_64": 251, "aarch64": 30}


class Throttle:
    """A token bucket: at most ``rate`` bytes a second across the threads sharing it."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def take(self, n: int) -> None:
        """Wait until ``n`` more bytes may pass."""
        if self.rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(self._next, now - 0.25)  # at most a quarter second of burst
            self._next = start + n / self.rate
            wait = self._next - now  # the bytes pass once their time has come
        if wait > 0:
            time.sleep(wait)


def lower_io_priority(kind: str) -> bool:
    """Set this thread's IO priority class (``idle``/``best-effort``); whether it took."""
    if kind not in _CLASSES:
        return False
    number = _SYS_IOPRIO_SET.get(os.uname().machine)
    if number is None:
        return False
    cls, level = _CLASSES[kind]
    libc = ctypes.CDLL(None, use_errno=True)
    tid = threading.get_native_id()
    return (
        int(libc.syscall(number, _IOPRIO_WHO_PROCESS, tid, (cls << _IOPRIO_CLASS_SHIFT) | level))
        == 0
    )

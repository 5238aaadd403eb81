"""A drain's pace: a shared bandwidth cap and a low IO priority for its threads."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Final, TypeVar

__all__ = ["Throttle", "in_drain_threads", "lower_io_priority"]

_PR_SET_NAME: Final = 15
_IOPRIO_WHO_PROCESS: Final = 1
_IOPRIO_CLASS_SHIFT: Final = 13
_CLASSES: Final = {"best-effort": (2, 7), "idle": (3, 0)}
_SYS_IOPRIO_SET: Final = {"x86_64": 251, "aarch64": 30}

_E = TypeVar("_E")


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
    """Name this thread ``ckptd-drain`` and set its IO class; whether the class took.

    ``kind``: ``idle`` or ``best-effort`` (its lowest level); anything else leaves the
    class. The name (``top -H``, ``/proc/PID/task/TID/comm``) shows the drain's threads.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_NAME, ctypes.c_char_p(b"ckptd-drain"), 0, 0, 0)
    if kind not in _CLASSES:
        return False
    number = _SYS_IOPRIO_SET.get(os.uname().machine)
    if number is None:
        return False
    cls, level = _CLASSES[kind]
    tid = threading.get_native_id()
    return (
        int(libc.syscall(number, _IOPRIO_WHO_PROCESS, tid, (cls << _IOPRIO_CLASS_SHIFT) | level))
        == 0
    )


def in_drain_threads(
    one: Callable[[_E], int], entries: Iterable[_E], threads: int, ionice: str
) -> int:
    """``sum(one(e) for e in entries)``, ``threads`` at a time in the drain's own threads.

    Named ``ckptd-drain``, each at IO class ``ionice`` (:func:`lower_io_priority`); the
    first exception raised by ``one`` is raised here.
    """
    with ThreadPoolExecutor(
        max_workers=max(1, threads),
        thread_name_prefix="ckptd-drain",
        initializer=lower_io_priority,
        initargs=(ionice,),
    ) as pool:
        return sum(pool.map(one, entries))

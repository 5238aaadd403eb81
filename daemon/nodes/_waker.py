"""Waking a watcher of a shared directory: at a change it can see, else on a timer.

inotify (through watchfiles) sees only this machine's writes; on a network or FUSE
filesystem other nodes' changes are invisible to it, so those roots are polled.

A job's nodes all poll one server: a node waiting for the outcome stretches its
interval to ``nodes / poll_budget`` seconds (``stretch``) when that is longer, and
starts at a random point of its first interval, so that the job's looks are spread
evenly over time rather than arriving together (docs/multinode.md, "The load").
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import asynccontextmanager
from typing import Final

import anyio
import watchfiles
from anyio.abc import TaskGroup

from ..config._config import RootConfig
from ..ledger._saves import SaveKey

__all__ = ["Waker", "stretched", "watching"]

_SAFETY_POLL: Final = 1.0
"""Seconds between looks even when watchfiles reports nothing (a missed event)."""
WRITING_POLL: Final = 5.0
"""Seconds between looks while this node's own ranks still write: a thousand nodes
polling a shared filesystem every ``poll_interval`` for a whole save would load its
server for nothing; only a failure elsewhere is looked for then, and 5 s is soon enough."""


def stretched(root: RootConfig, nodes: int) -> float:
    """Seconds between one node's looks so that ``nodes`` of them make ``poll_budget`` a second."""
    return max(nodes, 1) / root.poll_budget


class Waker:
    """Wakes a watcher when ``path`` changes (watchfiles), or every ``interval`` seconds.

    Args:
        path: What to watch with inotify.
        interval: Seconds between looks when polling; None: inotify, with a look every
            second in case an event was missed.
        group: Where the inotify watch runs.
        stretch: The least seconds between looks either way (``nodes / poll_budget``).
    """

    def __init__(
        self, path: str, interval: float | None, group: TaskGroup | None, stretch: float = 0.0
    ) -> None:
        self._path = path
        self._interval = interval
        self._group = group
        self._stretch = stretch
        self._first = stretch > 0
        self._changed = anyio.Event()
        self._stop = anyio.Event()

    async def __aenter__(self) -> Callable[[bool], Awaitable[None]]:
        if self._interval is None and self._group is not None:
            self._group.start_soon(self._pump)
        return self.wait

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()

    async def wait(self, writing: bool = False) -> None:
        """Return at the next change, or after the interval.

        Args:
            writing: This node's ranks still write: when polling, look only every
                :data:`WRITING_POLL` seconds.
        """
        if self._interval is None:
            interval = max(_SAFETY_POLL, self._stretch)
        else:
            interval = max(self._interval, self._stretch)
            if writing:
                interval = max(interval, WRITING_POLL)
        if self._first:
            # A random phase: nodes whose markers landed together look at spread times.
            self._first = False
            interval *= random.random()
        with anyio.move_on_after(interval):
            await self._changed.wait()
        self._changed = anyio.Event()

    def poke(self) -> None:
        """Wake the watcher now (its node's own state changed: it looks at once).

        The next wait starts a new random phase: the nodes of a job are poked together
        (their ranks finished together), and must not look in step from then on.
        """
        self._first = self._stretch > 0
        self._changed.set()

    async def _pump(self) -> None:
        try:
            async for _ in watchfiles.awatch(
                self._path,
                watch_filter=None,
                recursive=False,
                step=5,
                debounce=100,
                stop_event=self._stop,
                ignore_permission_denied=True,
            ):
                self._changed.set()
        except (OSError, RuntimeError):
            self._interval = _SAFETY_POLL / 4  # cannot watch it: poll instead
            self._changed.set()


@asynccontextmanager
async def watching(
    root: RootConfig,
    path: str,
    key: SaveKey,
    wakers: dict[SaveKey, Waker],
    local: Collection[str],
    group: TaskGroup | None,
    stretch: float = 0.0,
) -> AsyncIterator[Callable[[bool], Awaitable[None]]]:
    """A :class:`Waker` for ``key``'s watcher of ``path``, listed in ``wakers`` meanwhile.

    The root's ``watch`` setting picks inotify or polling; ``auto`` watches roots in
    ``local`` (on a local filesystem) and polls the others. ``stretch``: see
    :class:`Waker`.
    """
    mode = root.watch
    if mode == "auto":
        mode = "inotify" if root.path in local else "poll"
    waker = Waker(path, root.poll_interval if mode == "poll" else None, group, stretch)
    async with waker as wake:
        wakers[key] = waker
        try:
            yield wake
        finally:
            if wakers.get(key) is waker:
                del wakers[key]

"""Lanes: each root's blocking filesystem calls run in threads of their own.

A call on a hung filesystem (an NFS server gone away, a FUSE server stopped) blocks its
thread until the server answers. So that it blocks nothing else, every blocking call the
daemon makes on behalf of a checkpoint root runs in that root's :class:`Lane`: at most
``root_threads`` threads that serve only that root, started when needed and retired when
idle; calls beyond them wait their turn in the lane. The journal has a lane of its own
(one thread), so its writes and fsyncs never wait behind a root's calls.

:class:`Lanes` watches them all: once a call has been running for ``fs_stall_after``
seconds, the root (``root.stalled``) or the journal (``journal.stalled``) is reported
stalled, and reported again once no call has been running that long (``*.recovered``).

A caller may leave a read-only call it no longer needs (``abandon=True``: a ``wait``
whose timeout passed, a connection closed at shutdown). The call keeps its thread until
the filesystem answers, so a hung root never holds more than its lane's threads, and the
threads are daemon threads: one stuck on a hung mount does not keep the process alive.

The daemon runs on asyncio (uvloop or the standard loop); results come back to it with
``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from functools import partial
from typing import Any, Final, Protocol, TypeVar, TypeVarTuple, cast

import anyio
from anyio.abc import TaskGroup, TaskStatus

from orchestrator import protocol as p

from ..base._events import Events


class _HasLane(Protocol):
    """What :class:`Lanes` needs of the journal (``daemon.store._journal.Journal``)."""

    @property
    def lane(self) -> Lane: ...

    @property
    def path(self) -> str: ...


__all__ = ["Lane", "Lanes"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

_IDLE: Final = 10.0
"""Seconds an idle lane thread waits for a call before it retires."""

_Outcome = tuple[Any, BaseException | None]
_Job = tuple[asyncio.AbstractEventLoop, Callable[..., Any], tuple[Any, ...], Callable[..., None]]


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any) -> bool:
    """Schedule ``callback`` on ``loop`` from a thread; False once the loop is closed."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        return False
    return True


class _Worker:
    """One daemon thread of a lane, handed one call at a time by the event loop."""

    def __init__(self, lane: Lane, loop: asyncio.AbstractEventLoop) -> None:
        self._lane = lane
        self._loop = loop
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        name = f"ckptd-lane {lane.name}"
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                job = self.jobs.get(timeout=_IDLE)
            except queue.Empty:
                # The event loop retires this thread (it sends None) unless it has handed
                # it a call meanwhile. A closed loop never answers: the thread stays the
                # lane's, idle, for whatever loop calls next.
                _call_soon(self._loop, self._lane._retire, self)
                job = self.jobs.get()
            if job is None:
                return
            self._loop, fn, args, done = job
            try:
                outcome: _Outcome = (fn(*args), None)
            except BaseException as exc:  # not handled here: raised again in the caller
                outcome = (None, exc)
            if not _call_soon(self._loop, done, outcome):
                return  # the event loop is gone, and with it whoever waited
            del job, fn, args, done, outcome


class Lane:
    """Runs blocking calls for one root (or the journal) in threads of its own.

    Args:
        name: What the lane serves: a root's path, or ``journal``.
        threads: Calls that may run at once; more wait for a thread.
        clock: Monotonic clock in seconds.
    """

    def __init__(
        self, name: str, threads: int, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if threads < 1:
            raise ValueError(f"a lane needs at least one thread, got {threads}")
        self.name = name
        self.threads = threads
        self._clock = clock
        self._slots = anyio.Semaphore(threads)
        self._idle: list[_Worker] = []
        self._ids = itertools.count()
        self._running: dict[int, tuple[str, float]] = {}  # call -> (name, start), in order
        self.on_change: Callable[[Lane], None] = lambda _lane: None
        """Called (on the event loop) when the lane goes from idle to busy, and when a
        call ends while the lane is reported stalled; :class:`Lanes` sets it."""
        self.stalled_since: float | None = None
        """When the oldest call of a reported stall began; None while not stalled."""

    async def run(self, fn: Callable[[*Ts], T], *args: *Ts, abandon: bool = False) -> T:
        """Call ``fn(*args)`` in one of the lane's threads and return what it returns.

        Waits for a thread first if all of them are busy (that wait can always be
        cancelled). Once the call runs, cancellation leaves it only if ``abandon`` is
        true; it then still holds its thread until it returns, and its outcome is
        dropped. Use ``abandon`` only for calls that change nothing.

        Raises:
            BaseException: whatever ``fn`` raised.
        """
        await self._slots.acquire()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_Outcome] = loop.create_future()
        call = next(self._ids)
        self._running[call] = (getattr(fn, "__name__", "call").lstrip("_"), self._clock())
        worker = self._idle.pop() if self._idle else _Worker(self, loop)
        worker.jobs.put((loop, fn, args, partial(self._finished, call, future, worker)))
        if len(self._running) == 1:
            self.on_change(self)
        with anyio.CancelScope(shield=not abandon):
            result, error = await future
        if error is not None:
            try:
                raise error
            finally:
                del error  # no cycle through this frame's traceback
        return cast(T, result)

    def _finished(
        self, call: int, future: asyncio.Future[_Outcome], worker: _Worker, outcome: _Outcome
    ) -> None:
        del self._running[call]
        self._idle.append(worker)
        self._slots.release()
        if not future.cancelled():  # a caller that abandoned the call is gone
            future.set_result(outcome)
        if self.stalled_since is not None:
            self.on_change(self)

    def _retire(self, worker: _Worker) -> None:
        if worker in self._idle:
            self._idle.remove(worker)
            worker.jobs.put(None)

    def oldest(self) -> tuple[str, float] | None:
        """The name and start time of the call running longest, or None when idle."""
        return next(iter(self._running.values()), None)

    def busy_for(self) -> float:
        """Seconds the call running longest has run; 0.0 when the lane is idle."""
        oldest = self.oldest()
        return 0.0 if oldest is None else self._clock() - oldest[1]

    @property
    def running(self) -> int:
        """Calls under way in the lane's threads, abandoned ones included."""
        return len(self._running)

    @property
    def queued(self) -> int:
        """Calls waiting for one of the lane's threads."""
        return self._slots.statistics().tasks_waiting


class Lanes:
    """The lanes of a daemon's roots, and the watch that reports stalled ones.

    Args:
        roots: Paths of the configured roots; each gets a lane.
        threads: Threads of each root's lane.
        stall_after: Seconds a call may run before its root (or the journal) is
            reported stalled.
        events: Where ``root.stalled`` and the like go.
        journal: Its lane is watched too, when given.
        clock: Monotonic clock in seconds.
    """

    def __init__(
        self,
        roots: Iterable[str],
        *,
        threads: int,
        stall_after: float,
        events: Events,
        journal: _HasLane | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lanes = {root: Lane(root, threads, clock=clock) for root in roots}
        self._threads = threads
        self._journal = journal
        self._stall_after = stall_after
        self._events = events
        self._clock = clock
        self._changed = anyio.Event()
        self._due: float | None = None  # when the watch looks next; None: once woken
        self._group: TaskGroup | None = None
        for lane in self._watched():
            lane.on_change = self._wake

    def __getitem__(self, root: str) -> Lane:
        """The lane of the configured root ``root``."""
        return self._lanes[root]

    def add(self, root: str) -> None:
        """Give ``root`` a lane of its own (a root a reload added); a known root keeps its."""
        if root not in self._lanes:
            lane = self._lanes[root] = Lane(root, self._threads, clock=self._clock)
            lane.on_change = self._wake

    async def run(self, root: str, fn: Callable[[*Ts], T], *args: *Ts, abandon: bool = False) -> T:
        """``fn(*args)`` in the lane of ``root``; see :meth:`Lane.run`."""
        return await self._lanes[root].run(fn, *args, abandon=abandon)

    def stalled(self, root: str | None = None) -> list[p.StallInfo]:
        """What is stalled now: every root (or only ``root``), and the journal."""
        infos = []
        now = self._clock()
        for lane in self._watched():
            oldest = lane.oldest()
            if lane.stalled_since is None or oldest is None:
                continue
            which = None if self._is_journal(lane) else lane.name
            if root is not None and which not in (None, root):
                continue
            infos.append(
                p.StallInfo(
                    root=which,
                    call=oldest[0],
                    blocked_s=round(now - oldest[1], 3),
                    running=lane.running,
                    queued=lane.queued,
                )
            )
        return infos

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Watch for stalls and run :meth:`settle`'s jobs, until cancelled."""
        async with anyio.create_task_group() as group:
            self._group = group
            group.start_soon(self._watch)
            task_status.started()

    async def settle(
        self, jobs: Mapping[str, Callable[[], Awaitable[object]]], within: float
    ) -> list[str]:
        """Start every job; return once all have ended or ``within`` seconds passed.

        Jobs still running then go on in the background (until :meth:`serve` is
        cancelled), so one hung root delays the caller by ``within`` at most.

        Returns:
            The keys of the jobs still running, sorted.
        """
        assert self._group is not None, "settle runs only while the lanes are served"
        pending = set(jobs)
        finished = anyio.Event()

        async def one(key: str, job: Callable[[], Awaitable[object]]) -> None:
            try:
                await job()
            finally:
                pending.discard(key)
                if not pending:
                    finished.set()

        for key, job in jobs.items():
            self._group.start_soon(one, key, job)
        if pending:
            with anyio.move_on_after(within):
                await finished.wait()
        return sorted(pending)

    # -- the watch ----------------------------------------------------------------------

    def _watched(self) -> list[Lane]:
        lanes = list(self._lanes.values())
        return lanes if self._journal is None else [*lanes, self._journal.lane]

    def _is_journal(self, lane: Lane) -> bool:
        return self._journal is not None and lane is self._journal.lane

    def _wake(self, lane: Lane) -> None:
        # A lane that just got busy can stall no sooner than stall_after from now: if the
        # watch looks before that anyway, it need not wake (a busy journal wakes it once
        # per stall_after, not once per batch).
        due = self._due
        if (
            lane.stalled_since is None
            and due is not None
            and due <= self._clock() + self._stall_after
        ):
            return
        self._changed.set()

    async def _watch(self) -> None:
        while True:
            self._changed = anyio.Event()
            now = self._clock()
            deadline: float | None = None
            for lane in self._watched():
                oldest = lane.oldest()
                blocked = 0.0 if oldest is None else now - oldest[1]
                if lane.stalled_since is not None and blocked < self._stall_after:
                    self._recovered(lane, now)
                elif oldest is not None and lane.stalled_since is None:
                    if blocked >= self._stall_after:
                        self._stalled(lane, oldest[0], oldest[1], now)
                    else:
                        due = oldest[1] + self._stall_after
                        deadline = due if deadline is None else min(deadline, due)
            self._due = deadline
            if deadline is None:
                await self._changed.wait()
            else:
                with anyio.move_on_after(max(0.0, deadline - now)):
                    await self._changed.wait()

    def _stalled(self, lane: Lane, call: str, started: float, now: float) -> None:
        lane.stalled_since = started
        blocked_s = round(now - started, 3)
        if self._journal is not None and self._is_journal(lane):
            self._events.emit(
                "journal.stalled", "error", path=self._journal.path, call=call, blocked_s=blocked_s
            )
            return
        self._events.emit(
            "root.stalled",
            "warning",
            root=lane.name,
            call=call,
            blocked_s=blocked_s,
            running=lane.running,
            queued=lane.queued,
        )

    def _recovered(self, lane: Lane, now: float) -> None:
        assert lane.stalled_since is not None
        stalled_s = round(now - lane.stalled_since, 3)
        lane.stalled_since = None
        if self._journal is not None and self._is_journal(lane):
            self._events.emit("journal.recovered", path=self._journal.path, stalled_s=stalled_s)
        else:
            self._events.emit("root.recovered", root=lane.name, stalled_s=stalled_s)

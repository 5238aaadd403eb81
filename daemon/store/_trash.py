"""Background deletion of what ``gc`` doomed: ``ROOT/.ckptd-trash/delete/*``.

Deleting a checkpoint is many metadata calls (one unlink per file), which on a network
filesystem are round trips and on a hung one never return. None of it runs on the event
loop or under a root's lock: each root has its own remover thread, which unlinks files
from several threads at once and reports each entry it finishes as ``trash.deleted``.

The remover only ever looks inside the doomed area, never at kept entries of the trash.
The doomed area is its to-do list: what a previous run of the daemon had doomed is found
and deleted when the next run starts.

Some failures go away by themselves and are retried with a growing delay for as long as
the daemon runs (``trash.busy``): ``EBUSY`` (a file still in use; on NFS, a ``.nfs*``
file the client made of a file that was unlinked while open, which lasts until the last
process closes it), ``ENOTEMPTY`` (a directory that gained entries meanwhile, such as
``.nfs*`` files) and ``ESTALE``. A mount point inside a doomed entry is never crossed
(deleting the mounted filesystem's contents is not gc's business); it counts as busy
until it is unmounted. Any other error (``EACCES``, ``EROFS``, ``EIO``...) is reported as
``trash.failed`` and the entry is left until the next ``gc --yes`` or daemon start.

The threads are daemon threads: a removal stuck on a hung filesystem never holds up the
daemon's exit; whatever it had left is deleted by the next run.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import anyio.from_thread
import anyio.lowlevel

from ..base._events import Events
from ..config._config import RootConfig
from ._gc import doomed_dir
from ._mounts import mount_table
from ._remove import WORKERS, remove_entry
from ._steps import doomed_step

__all__ = ["TrashRemover"]

FIRST_RETRY: Final = 0.1
"""Seconds before the first retry of an entry that could not be removed yet."""

MAX_RETRY: Final = 30.0
"""Longest delay between retries; the delay doubles from :data:`FIRST_RETRY` to this."""


@dataclass(slots=True)
class _Pending:
    """A doomed entry not yet gone, across passes."""

    first_seen: float
    bytes: int = 0
    entries: int = 0
    attempts: int = 0
    retry_at: float = 0.0
    delay: float = FIRST_RETRY
    failed: bool = False  # a non-transient error: wait for the next kick


class _RootRemover:
    """The thread deleting one root's doomed entries."""

    def __init__(
        self, root: RootConfig, emit: Callable[..., None], workers: int, gate: threading.Event
    ) -> None:
        self._root = root
        self._emit = emit
        self._workers = workers
        self.gate = gate
        self._cond = threading.Condition()
        self._kicked = True
        self._closed = False
        self._pending: dict[str, _Pending] = {}
        self._thread = threading.Thread(
            target=self._run, name=f"ckptd-trash {root.path}", daemon=True
        )
        self._thread.start()

    def kick(self) -> None:
        with self._cond:
            self._kicked = True
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        try:
            while self._wait():
                self._pass()
        except _LoopGone:
            return  # the daemon is exiting; the next run resumes

    def _wait(self) -> bool:
        """Wait for a kick or the next retry; False once closed."""
        with self._cond:
            while not self._closed:
                if self._kicked:
                    self._kicked = False
                    for pending in self._pending.values():
                        pending.failed = False
                        pending.retry_at = 0.0
                    return True
                due = [p.retry_at for p in self._pending.values() if not p.failed]
                if due and min(due) <= time.monotonic():
                    return True
                self._cond.wait(None if not due else min(due) - time.monotonic())
            return False

    def _pass(self) -> None:
        """One pass over every doomed entry that is due."""
        base = doomed_dir(self._root)
        try:
            names = sorted(os.listdir(base))
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                self._event("trash.failed", "error", entry=None, reason=_reason(base, exc))
            names = []
        self._pending = {n: p for n, p in self._pending.items() if n in names}
        now = time.monotonic()
        mounts = _mount_points(base)
        for name in names:
            pending = self._pending.setdefault(name, _Pending(first_seen=now))
            if pending.failed or pending.retry_at > now:
                continue
            pending.attempts += 1
            removal = remove_entry(
                os.path.join(base, name), workers=self._workers, mounts=mounts, gate=self.gate
            )
            pending.bytes += removal.bytes
            pending.entries += removal.entries
            if removal.gone:
                del self._pending[name]
                self._event(
                    "trash.deleted",
                    "info",
                    entry=name,
                    bytes=pending.bytes,
                    entries=pending.entries,
                    attempts=pending.attempts,
                    duration_s=round(time.monotonic() - pending.first_seen, 3),
                )
                step = doomed_step(self._root, name)
                if step is not None:  # a checkpoint retention retired: now it is gone
                    self._event(
                        "checkpoint.deleted", "info", step=step, entry=name, bytes=pending.bytes
                    )
            elif removal.errors:
                pending.failed = True
                self._event(
                    "trash.failed",
                    "error",
                    entry=name,
                    reason=removal.errors[0],
                    problems=len(removal.errors) + len(removal.busy),
                )
            else:
                pending.retry_at = time.monotonic() + pending.delay
                # Logged on the 1st, 2nd, 4th, 8th... try: a long wait stays a few lines.
                if pending.attempts & (pending.attempts - 1) == 0:
                    self._event(
                        "trash.busy",
                        "warning",
                        entry=name,
                        reason=removal.busy[0] if removal.busy else "not removed yet",
                        problems=len(removal.busy),
                        attempts=pending.attempts,
                        retry_in_s=pending.delay,
                    )
                pending.delay = min(pending.delay * 2, MAX_RETRY)

    def _event(self, name: str, level: str, **fields: Any) -> None:
        try:
            self._emit(name, level, root=self._root.path, **fields)
        except RuntimeError:  # anyio: the event loop is closed
            raise _LoopGone from None


class _LoopGone(Exception):
    """The event loop that takes this thread's events has ended."""


def _mount_points(base: str) -> list[str]:
    """Mount points at or below ``base``, from this process's mount table."""
    prefix = base.rstrip("/") + "/"
    points = []
    for line in mount_table().splitlines():
        fields = line.split()
        if len(fields) < 2:
            continue
        point = fields[1].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
        if point.startswith(prefix):
            points.append(point)
    return points


def _reason(path: str, exc: OSError) -> str:
    return f"{path}: {os.strerror(exc.errno) if exc.errno else exc}"


class TrashRemover:
    """Deletes every root's doomed trash entries in the background.

    Args:
        events: Where ``trash.*`` events go; emitted on the event loop.
        roots: The configured roots.
        workers: Threads unlinking one entry's files at once.
    """

    def __init__(
        self, events: Events, roots: Iterable[RootConfig], *, workers: int = WORKERS
    ) -> None:
        self._events = events
        self._roots = {root.path: root for root in roots}
        self._workers = workers
        self._removers: dict[str, _RootRemover] = {}
        self._gates: dict[str, threading.Event] = {}
        self._pausing: dict[str, int] = {}
        self._emit: Callable[..., None] | None = None

    def start(self) -> None:
        """Start removing; resumes what a previous run doomed. Call on the event loop."""
        token = anyio.lowlevel.current_token()

        def emit(name: str, level: str, **fields: Any) -> None:
            call = functools.partial(self._events.emit, name, level, **fields)
            anyio.from_thread.run_sync(call, token=token)

        self._emit = emit
        for path, root in self._roots.items():
            if not root.on_object_store:  # deleted in place there: nothing is doomed
                self._removers[path] = _RootRemover(root, emit, self._workers, self._gate(path))

    @contextlib.contextmanager
    def pause(self, root: RootConfig) -> Iterator[None]:
        """Hold ``root``'s deletion while the block runs (a promotion). Never blocks.

        Its threads stop before their next unlink, ``rmdir`` or listing and go on once no
        pause of the root is left: a promotion's flushes never queue behind a deletion's
        metadata writes, nor its verification behind the deletion's threads.
        """
        path = root.path
        gate = self._gate(path)
        self._pausing[path] += 1
        gate.clear()
        try:
            yield
        finally:
            self._pausing[path] -= 1
            if not self._pausing[path]:
                gate.set()

    def add(self, root: RootConfig) -> None:
        """Remove ``root``'s doomed entries too (a root a reload added); on the event loop."""
        self._roots[root.path] = root
        if root.on_object_store:
            return
        if self._emit is not None and root.path not in self._removers:
            gate = self._gate(root.path)
            self._removers[root.path] = _RootRemover(root, self._emit, self._workers, gate)

    def _gate(self, path: str) -> threading.Event:
        """The event ``path``'s remover waits on while the root promotes (set: go)."""
        if path not in self._gates:
            self._gates[path] = threading.Event()
            self._gates[path].set()
            self._pausing[path] = 0
        return self._gates[path]

    def kick(self, root: RootConfig) -> None:
        """There is something new to delete in ``root``; never blocks."""
        remover = self._removers.get(root.path)
        if remover is not None:
            remover.kick()

    def close(self) -> None:
        """Stop after the current pass; a pass stuck on a hung filesystem is left behind."""
        for remover in self._removers.values():
            remover.close()
        self._removers.clear()

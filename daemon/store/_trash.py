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
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import anyio.from_thread
import anyio.lowlevel

from ..base._events import Events
from ..config._config import RootConfig
from ._gc import doomed_dir
from ._mounts import mount_table
from ._steps import doomed_step

__all__ = ["TRANSIENT", "Removal", "TrashRemover", "remove_entry"]

WORKERS: Final = 8
"""Threads unlinking one entry's files at once."""

FIRST_RETRY: Final = 0.1
"""Seconds before the first retry of an entry that could not be removed yet."""

MAX_RETRY: Final = 30.0
"""Longest delay between retries; the delay doubles from :data:`FIRST_RETRY` to this."""

TRANSIENT: Final = frozenset({errno.EBUSY, errno.ENOTEMPTY, errno.ESTALE, errno.EAGAIN})
"""Errors that clear by themselves (a file in use, a directory refilled, NFS)."""

_NFS_SILLY: Final = ".nfs"
_SYNC_EVERY: Final = 32
"""Unlinks per thread between flushes of their directory (see :func:`_flush_parent`).

Measured with `bench/retention.py` (100,000 files, 2-vCPU VM, ext4): every 256 the next
promotion took 1.34x its median without retention, every 32 about 1.0x."""


@dataclass(slots=True)
class Removal:
    """What one pass over a doomed entry achieved.

    Byte and entry counts are of what this pass deleted; a retry counts only its own.
    """

    bytes: int = 0
    """Sizes of the files (and symlinks) this pass unlinked."""
    entries: int = 0
    """Files, symlinks and directories this pass removed."""
    gone: bool = False
    """Whether the entry no longer exists."""
    busy: list[str] = field(default_factory=list)
    """Why parts could not be removed yet (transient; retried)."""
    errors: list[str] = field(default_factory=list)
    """Why parts could not be removed at all (not retried on their own)."""


def remove_entry(
    path: str,
    *,
    workers: int = WORKERS,
    mounts: Iterable[str] = (),
    gate: threading.Event | None = None,
) -> Removal:
    """Delete ``path`` and everything under it, as far as one pass can. Blocking I/O.

    Symlinks are unlinked, never followed. Directories on another filesystem than
    ``path`` or in ``mounts`` (mount points) are not entered and not removed.

    Args:
        path: The doomed entry.
        workers: Threads unlinking files at once.
        mounts: Mount points, as in the mount table.
        gate: When given, every unlink, ``rmdir`` and directory listing waits until it
            is set: cleared while the root promotes (:meth:`TrashRemover.pause`).
    """
    result = Removal()
    try:
        top = os.lstat(path)
    except OSError as exc:
        result.gone = exc.errno == errno.ENOENT
        _problem(result, path, exc)
        return result
    mount_points = set(mounts)
    if path in mount_points:
        result.busy.append(f"{path} is a mount point")
        return result
    if not stat.S_ISDIR(top.st_mode):
        _unlink_all([path], 1, result, gate)
        result.gone = not result.busy and not result.errors
        return result
    files: list[str] = []
    dirs: list[str] = []  # parents before their children
    blocked: set[str] = set()  # directories that cannot be empty this pass
    stack = [path]
    while stack:
        directory = stack.pop()
        dirs.append(directory)
        if gate is not None:
            gate.wait()
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    try:
                        if not entry.is_dir(follow_symlinks=False):
                            files.append(entry.path)
                        elif _mount_point(entry, top.st_dev, mount_points):
                            result.busy.append(f"{entry.path} is a mount point")
                            _block(blocked, directory, path)
                        else:
                            stack.append(entry.path)
                    except OSError as exc:
                        if exc.errno != errno.ENOENT:  # gone meanwhile: nothing to do
                            _problem(result, entry.path, exc)
                            _block(blocked, directory, path)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                _problem(result, directory, exc)
                _block(blocked, directory, path)
    _unlink_all(files, workers, result, gate)
    for directory in reversed(dirs):
        if directory in blocked:
            continue
        if gate is not None:
            gate.wait()
        try:
            os.rmdir(directory)
        except FileNotFoundError:
            continue
        except OSError as exc:
            _problem(result, directory, exc)
            if directory != path:
                _block(blocked, os.path.dirname(directory), path)
            continue
        result.entries += 1
    result.gone = not os.path.lexists(path)
    return result


def _mount_point(entry: os.DirEntry[str], device: int, mount_points: set[str]) -> bool:
    """Whether ``entry`` (a directory) is where another filesystem is mounted."""
    # As ``rm --one-file-system``: another device is another filesystem. The lstat is
    # answered by the mounted filesystem (a hung one keeps this thread waiting). A bind
    # mount of the same filesystem shares its device, hence the mount table too.
    return entry.stat(follow_symlinks=False).st_dev != device or entry.path in mount_points


def _block(blocked: set[str], directory: str, top: str) -> None:
    """Mark ``directory`` and its ancestors up to ``top`` as unremovable this pass."""
    while directory not in blocked:
        blocked.add(directory)
        if len(directory) <= len(top):
            return
        directory = os.path.dirname(directory)


def _problem(result: Removal, path: str, exc: OSError) -> None:
    if exc.errno == errno.ENOENT:
        return
    why = f"{path}: {os.strerror(exc.errno) if exc.errno else exc}"
    if exc.errno == errno.EBUSY and os.path.basename(path).startswith(_NFS_SILLY):
        why += " (an NFS client's placeholder for a file still open somewhere)"
    (result.busy if exc.errno in TRANSIENT else result.errors).append(why)


def _flush_parent(path: str) -> None:
    """Commit the unlinks so far (fsync their directory), a few at a time.

    On a journaling filesystem the next ``fsync`` of anything commits every metadata
    change still pending: flushed here, in the deletion's thread, a promotion's first
    flush does not pay for thousands of unlinks at once.
    """
    try:
        fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # only an optimisation; the removal stands either way
    finally:
        os.close(fd)


def _unlink_all(
    paths: list[str], workers: int, result: Removal, gate: threading.Event | None = None
) -> None:
    """Unlink ``paths`` from up to ``workers`` threads, adding to ``result``."""
    queue = deque(paths)
    lock = threading.Lock()

    def work() -> None:
        done = size = 0
        problems: list[tuple[str, OSError]] = []
        while True:
            try:
                path = queue.popleft()
            except IndexError:
                break
            if gate is not None:
                gate.wait()
            try:
                length = os.lstat(path).st_size
                os.unlink(path)
            except OSError as exc:
                problems.append((path, exc))
                continue
            done += 1
            size += length
            if gate is not None and done % _SYNC_EVERY == 0:
                _flush_parent(path)
        with lock:
            result.entries += done
            result.bytes += size
            for failed, error in problems:
                _problem(result, failed, error)

    # About 64 files per thread: a thread for a handful of files costs more than it saves.
    count = max(1, min(workers, len(paths) // 64))
    threads = [threading.Thread(target=work, daemon=True) for _ in range(count - 1)]
    for thread in threads:
        thread.start()
    work()
    for thread in threads:
        thread.join()


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

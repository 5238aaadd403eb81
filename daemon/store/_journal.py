"""The journal file: every acknowledged state change, durable before its reply.

Appends from many concurrent requests share one ``write`` and one ``fsync`` (group
commit): a request waits only for the batch it joined. On open, a torn or corrupt tail
is reported and cut off, never replayed (:func:`daemon.ledger._records.parse`).
:meth:`Journal.compact` rewrites the file as a snapshot of the live state so it does not
grow without bound. The records themselves are the ledger's
(:mod:`daemon.ledger._records`); this module only stores them.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import anyio

from ..ledger._records import HEADER, JournalRecord, Replay, frame, parse
from ._durable import fsync_dir
from ._lanes import Lane

__all__ = ["Journal"]


@dataclass(slots=True)
class _Batch:
    data: list[bytes] = field(default_factory=list)
    done: anyio.Event = field(default_factory=anyio.Event)
    error: OSError | None = None


class Journal:
    """An append-only, checksummed, fsynced log with group commit.

    Args:
        path: The journal file (created if missing).
        sync: fsync after each batch; only tests that measure the cost turn it off.
    """

    def __init__(self, path: str, *, sync: bool = True) -> None:
        self.path = path
        self._sync = sync
        self._fd = -1
        self._size = 0
        self._batch = _Batch()
        self._wake = anyio.Event()
        self.lane = Lane("journal", 1)
        """The journal's own thread: its writes, fsyncs and compactions run there, never
        behind a root's filesystem calls."""
        self.commits = 0
        """Batches written (for observing group commit)."""
        self.on_flush: Callable[[float], None] | None = None
        """Called on the event loop with the seconds each batch's write and fsync took
        (the metrics' journal flush latency); None: nothing is called."""

    @property
    def size(self) -> int:
        """Bytes in the journal file."""
        return self._size

    def open(self) -> Replay:
        """Read every intact record, cut off a torn tail, and open for appending.

        Blocking I/O; call before serving.

        Raises:
            OSError: the file cannot be read or created.
            ValueError: the file exists but is not a ckptd journal.
        """
        os.makedirs(os.path.dirname(self.path) or ".", mode=0o700, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:  # one daemon per journal: a second one would interleave its appends
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise OSError(
                    errno.EWOULDBLOCK, "another ckptd is using this state directory", self.path
                ) from None
            with os.fdopen(os.dup(fd), "rb") as fh:
                replay = parse(fh.read())
            if replay.dropped_bytes:
                os.ftruncate(fd, replay.valid_bytes)
            if replay.valid_bytes == 0:  # new, or torn while its header was written
                os.lseek(fd, 0, os.SEEK_SET)
                os.write(fd, HEADER)
                replay.valid_bytes = len(HEADER)
            os.fsync(fd)
            fsync_dir(os.path.dirname(self.path))
            os.lseek(fd, replay.valid_bytes, os.SEEK_SET)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._size = replay.valid_bytes
        return replay

    def close(self) -> None:
        """Close the file."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    async def append(self, records: Sequence[JournalRecord]) -> None:
        """Return once ``records`` are durable.

        Raises:
            OSError: the batch could not be written or synced (e.g. ``ENOSPC``); the
                records may or may not be on disk, and the caller must not acknowledge.
        """
        if not records:
            return
        batch = self._batch
        batch.data.append(b"".join(frame(r) for r in records))
        self._wake.set()
        await batch.done.wait()
        if batch.error is not None:
            raise batch.error

    async def run(
        self,
        snapshot: Callable[[], list[JournalRecord]] | None = None,
        compact_at: int = 64 * 1024 * 1024,
    ) -> None:
        """Write batches as they fill; one write and one fsync per batch. Runs forever.

        Args:
            snapshot: Records rebuilding the live state; when given, the journal is
                compacted to them between batches once it exceeds ``compact_at`` bytes
                and twice its size after the last compaction.
            compact_at: Size in bytes that triggers compaction.
        """
        floor = self._size
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            batch, self._batch = self._batch, _Batch()
            if not batch.data:
                continue
            with anyio.CancelScope(shield=True):
                started = time.perf_counter()
                try:
                    await self.lane.run(self._write, b"".join(batch.data))
                except OSError as exc:
                    batch.error = exc
                batch.done.set()
                if self.on_flush is not None:
                    self.on_flush(time.perf_counter() - started)
                if snapshot is not None and self._size > max(compact_at, 2 * floor):
                    # Between batches: nothing else writes the file now. Changes already
                    # in the next batch may also be in the snapshot; replay is idempotent.
                    try:
                        await self.lane.run(self.compact, snapshot())
                    except OSError:
                        pass  # keep appending to the old file; retried after a batch
                    floor = self._size

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
            if self._sync:
                os.fsync(self._fd)
        except OSError:
            # Cut a partial batch off so the next one is not appended after garbage.
            os.ftruncate(self._fd, self._size)
            os.lseek(self._fd, self._size, os.SEEK_SET)
            raise
        self._size += len(data)
        self.commits += 1

    def compact(self, records: Iterable[JournalRecord]) -> None:
        """Replace the journal with ``records`` (a snapshot of the live state).

        Blocking I/O. Written to a temporary file, fsynced, renamed over the journal and
        the directory fsynced: a crash leaves either the old journal or the new one.
        Call only while no batch is being written.
        """
        data = HEADER + b"".join(frame(r) for r in records)
        tmp = f"{self.path}.compact"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        # Lock the new file before the rename makes it the journal, so no other daemon
        # can take it between the rename and this daemon reopening it.
        fd = os.open(tmp, os.O_RDWR | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.replace(tmp, self.path)
        fsync_dir(os.path.dirname(self.path))
        self.close()
        self._fd = fd
        os.lseek(self._fd, 0, os.SEEK_END)
        self._size = len(data)

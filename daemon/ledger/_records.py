"""The journal: every acknowledged state change, durable before its reply.

An append-only file of framed records, each ``<length u32><crc32 u32><msgpack payload>``
after an 8-byte header. Appends from many concurrent requests share one ``write`` and one
``fsync`` (group commit): a request waits only for the batch it joined. On open, a torn
or corrupt tail (a crash mid-write, a bad sector) is detected by its length or checksum,
reported and cut off, never replayed. :meth:`Journal.compact` rewrites the file as a
snapshot of the live state so it does not grow without bound.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

import anyio
import msgspec

from orchestrator.protocol import FileEntry

from ..store._durable import fsync_dir
from ..store._lanes import Lane

__all__ = [
    "JBegin",
    "JDone",
    "JFail",
    "JForget",
    "JHold",
    "JIntent",
    "JLearned",
    "JMetrics",
    "JNodeMarked",
    "JPin",
    "JPromoted",
    "JRemote",
    "JRescue",
    "JRetired",
    "JSaveFailed",
    "JSetAside",
    "Journal",
    "JournalFormatError",
    "JournalRecord",
    "Replay",
    "frame",
    "parse",
]

_MAGIC: Final = b"CKPTDJ\x00\x01"
_FRAME: Final = struct.Struct("<II")
_MAX_RECORD: Final = 64 * 1024 * 1024


class _Record(msgspec.Struct, frozen=True, tag_field="t", array_like=True):
    root: str
    step: int


class JBegin(_Record, frozen=True, tag="b"):
    """A rank began a save (wall-clock ``at``) as part of attempt ``attempt``.

    A begin whose attempt differs from the step's current one, or that follows the
    step's failure, starts a new attempt. (``attempt`` is last and optional, so records
    written before attempts had ids still decode, as attempt "".)
    """

    rank: int
    world_size: int
    at: float
    attempt: str = ""
    local_world_size: int = 0
    """The job's ranks on this node; 0: all of them (also what older records read as)."""


class JDone(_Record, frozen=True, tag="d"):
    """A rank's writes landed."""

    rank: int
    files: list[FileEntry]
    at: float


class JFail(_Record, frozen=True, tag="f"):
    """A rank reported failure."""

    rank: int
    reason: str
    at: float


class JSaveFailed(_Record, frozen=True, tag="x"):
    """The save failed as a whole (lease, timeout, verification, promotion)."""

    reason: str
    at: float


class JIntent(_Record, frozen=True, tag="i"):
    """Verification passed; the rename to ``step_N`` may happen from here on."""


class JPromoted(_Record, frozen=True, tag="p"):
    """The rename is durable: the step is a checkpoint."""

    path: str
    at: float


class JRescue(_Record, frozen=True, tag="r"):
    """An operator asked to promote the step (``ckptd promote``)."""

    at: float
    attempt: str = ""
    world_size: int = 0
    """The world size its node markers say, for a step no journal knew (0: unknown)."""


class JForget(_Record, frozen=True, tag="g"):
    """``gc`` removed the save's files; forget it."""


class JSetAside(_Record, frozen=True, tag="a"):
    """The failed attempt ``attempt``'s directory was moved to ``path`` (in the trash)."""

    attempt: str
    path: str
    at: float


class JNodeMarked(_Record, frozen=True, tag="n"):
    """This node's marker for attempt ``attempt`` of a save that spans nodes is durable."""

    attempt: str
    at: float


class JRemote(_Record, frozen=True, tag="m"):
    """The leader took node ``node``'s marker: its ranks are done with these files."""

    node: str
    attempt: str
    local_world_size: int
    ranks: list[int]
    files: list[list[FileEntry]]
    """The files of each rank in ``ranks``, in the same order."""
    at: float


class JLearned(_Record, frozen=True, tag="l"):
    """The outcome of a save that spans nodes, read from the shared directory.

    ``detail`` is the checkpoint's path when ``promoted``, else the failure's reason.
    """

    attempt: str
    promoted: bool
    detail: str
    at: float


class JMetrics(_Record, frozen=True, tag="ret.m"):
    """Metrics of the step, merged over what it had (retention's ``keep_best``).

    With ``attempt``: reported in that attempt's ``done``s, the step's once that attempt
    is promoted; without: the promoted checkpoint's (``training_info.json``, ``score``).
    ``adopted``: the step was found promoted and took its metrics; what its attempts
    reported is settled.
    """

    metrics: dict[str, float]
    attempt: str = ""
    adopted: bool = False


class JPin(_Record, frozen=True, tag="ret.pin"):
    """The step was pinned (``pinned``) or unpinned: retention never retires a pinned step."""

    pinned: bool


class JHold(_Record, frozen=True, tag="ret.hold"):
    """A reader holds the step until ``until`` (wall-clock seconds); a past time releases."""

    until: float


class JRetired(_Record, frozen=True, tag="ret.retired"):
    """Retention moved the step into the trash as ``entry`` (its doomed name)."""

    entry: str
    rule: str = ""


JournalRecord = (
    JBegin
    | JDone
    | JFail
    | JSaveFailed
    | JIntent
    | JPromoted
    | JRescue
    | JForget
    | JSetAside
    | JNodeMarked
    | JRemote
    | JLearned
    | JMetrics
    | JPin
    | JHold
    | JRetired
)
"""Every kind of journal record."""

_encoder: Final = msgspec.msgpack.Encoder()
_decoder: Final = msgspec.msgpack.Decoder(JournalRecord)


class JournalFormatError(ValueError):
    """Raised by :func:`parse` for an intact record this version cannot read.

    Its checksum matches, so it is no torn tail: it was written by a newer ckptd.
    Replaying around it or cutting the journal there would lose acknowledged state, so
    the daemon refuses to start instead.
    """


def frame(record: JournalRecord) -> bytes:
    """One record as it is stored."""
    payload = _encoder.encode(record)
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


@dataclass(slots=True)
class Replay:
    """What :meth:`Journal.open` found on disk."""

    records: list[JournalRecord]
    valid_bytes: int
    dropped_bytes: int
    """Bytes of a torn or corrupt tail that were cut off (0 for a clean journal)."""
    problem: str | None = None


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
                os.write(fd, _MAGIC)
                replay.valid_bytes = len(_MAGIC)
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
        data = _MAGIC + b"".join(frame(r) for r in records)
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


def parse(data: bytes) -> Replay:
    """Every intact record of a journal's bytes, stopping at the first torn frame.

    A frame whose length runs past the end or whose checksum does not match is a torn
    tail (a crash mid-write, a bad sector): it and everything after it are dropped. A
    frame that is intact but cannot be decoded was written by another version.

    Raises:
        ValueError: ``data`` does not start with the journal header.
        JournalFormatError: an intact record of a kind or shape this version does not know.
    """
    if not data.startswith(_MAGIC):
        if _MAGIC.startswith(data):  # empty, or a crash while its header was written
            return Replay([], 0, len(data), "torn header" if data else None)
        raise ValueError("not a ckptd journal (bad header)")
    records: list[JournalRecord] = []
    pos = len(_MAGIC)
    problem = None
    while pos < len(data):
        if pos + _FRAME.size > len(data):
            problem = "torn frame header"
            break
        length, crc = _FRAME.unpack_from(data, pos)
        start, end = pos + _FRAME.size, pos + _FRAME.size + length
        if length > _MAX_RECORD or end > len(data):
            problem = "torn record"
            break
        payload = data[start:end]
        if zlib.crc32(payload) != crc:
            problem = "checksum mismatch"
            break
        try:
            records.append(_decoder.decode(payload))
        except msgspec.DecodeError as exc:
            raise JournalFormatError(
                f"intact record {len(records) + 1} at byte {pos} cannot be read by this "
                f"version ({exc}); it was probably written by a newer ckptd. Refusing to "
                "start rather than lose acknowledged state: run the newer version, or move "
                "the state directory aside to start empty"
            ) from None
        pos = end
    return Replay(records, pos, len(data) - pos, problem)

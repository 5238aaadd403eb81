"""The journal's records: every acknowledged state change, and how it is stored.

A journal is an append-only file of framed records, each
``<length u32><crc32 u32><msgpack payload>`` after an 8-byte header (:data:`HEADER`).
:func:`frame` encodes one record; :func:`parse` reads a file's bytes back, cutting off a
torn or corrupt tail (a crash mid-write, a bad sector), found by its length or checksum,
and refusing an intact record of a kind this version does not know. Pure: the file itself
is :class:`daemon.store._journal.Journal`'s.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Final

import msgspec

from orchestrator.protocol import FileEntry

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
    "HEADER",
    "JournalFormatError",
    "JournalRecord",
    "Replay",
    "frame",
    "parse",
]

HEADER: Final = b"CKPTDJ\x00\x01"
"""The 8 bytes every journal file starts with."""
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
    run: str = ""
    """The run of the job the begin named; "": unnamed (also what older records read as)."""


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
    flushed: bool = False
    """The node flushed those files before its marker (the leader need not)."""


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
    """What :func:`parse` found in a journal's bytes."""

    records: list[JournalRecord]
    valid_bytes: int
    dropped_bytes: int
    """Bytes of a torn or corrupt tail that were cut off (0 for a clean journal)."""
    problem: str | None = None


def parse(data: bytes) -> Replay:
    """Every intact record of a journal's bytes, stopping at the first torn frame.

    A frame whose length runs past the end or whose checksum does not match is a torn
    tail (a crash mid-write, a bad sector): it and everything after it are dropped. A
    frame that is intact but cannot be decoded was written by another version.

    Raises:
        ValueError: ``data`` does not start with the journal header.
        JournalFormatError: an intact record of a kind or shape this version does not know.
    """
    if not data.startswith(HEADER):
        if HEADER.startswith(data):  # empty, or a crash while its header was written
            return Replay([], 0, len(data), "torn header" if data else None)
        raise ValueError("not a ckptd journal (bad header)")
    records: list[JournalRecord] = []
    pos = len(HEADER)
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

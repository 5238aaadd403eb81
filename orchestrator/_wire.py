"""What travels between the client and the daemon: messages, their saves, reply lines.

The I/O thread (``_channel.py``) keeps each message it was handed as an
:class:`Outgoing` until the daemon answers it, and each ``begin``'s save as a
:class:`SaveRecord`, which that save's ``done`` and ``fail`` refer to. Replies arrive
as one byte stream that :class:`ReplyLines` cuts into lines, bounded in length: a line
longer than the bound is given as a :class:`TooLong` (with its head, from which
:func:`reply_id` reads the id of the call it answers) and never buffered whole.
"""

from __future__ import annotations

import concurrent.futures
import re
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from . import protocol as p

__all__ = ["Answer", "Barrier", "Outgoing", "ReplyLines", "SaveRecord", "TooLong", "reply_id"]

# msgspec writes a reply's fields in order: "id" comes first.
_REPLY_ID: Final = re.compile(rb'\s*\{\s*"id"\s*:\s*(-?\d{1,19})\s*[,}]')

Answer = Literal["pending", "acknowledged", "refused", "lost"]
"""What became of a save's ``begin``."""


@dataclass(eq=False, slots=True)
class SaveRecord:
    """One ``begin``'s save as the I/O thread knows it; written on that thread only.

    Attributes:
        root: The checkpoint root.
        step: The step.
        rank: The rank.
        world_size: Ranks writing the step.
        local_world_size: The step's ranks on this node, as the ``begin`` said (None:
            all of them); every re-sent ``begin`` says the same.
        answer: What became of the begin: ``pending`` until answered, ``lost`` when it
            can never be (dropped, or its reply could not be read).
        attempt: The attempt the daemon put in its acknowledgement (None before, and
            from a daemon that predates attempts).
        held: The save's ``done``/``fail``, waiting for the ``begin`` to be answered.
        run: The run the ``begin`` named; every re-sent ``begin`` names it too.
        settled: The acknowledged ``done`` or ``fail`` that ended this rank's part,
            kept (with the record) among the client's recent saves, so that a daemon
            that restarts without its state directory learns it again.
        replayed: Re-sent after a reconnect although this rank's part had ended: a
            refusal or a promoted answer then only means the daemon already knew.
        ended: When (monotonic) its ``done``/``fail`` was acknowledged.
    """

    root: str
    step: int
    rank: int
    world_size: int
    local_world_size: int | None = None
    answer: Answer = "pending"
    run: str | None = None
    attempt: str | None = None
    held: list[Outgoing] = field(default_factory=list)
    settled: Outgoing | None = None
    replayed: bool = False
    ended: float = 0.0

    @property
    def key(self) -> tuple[str, int, int]:
        """``(root, step, rank)``."""
        return (self.root, self.step, self.rank)


@dataclass(slots=True)
class Outgoing:
    """A message handed to the I/O thread, kept until the daemon answers it.

    Attributes:
        message: The request (its ``id`` is given when it is first sent).
        future: Resolves with the reply, for a caller waiting on one.
        record: The save a ``begin``, ``done`` or ``fail`` belongs to.
        line: The encoded line, as (re-)sent.
    """

    message: p.Request
    future: concurrent.futures.Future[dict[str, Any]] | None = None
    record: SaveRecord | None = None
    line: bytes = b""


@dataclass(frozen=True, slots=True)
class Barrier:
    """Resolves ``future`` once everything queued before it is acknowledged."""

    future: concurrent.futures.Future[None]


@dataclass(frozen=True, slots=True)
class TooLong:
    """A reply line longer than the limit, discarded; ``head`` is its first bytes."""

    head: bytes


class ReplyLines:
    """Splits the daemon's byte stream into lines of at most ``limit`` bytes.

    A line longer than that (newline included) is not buffered past the limit: it is
    given as one :class:`TooLong` and the rest of it is skipped up to its newline.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buf = bytearray()
        self._scanned = 0  # bytes of _buf known to hold no newline
        self._skipping = False

    def feed(self, data: bytes) -> list[bytes | TooLong]:
        """Take the next bytes; return every line they complete, without newlines."""
        out: list[bytes | TooLong] = []
        if self._skipping:
            end = data.find(b"\n")
            if end < 0:
                return out
            data, self._skipping = data[end + 1 :], False
        buf = self._buf
        buf += data
        start = 0
        while (end := buf.find(b"\n", max(start, self._scanned))) >= 0:
            if end + 1 - start > self.limit:
                out.append(TooLong(bytes(buf[start : start + 64])))
            else:
                out.append(bytes(buf[start:end]))
            start = end + 1
        del buf[:start]
        self._scanned = len(buf)
        if len(buf) >= self.limit:  # even its newline would not fit any more
            out.append(TooLong(bytes(buf[:64])))
            buf.clear()
            self._scanned, self._skipping = 0, True
        return out


def reply_id(head: bytes) -> int | None:
    """The ``id`` at the start of a reply line, if it can be read from ``head``."""
    found = _REPLY_ID.match(head)
    return None if found is None else int(found[1])

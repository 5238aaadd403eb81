"""Events: one JSON line per transition on stdout, fanned out to subscribers.

Event names are stable API (``docs/events.md``). A subscriber receives exactly the object
the log line holds. A subscriber that falls behind by more than its buffer is cut off
rather than allowed to grow the daemon's memory.

stdout is written by a thread from a bounded buffer, several lines per write, so a
reader that stops reading (a stuck journald, a full pipe) never stalls the event loop:
once the buffer is full, further lines are dropped and counted, and a ``stdout.dropped``
line reports how many as soon as stdout takes lines again.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Final, TextIO

import anyio
import msgspec
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from structlog.typing import EventDict

__all__ = ["STDOUT_BUFFER", "Events", "configure_logging", "flush_logging", "set_log_level"]

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_LEVELS["error"] = logging.ERROR

STDOUT_BUFFER: Final = 1 << 20
"""Bytes of event lines held for stdout while its reader is not keeping up."""

_GATHER: Final = 0.002
"""Seconds the writer waits after the first line of a burst before writing it."""

# Objects JSON has no type for are written as their repr, as structlog's renderer did.
_encoder: Final = msgspec.json.Encoder(enc_hook=repr)


_second: list[Any] = [None, ""]  # the last whole second seen and its ISO 8601 text


def _timestamp() -> str:
    """Now as ``2026-11-29T20:03:21.106216Z``; the date part is formatted once a second."""
    now = time.time()
    second = int(now)
    if _second[0] != second:
        _second[:] = [second, datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")]
    return f"{_second[1]}.{int((now - second) * 1e6):06d}Z"


def _event_first(_logger: object, _method: str, event: EventDict) -> EventDict:
    """Put ``event``, ``timestamp`` and ``level`` first, so lines read well in a terminal."""
    head = {k: event.pop(k) for k in ("event", "timestamp", "level") if k in event}
    return {**head, **event}


def _render(_logger: object, _method: str, event: EventDict) -> bytes:
    """One compact JSON line, the same bytes a subscriber receives."""
    return _encoder.encode(event) + b"\n"


class _Writer:
    """Writes lines from a thread; the caller only appends to a bounded buffer.

    Args:
        write: Writes all of its argument (blocking); an ``OSError`` means the reader
            is gone for good, and everything from then on is discarded.
        limit: Bytes the buffer may hold; a line that does not fit is dropped.
    """

    def __init__(self, write: Callable[[bytes], None], limit: int) -> None:
        self._write = write
        self._limit = limit
        self._buf = bytearray()
        self._dropped = 0
        self._waiting = False  # the thread sleeps until notified
        self._writing = False
        self._broken = False
        self._cond = threading.Condition(threading.Lock())
        self._thread = threading.Thread(target=self._run, name="ckptd-stdout", daemon=True)
        self._thread.start()

    def msg(self, line: bytes) -> None:
        """Queue ``line`` for writing, or drop it if the buffer is full."""
        with self._cond:
            if len(self._buf) + len(line) > self._limit:
                self._dropped += 1
                return
            self._buf += line
            if self._waiting:
                self._cond.notify()

    # structlog calls the logger method named after the level.
    debug = info = warning = error = critical = exception = msg

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every queued line to be written."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._broken or not (self._buf or self._writing), timeout
            )

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._buf:
                    while not self._buf:
                        self._waiting = True
                        self._cond.wait()
                    self._waiting = False
                    # Let a burst gather: one wake-up and one write for many lines.
                    self._cond.wait(_GATHER)
                data = bytes(self._buf)
                self._buf.clear()
                if self._dropped:
                    # Lines were dropped after those in data and before any still to come.
                    notice: dict[str, Any] = {"event": "stdout.dropped"}
                    notice |= {"timestamp": _timestamp(), "level": "warning"}
                    data += _render(None, "warning", {**notice, "events": self._dropped})
                    self._dropped = 0
                self._writing = True
            try:
                if not self._broken:
                    self._write(data)
            except (OSError, ValueError):
                # stdout is closed (a closed stream raises ValueError): nowhere left to
                # report to.
                self._broken = True
            with self._cond:
                self._writing = False
                self._cond.notify_all()


_writer: _Writer | None = None


def _fd_writer(fd: int) -> Callable[[bytes], None]:
    def write(data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]

    return write


def _stream_writer(stream: TextIO) -> Callable[[bytes], None]:
    def write(data: bytes) -> None:
        stream.write(data.decode())
        stream.flush()

    return write


def configure_logging(level: str = "info", stream: TextIO | None = None) -> None:
    """Render every log call as one JSON object per line on ``stream`` (stdout).

    Lines are written by a background thread (see the module docstring); they are
    flushed at exit, or by :func:`flush_logging`.
    """
    global _writer
    if _writer is not None:
        _writer.flush(1.0)
    if stream is None:
        sys.stdout.flush()  # anything printed before goes first
        write = _fd_writer(sys.stdout.fileno())
    else:
        write = _stream_writer(stream)
    writer = _writer = _Writer(write, STDOUT_BUFFER)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.format_exc_info,
            _event_first,
            _render,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=lambda *_args: writer,
        cache_logger_on_first_use=True,
    )


def set_log_level(level: str) -> bool:
    """Change the lowest level written to stdout; loggers made from now on use it.

    Returns:
        Whether it changed anything: False when :func:`configure_logging` was never
        called (events then go wherever the embedding program sent them).
    """
    if _writer is None:
        return False
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]))
    return True


def flush_logging(timeout: float = 5.0) -> bool:
    """Wait up to ``timeout`` seconds for queued event lines to reach stdout.

    Returns:
        Whether everything queued was written (True too if logging is not configured).
    """
    return _writer is None or _writer.flush(timeout)


atexit.register(flush_logging)


class Events:
    """Emits events to the log and to every subscriber.

    Args:
        buffer: Events a subscriber may fall behind before it is cut off.
    """

    def __init__(self, *, buffer: int = 4096) -> None:
        self._log = structlog.get_logger("ckptd")
        self._buffer = buffer
        self._subscribers: dict[MemoryObjectSendStream[dict[str, Any]], Callable[[], None]] = {}
        self.observer: Callable[[str, dict[str, Any]], None] | None = None
        """Called with each event's name and fields as it is emitted, whatever the log
        level (the metrics count events); None: nothing is called."""

    def emit(self, name: str, level: str = "info", **fields: Any) -> dict[str, Any]:
        """Log event ``name`` with ``fields`` and publish it; returns the event object."""
        timestamp = _timestamp()
        if self.observer is not None:
            self.observer(name, fields)
        getattr(self._log, level)(name, timestamp=timestamp, **fields)
        event = {"event": name, "timestamp": timestamp, "level": level, **fields}
        dropped: list[Callable[[], None]] = []
        for send, on_drop in list(self._subscribers.items()):
            try:
                send.send_nowait(event)
            except anyio.WouldBlock:
                del self._subscribers[send]
                send.close()
                dropped.append(on_drop)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                del self._subscribers[send]
        for on_drop in dropped:
            on_drop()
        return event

    def relog(self) -> None:
        """Pick up a logging configuration changed since (see :func:`set_log_level`)."""
        self._log = structlog.get_logger("ckptd")

    def subscribe(
        self, on_drop: Callable[[], None] = lambda: None
    ) -> MemoryObjectReceiveStream[dict[str, Any]]:
        """A stream of every event from now on.

        Args:
            on_drop: Called (on the event loop) when the reader has fallen more than the
                buffer behind; the stream then receives nothing more.
        """
        send, receive = anyio.create_memory_object_stream[dict[str, Any]](self._buffer)
        self._subscribers[send] = on_drop
        return receive

    def unsubscribe(self, receive: MemoryObjectReceiveStream[dict[str, Any]]) -> None:
        """Stop publishing to closed subscriber streams."""
        receive.close()
        for send in list(self._subscribers):
            if send.statistics().open_receive_streams == 0:
                del self._subscribers[send]
                send.close()

"""Events: one structlog JSON line per transition on stdout, fanned out to subscribers.

Event names are stable API (``docs/events.md``). A subscriber receives exactly the object
the log line holds. A subscriber that falls behind by more than its buffer is cut off
rather than allowed to grow the daemon's memory.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TextIO

import anyio
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from structlog.typing import EventDict

__all__ = ["Events", "configure_logging"]

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_LEVELS["error"] = logging.ERROR


def _event_first(_logger: object, _method: str, event: EventDict) -> EventDict:
    """Put ``event``, ``timestamp`` and ``level`` first, so lines read well in a terminal."""
    head = {k: event.pop(k) for k in ("event", "timestamp", "level") if k in event}
    return {**head, **event}


def configure_logging(level: str = "info", stream: TextIO | None = None) -> None:
    """Render every log call as one JSON object per line on ``stream`` (stdout)."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.format_exc_info,
            _event_first,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stdout),
        cache_logger_on_first_use=True,
    )


class Events:
    """Emits events to the log and to every subscriber.

    Args:
        buffer: Events a subscriber may fall behind before it is cut off.
    """

    def __init__(self, *, buffer: int = 4096) -> None:
        self._log = structlog.get_logger("ckptd")
        self._buffer = buffer
        self._subscribers: dict[MemoryObjectSendStream[dict[str, Any]], Callable[[], None]] = {}

    def emit(self, name: str, level: str = "info", **fields: Any) -> dict[str, Any]:
        """Log event ``name`` with ``fields`` and publish it; returns the event object."""
        timestamp = datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
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

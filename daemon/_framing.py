"""Splitting a byte stream into bounded lines.

A line longer than the bound is discarded up to its newline and reported once, so a
client that sends one oversized request keeps its connection and its later requests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Final

import anyio
from anyio.abc import ByteReceiveStream

__all__ = ["TOO_LONG", "StalledLine", "read_lines"]

TOO_LONG: Final = b""
"""Yielded in place of a line that exceeded the bound (real lines are never empty)."""

_CHUNK: Final = 65536


class StalledLine(TimeoutError):
    """Raised when a started line is not finished within the stall timeout."""


async def read_lines(
    stream: ByteReceiveStream, max_line: int, stall_timeout: float = 30.0
) -> AsyncIterator[bytes]:
    """Yield each newline-terminated line (newline stripped) of ``stream``.

    Blank lines are skipped. A line longer than ``max_line`` bytes (newline included)
    yields :data:`TOO_LONG` once its end arrives; the bytes in between are dropped as
    they come, so memory stays bounded by ``max_line`` plus one chunk. An unterminated
    tail at end of stream is dropped.

    Raises:
        StalledLine: a line was started but not finished within ``stall_timeout``
            seconds (a client idle between whole lines may stay as long as it likes).
    """
    buf = bytearray()
    scanned = 0
    discarding = False
    started: float | None = None  # when the unfinished line began
    while True:
        try:
            if started is None:
                chunk = await stream.receive(_CHUNK)
            else:
                # One deadline per line: trickling a byte at a time does not extend it.
                with anyio.fail_after(max(0.0, started + stall_timeout - anyio.current_time())):
                    chunk = await stream.receive(_CHUNK)
        except TimeoutError:
            raise StalledLine(f"a line was left unfinished for {stall_timeout:g}s") from None
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            return
        buf += chunk
        while True:
            nl = buf.find(b"\n", scanned)
            if nl < 0:
                scanned = len(buf)
                if len(buf) >= max_line:
                    buf.clear()
                    scanned = 0
                    discarding = True
                break
            line = bytes(buf[:nl])
            del buf[: nl + 1]
            scanned = 0
            started = None
            if discarding or nl + 1 > max_line:
                discarding = False
                yield TOO_LONG
            elif line.strip():
                yield line
        if started is None and (buf or discarding):
            started = anyio.current_time()

"""Splitting a byte stream into bounded lines.

A line longer than the bound is discarded up to its newline and reported once, so a
client that sends one oversized request keeps its connection and its later requests.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import AsyncIterator
from typing import Final, cast

import anyio

__all__ = ["TOO_LONG", "LineSocket", "LineSplitter", "StalledLine"]

TOO_LONG: Final = b""
"""Yielded in place of a line that exceeded the bound (real lines are never empty)."""


class StalledLine(TimeoutError):
    """Raised when a started line is not finished within the stall timeout."""


class LineSplitter:
    """Cuts a byte stream, chunk by chunk, into bounded lines (newline stripped).

    Blank lines are skipped. A line longer than ``max_line`` bytes (newline included)
    yields :data:`TOO_LONG` once its end arrives; the bytes in between are dropped as
    they come, so memory stays bounded by ``max_line`` plus one chunk.

    Args:
        max_line: Longest line in bytes, newline included.
    """

    def __init__(self, max_line: int) -> None:
        self.max_line = max_line
        self.buf = bytearray()
        self.scanned = 0
        self.discarding = False

    def feed(self, chunk: bytes, out: deque[bytes]) -> None:
        """Append the lines ``chunk`` completes to ``out``."""
        buf = self.buf
        buf += chunk
        while True:
            nl = buf.find(b"\n", self.scanned)
            if nl < 0:
                self.scanned = len(buf)
                if len(buf) >= self.max_line:
                    buf.clear()
                    self.scanned = 0
                    self.discarding = True
                return
            line = bytes(buf[:nl])
            del buf[: nl + 1]
            self.scanned = 0
            if self.discarding or nl + 1 > self.max_line:
                self.discarding = False
                out.append(TOO_LONG)
            elif line.strip():
                out.append(line)

    @property
    def partial(self) -> bool:
        """Whether a line has been started and not finished."""
        return bool(self.buf) or self.discarding


class LineSocket(asyncio.Protocol):
    """A connected socket served by the event loop's transport: lines in, bytes out.

    The loop keeps the socket registered and hands over what arrives, so waiting for the
    next request costs no system call; a reply is written at once, from the caller,
    without a lock or a task switch. Both directions are bounded: reading pauses while
    lines of ``max_line`` bytes in all (or :data:`_MAX_PENDING` lines) wait to be taken,
    so a connection holds at most about twice ``max_line`` plus one read of received
    data; and :meth:`drain` waits while the client is not reading its replies.

    Args:
        max_line: Longest line in bytes, newline included (see :class:`LineSplitter`).
        stall_timeout: Seconds a started line may stay unfinished.
    """

    def __init__(self, max_line: int, stall_timeout: float) -> None:
        self._splitter = LineSplitter(max_line)
        self._stall_timeout = stall_timeout
        self._lines: deque[bytes] = deque()
        self._pending = 0  # bytes in _lines
        self._max_pending = max_line
        self._started: float | None = None
        self._transport: asyncio.Transport | None = None
        self._readable: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._eof = False
        self._gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.lost = False
        """The connection is gone: nothing more can be written."""

    @classmethod
    async def attach(cls, sock: socket.socket, max_line: int, stall_timeout: float) -> LineSocket:
        """Serve the connected ``sock`` (which the caller must no longer use) on the loop."""
        loop = asyncio.get_running_loop()
        _, protocol = await loop.connect_accepted_socket(
            lambda: cls(max_line, stall_timeout), sock=sock
        )
        return protocol

    @property
    def buffered(self) -> int:
        """Bytes received and not yet taken as lines (the partial line included)."""
        return self._pending + len(self._splitter.buf)

    # -- protocol callbacks (the loop calls these) --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport."""
        # uvloop's transports implement the interface without subclassing it.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        """Split what arrived into lines; pause reading while many wait."""
        count = len(self._lines)
        self._splitter.feed(data, self._lines)
        if len(self._lines) > count:
            self._started = None
            self._pending += sum(len(self._lines[i]) for i in range(count, len(self._lines)))
        if self._started is None and self._splitter.partial:
            self._started = asyncio.get_running_loop().time()
        if self._full() and self._transport is not None and not self._reading_paused:
            self._transport.pause_reading()
            self._reading_paused = True
        _wake(self._readable)

    def _full(self) -> bool:
        return self._pending >= self._max_pending or len(self._lines) >= _MAX_PENDING

    def eof_received(self) -> bool:
        """The client shut down its sending side: keep the connection open for replies."""
        self._eof = True
        _wake(self._readable)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        """The connection is closed (by either side)."""
        self._eof = self.lost = True
        _wake(self._readable)
        _wake(self._writable)
        _wake(self._gone)

    def pause_writing(self) -> None:
        """The transport's write buffer is over its high-water mark."""
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        """The write buffer drained below its low-water mark."""
        _wake(self._writable)

    # -- the connection's side --

    async def lines(self) -> AsyncIterator[bytes]:
        """Each line, as :class:`LineSplitter` cuts them, until end of input.

        Raises:
            StalledLine: a line was left unfinished for ``stall_timeout`` seconds.
        """
        loop = asyncio.get_running_loop()
        while True:
            while self._lines:
                line = self._lines.popleft()
                self._pending -= len(line)
                if self._reading_paused and not self._full():
                    self._reading_paused = False
                    if self._transport is not None and not self.lost:
                        self._transport.resume_reading()
                yield line
            if self._eof:
                return
            self._readable = loop.create_future()
            if self._started is None:
                await self._readable
            else:
                # One deadline per line: trickling a byte at a time does not extend it.
                deadline = self._started + self._stall_timeout
                try:
                    with anyio.fail_after(max(0.0, deadline - loop.time())):
                        await self._readable
                except TimeoutError:
                    raise StalledLine(
                        f"a line was left unfinished for {self._stall_timeout:g}s"
                    ) from None

    def write(self, data: bytes) -> None:
        """Queue ``data`` for sending (sent at once when the socket has room)."""
        if not self.lost and self._transport is not None:
            self._transport.write(data)

    async def drain(self) -> None:
        """Wait while the client is not reading its replies."""
        writable = self._writable
        if writable is not None and not writable.done():
            await writable

    async def aclose(self, linger: float) -> None:
        """Close once every reply is sent, waiting at most ``linger`` seconds for that."""
        if self._transport is not None and not self.lost:
            self._transport.close()
            with anyio.move_on_after(linger):
                await self._gone
        self.close()

    def close(self) -> None:
        """Close now, dropping what the client has not read (it is gone or not listening)."""
        if self._transport is not None:
            self._transport.abort()


_MAX_PENDING: Final = 64
"""Lines received and not yet taken before the socket stops being read."""


def _wake(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)

"""A connection's input buffer stays bounded when requests arrive faster than served."""

from __future__ import annotations

import asyncio
import socket

import pytest

from daemon.server._framing import LineSocket

_READ = 256 * 1024
"""Most an event loop reads from a socket at once (asyncio and uvloop)."""


class TestInputBound:
    """Reading pauses once a max_line of lines waits; the sender is held by the kernel."""

    @pytest.mark.asyncio
    async def test_big_lines_are_held_back_by_bytes(self) -> None:
        max_line = 64 * 1024
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        io = await LineSocket.attach(ours, max_line, stall_timeout=30.0)
        theirs.setblocking(False)
        line = b"x" * (60 * 1024) + b"\n"  # 64 of these would be 3.8 MiB
        flood = line * 1024  # 60 MiB, never taken by anyone
        loop = asyncio.get_running_loop()
        try:
            # The send can only finish if the daemon side keeps reading: it must not.
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(loop.sock_sendall(theirs, flood), timeout=3.0)
            assert 0 < io.buffered <= max_line + _READ + len(line)
            # Taking the lines resumes reading: the next line arrives.
            lines = io.lines()
            first = await anext(lines)
            assert first == line[:-1]
        finally:
            io.close()
            theirs.close()

"""CI sample of the protocol fuzzer, and its reply-counting oracle against the framing."""

from __future__ import annotations

import signal
import socket
import threading
from collections import deque
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.server._framing import LineSplitter
from orchestrator.protocol import MAX_LINE
from tests.conftest import LineClient
from tests.faults.frames import expected_replies
from tests.faults.fuzz import run_fuzz_campaign
from tests.faults.harness import FaultDaemon, reader_race_tracebacks


@pytest.mark.slow
@pytest.mark.timeout(240)
class TestFuzzSample:
    """Fuzzed frames get one reply per complete line; the daemon and a job survive."""

    def test_frames_without_violations(self, short_dir: Path) -> None:
        result = run_fuzz_campaign(short_dir, 3_000, seed_=20261129)
        assert result.violations == []
        figures = result.figures
        assert figures["frames"] >= 3_000
        assert figures["replies"] == figures["complete lines"] > 0
        assert figures["job steps promoted"] > 0


def _lines_read(data: bytes, chunk: int) -> int:
    """Lines the daemon's own line splitter yields for ``data`` fed in ``chunk``-byte pieces.

    An unterminated tail is never a line (the daemon drops it at end of input).
    """
    splitter = LineSplitter(MAX_LINE)
    lines: deque[bytes] = deque()
    for i in range(0, len(data), chunk):
        splitter.feed(data[i : i + chunk], lines)
    return len(lines)


class TestReplyOracle:
    """The fuzzer's count of owed replies agrees with the daemon's line reader."""

    @settings(max_examples=200, deadline=None)
    @given(
        st.lists(
            st.one_of(
                st.binary(max_size=50),
                st.sampled_from([b"\n", b" \n", b"\t\r\n", b"x" * (MAX_LINE - 1) + b"\n"]),
                st.integers(MAX_LINE - 2, MAX_LINE + 2).map(lambda n: b"y" * n),
            ),
            max_size=8,
        ),
        st.sampled_from([1, 7, 65536]),
    )
    def test_same_count(self, parts: list[bytes], chunk: int) -> None:
        data = b"".join(parts)
        if len(data) > 4096:
            chunk = 65536  # a few bytes at a time through megabytes is slow, not thorough
        assert _lines_read(data, chunk) == expected_replies(data)


@pytest.mark.slow
class TestSubscriberHangUp:
    """A subscriber that hangs up while events flow costs the daemon nothing, not even noise."""

    def test_no_traceback_on_stderr(self, short_dir: Path, root: Path) -> None:
        daemon = FaultDaemon(short_dir / "d.sock", [root], state_dir=short_dir / "state")
        daemon.start()
        stop = threading.Event()
        noise = threading.Thread(target=_refusals, args=(daemon.socket_path, stop))
        noise.start()  # every refusal is an event for each subscriber
        try:
            for _ in range(300):
                with LineClient(daemon.socket_path) as subscriber:
                    assert subscriber.request("subscribe")["ok"]
                    assert "event" in subscriber.recv()  # events are flowing to it now
                    subscriber.sock.shutdown(socket.SHUT_RDWR)
        finally:
            stop.set()
            noise.join(30)
            assert daemon.reap(signal.SIGTERM) == 0
        races, other = reader_race_tracebacks(daemon.stdout)
        assert other == []
        assert races == 0


def _refusals(path: Path, stop: threading.Event) -> None:
    """Keep the daemon emitting events: pipelined requests it refuses."""
    with LineClient(path) as client:
        while not stop.is_set():
            client.send_raw(b'{"op":"no_such_op","id":1}\n' * 20)
            for _ in range(20):
                client.recv()

"""Events on stdout: written off the event loop, bounded, and losses reported."""

from __future__ import annotations

import io
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from daemon.base._events import STDOUT_BUFFER, configure_logging, flush_logging
from tests.conftest import REPO, LineClient

_FLOOD = 3 * STDOUT_BUFFER // 100  # request.rejected lines (> 100 bytes each): 3x the buffer


def _read_events(fd: int, deadline: float, until: str) -> Iterator[dict[str, Any]]:
    """Every event line on ``fd`` up to and including the event named ``until``."""
    buf = b""
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no {until} on stdout in time"
        if not select.select([fd], [], [], remaining)[0]:
            continue
        chunk = os.read(fd, 1 << 16)
        assert chunk, f"stdout closed before {until}"
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            event = json.loads(line)
            yield event
            if event["event"] == until:
                return


@pytest.fixture
def unread_daemon(short_dir: Path, root: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A daemon whose stdout pipe nobody reads until the test says so."""
    sock = short_dir / "d.sock"
    cmd = [sys.executable, "-m", "daemon", "serve", "--socket", str(sock), "--root", str(root)]
    cmd += ["--state-dir", str(short_dir / "state")]
    env = {k: v for k, v in os.environ.items() if k != "CKPTD_SOCKET"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=REPO
    )
    try:
        assert proc.stdout is not None
        # Read up to the ready line only: the rest stays in the pipe, then in the buffer.
        for _ in _read_events(proc.stdout.fileno(), time.monotonic() + 30, "daemon.ready"):
            pass
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        assert proc.stdout is not None
        proc.stdout.close()


class TestStdoutNotRead:
    """A daemon whose stdout is not read keeps serving; what it drops, it reports."""

    def test_serves_while_stdout_is_full_then_reports_drops(
        self, unread_daemon: subprocess.Popen[bytes], short_dir: Path
    ) -> None:
        proc = unread_daemon
        with LineClient(short_dir / "d.sock") as client:
            # Each refused line is one request.rejected event: far more than the pipe
            # and the daemon's buffer hold. A writer blocking the loop would never
            # answer them all (the client's timeout fails the test).
            sender = threading.Thread(target=client.send_raw, args=(b"not json\n" * _FLOOD,))
            sender.start()
            for _ in range(_FLOOD):
                assert client.recv()["error"]["code"] == "bad_json"
            sender.join()
            assert client.request("ping")["ok"]
            # Now read stdout: the backlog, one stdout.dropped, then later events.
            assert proc.stdout is not None
            fd = proc.stdout.fileno()
            deadline = time.monotonic() + 60
            events = list(_read_events(fd, deadline, until="stdout.dropped"))
            dropped = events[-1]
            assert list(dropped)[:3] == ["event", "timestamp", "level"]
            assert dropped["level"] == "warning" and dropped["events"] > 0
            rejected = sum(e["event"] == "request.rejected" for e in events)
            client.send_raw(b"not json\n")
            assert client.recv()["error"]["code"] == "bad_json"
        proc.send_signal(signal.SIGTERM)
        rest = list(_read_events(fd, deadline, until="daemon.stopped"))
        rejected += sum(e["event"] == "request.rejected" for e in rest)
        # Every rejection was either written or counted as dropped, exactly once.
        assert rejected + dropped["events"] == _FLOOD + 1
        assert not any(e["event"] == "stdout.dropped" for e in rest)
        assert proc.wait(30) == 0

    def test_lines_are_compact_json_in_documented_order(
        self, unread_daemon: subprocess.Popen[bytes], short_dir: Path
    ) -> None:
        with LineClient(short_dir / "d.sock") as client:
            assert client.request("ping")["ok"]
        unread_daemon.send_signal(signal.SIGTERM)
        assert unread_daemon.stdout is not None
        fd = unread_daemon.stdout.fileno()
        raw = b"".join(iter(lambda: os.read(fd, 1 << 16), b""))  # the daemon flushes at exit
        lines = raw.splitlines()
        names = [json.loads(line)["event"] for line in lines]
        assert names[-1] == "daemon.stopped" and "daemon.signal" in names
        connected = json.loads(lines[names.index("client.connected")])
        assert list(connected) == ["event", "timestamp", "level", "conn", "pid", "uid", "gid"]
        # The same bytes a subscriber gets: msgspec's compact encoding.
        assert lines[names.index("client.connected")].startswith(b'{"event":"client.connected"')


class TestClosedStream:
    """Events written to a stream closed under the daemon are dropped, never an exception."""

    def test_a_closed_stream_stops_the_writer_quietly(self) -> None:
        seen: list[BaseException] = []
        previous = threading.excepthook
        threading.excepthook = lambda args: seen.append(args.exc_value)  # type: ignore[arg-type]
        try:
            stream = io.StringIO()
            configure_logging("info", stream=stream)
            stream.close()
            structlog.get_logger().info("test.closed", n=1)
            flush_logging()
        finally:
            threading.excepthook = previous
            configure_logging("info")
        assert seen == []

"""Connection-level behaviour against a real daemon: slow subscribers, bursts, half-close."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path

from tests.conftest import DaemonProcess, LineClient


def _flood(daemon: DaemonProcess, lines: int) -> None:
    """Make the daemon emit ``lines`` events (one ``request.rejected`` each)."""
    noisy = LineClient(daemon.socket_path)
    try:
        noisy.send_raw(b"not json\n" * lines)
        for _ in range(lines):
            assert noisy.recv()["error"]["code"] == "bad_json"
    finally:
        noisy.close()


class TestSlowSubscriber:
    """A subscriber that stops reading is cut off; nobody else notices."""

    def test_dropped_then_disconnected(
        self, daemon_factory: Callable[..., DaemonProcess], root: Path
    ) -> None:
        daemon = daemon_factory([root])
        slow = LineClient(daemon.socket_path)
        assert slow.request("subscribe")["ok"]
        _flood(daemon, 12_000)  # far more than the subscriber's buffer plus the socket's
        daemon.wait_event("subscriber.dropped", match=lambda e: e["conn"] == 1)
        # Reading now: what was already in the socket, then the daemon has hung up.
        received = 0
        while slow.file.readline():
            received += 1
        slow.close()
        assert received < 12_000
        with LineClient(daemon.socket_path) as other:
            assert other.request("ping")["ok"]

    def test_subscriber_vanishing_mid_backlog_does_not_kill_the_daemon(
        self, daemon_factory: Callable[..., DaemonProcess], root: Path
    ) -> None:
        daemon = daemon_factory([root])
        slow = LineClient(daemon.socket_path)
        assert slow.request("subscribe")["ok"]
        _flood(daemon, 3000)  # enough to fill the socket while nobody reads
        slow.close()
        daemon.wait_event("client.disconnected", match=lambda e: e["conn"] == 1)
        with LineClient(daemon.socket_path) as other:
            assert other.request("ping")["ok"]
        assert daemon.proc is not None and daemon.proc.poll() is None

    def test_subscribe_twice_is_refused(
        self, daemon_factory: Callable[..., DaemonProcess], root: Path
    ) -> None:
        with LineClient(daemon_factory([root]).socket_path) as client:
            assert client.request("subscribe")["ok"]
            assert client.request("subscribe")["error"]["code"] == "invalid_state"


class TestWaits:
    """Waits are bounded per connection, refused in order, and answered after half-close."""

    def test_burst_beyond_the_bound_gets_too_busy(
        self, daemon_factory: Callable[..., DaemonProcess], root: Path
    ) -> None:
        with LineClient(daemon_factory([root]).socket_path) as client:
            self._burst(client, root)

    def _burst(self, client: LineClient, root: Path) -> None:
        burst = b"".join(
            json.dumps(
                {"op": "wait", "id": i, "root": str(root), "step": 1, "timeout": 60}
            ).encode()
            + b"\n"
            for i in range(300)
        )
        client.send_raw(burst)
        refused = [client.recv() for _ in range(300 - 256)]
        assert {r["error"]["code"] for r in refused} == {"too_busy"}
        assert sorted(r["id"] for r in refused) == list(range(256, 300))

    def test_unknown_root_refused_in_order(
        self, daemon_factory: Callable[..., DaemonProcess], root: Path
    ) -> None:
        daemon = daemon_factory([root])
        with LineClient(daemon.socket_path) as client:
            client.send_raw(
                b'{"op":"wait","id":1,"root":"/nowhere","step":1,"timeout":5}\n'
                b'{"op":"ping","id":2}\n'
            )
            first, second = client.recv(), client.recv()
        assert (first["id"], first["error"]["code"]) == (1, "root_not_configured")
        assert second["id"] == 2
        daemon.wait_event("request.rejected", match=lambda e: e["code"] == "root_not_configured")

    def test_pending_wait_answered_after_half_close(
        self, daemon_factory: Callable[..., DaemonProcess], root: Path
    ) -> None:
        with LineClient(daemon_factory([root]).socket_path) as client:
            wait = {"op": "wait", "id": 9, "root": str(root), "step": 3, "timeout": 0.2}
            client.send_raw(json.dumps(wait).encode() + b"\n")
            client.sock.shutdown(socket.SHUT_WR)
            reply = client.recv()
        assert reply == {
            "id": 9,
            "ok": True,
            "state": "pending",
            "path": None,
            "reason": None,
            "attempt": None,
        }

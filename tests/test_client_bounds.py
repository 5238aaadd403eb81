"""Every wait of the client is bounded, and every failure of a save is reported."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from orchestrator import CheckpointClient, DaemonError, FileEntry
from orchestrator import protocol as p
from tests.conftest import DaemonProcess, LineClient


def _close_within(client: CheckpointClient, deadline: float, **kwargs: Any) -> bool:
    """Close the client on another thread; whether that returned within ``deadline``."""
    closer = threading.Thread(target=client.close, kwargs=kwargs, daemon=True)
    closer.start()
    closer.join(deadline)
    return not closer.is_alive()


class TestClose:
    """close() reports what it cannot wait for instead of waiting forever."""

    def test_unsealed_save_is_failed_at_close(
        self,
        daemon_factory: Callable[..., DaemonProcess],
        root: Path,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        caplog.set_level(logging.WARNING, logger="orchestrator")
        daemon = daemon_factory([root])
        client = CheckpointClient(str(daemon.socket_path), begin_timeout=10.0)
        handle = client.save(str(root), 1, 0, 1)  # never sealed
        try:
            assert client.wait_saves(timeout=None) is False  # nothing it could wait for
            assert _close_within(client, 30.0)
        finally:
            handle.seal()  # lets a close() that waits for it go on
        failed = daemon.wait_event("checkpoint.failed", match=lambda e: e["step"] == 1)
        assert "closed before step 1 was sealed" in failed["reason"]
        warnings = [r.getMessage() for r in caplog.records if "never sealed" in r.getMessage()]
        assert any("reporting it failed" in w for w in warnings), warnings

    def test_wait_for_uploads_is_bounded(
        self,
        daemon_factory: Callable[..., DaemonProcess],
        root: Path,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        caplog.set_level(logging.WARNING, logger="orchestrator")
        daemon = daemon_factory([root])
        client = CheckpointClient(str(daemon.socket_path), begin_timeout=10.0)
        upload: Future[None] = Future()  # an upload that never lands
        client.track(str(root), 2, 0, 1, upload)
        try:
            assert _close_within(client, 30.0, timeout=0.5)
        finally:
            upload.set_result(None)
        failed = daemon.wait_event("checkpoint.failed", match=lambda e: e["step"] == 2)
        assert "still in flight after 0.5s" in failed["reason"]
        assert any("still in flight" in r.getMessage() for r in caplog.records)

    def test_reports_reach_a_daemon_restarted_during_close(
        self, daemon_factory: Callable[..., DaemonProcess], root: Path
    ) -> None:
        daemon = daemon_factory([root])
        client = CheckpointClient(str(daemon.socket_path), begin_timeout=10.0)
        handle = client.save(str(root), 3, 0, 1)
        assert handle.begun.acknowledged
        (Path(handle.path) / "w.bin").write_bytes(b"w" * 10)
        handle.add_files([FileEntry("w.bin", 10)])
        daemon.kill()
        handle.seal()  # its done cannot be sent now: the daemon is down
        closer = threading.Thread(target=client.close, daemon=True)
        closer.start()  # the process is exiting while its daemon restarts
        restarted = daemon_factory([root])
        closer.join(30.0)
        assert not closer.is_alive()
        with LineClient(restarted.socket_path) as check:
            reply = check.request("wait", root=str(root), step=3, timeout=30)
        assert reply["state"] == "promoted", reply

    def test_the_wait_for_acknowledgements_is_the_callers(
        self, short_dir: Path, root: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.WARNING, logger="orchestrator")
        client = CheckpointClient(str(short_dir / "nobody.sock"))
        client.begin(str(root), 4, 0, 1)  # never acknowledged: no daemon listens
        # The default waits 5 s for a daemon to come up; this caller gives it none.
        assert _close_within(client, 3.0, report_timeout=0.0)


class _BrokenMetadata:
    """A save result whose shard listing raises when read."""

    @property
    def storage_data(self) -> dict[str, Any]:
        raise KeyError("storage_data is gone")


class TestCallbackErrors:
    """An error while reporting a landed upload fails the step; it is never swallowed."""

    def test_broken_result_fails_the_step(
        self, daemon_factory: Callable[..., DaemonProcess], root: Path
    ) -> None:
        daemon = daemon_factory([root])
        with CheckpointClient(str(daemon.socket_path), begin_timeout=10.0) as client:
            upload: Future[Any] = Future()
            handle = client.track(str(root), 3, 0, 1, upload, dcp_dir="model")
            upload.set_result(_BrokenMetadata())
            assert handle.wait_local(30.0)
            outcome = client.wait(str(root), 3, 30.0)
        assert outcome.state == "failed"
        assert outcome.reason is not None and "storage_data is gone" in outcome.reason
        failed = daemon.wait_event("checkpoint.failed", match=lambda e: e["step"] == 3)
        assert "reporting the save's files raised KeyError" in failed["reason"]


def _failed_saves(daemon: DaemonProcess, root: Path, count: int, reason_len: int) -> None:
    """``count`` failed saves, each with a long reason: they make ``status`` long."""
    with LineClient(daemon.socket_path) as rank:
        for step in range(count):
            reply = rank.request("begin", root=str(root), step=step, rank=0, world_size=1)
            assert reply["ok"], reply
            reason = f"{step}:" + "x" * reason_len
            assert rank.request("fail", root=str(root), step=step, rank=0, reason=reason)["ok"]


def _connections(daemon: DaemonProcess) -> int:
    mine = os.getpid()
    return sum(1 for e in daemon.drain() if e["event"] == "client.connected" and e["pid"] == mine)


class TestLongReplies:
    """Replies up to MAX_REPLY are read; a longer one fails only its call."""

    def test_status_longer_than_a_request_line(
        self, daemon_factory: Callable[..., DaemonProcess], root: Path
    ) -> None:
        daemon = daemon_factory([root])
        _failed_saves(daemon, root, 200, 4000)
        with CheckpointClient(str(daemon.socket_path)) as client:
            reply = client.call(p.Status(id=0, root=str(root)), timeout=30.0)
            assert len(p.encode(reply)) > p.MAX_LINE  # longer than any request may be
            assert sorted(s["step"] for s in reply["saves"]) == list(range(200))
            assert client.ping(10.0)
        daemon.wait_event("client.disconnected", match=lambda e: e["conn"] > 1)
        assert _connections(daemon) == 2  # the LineClient and this client: no reconnects

    def test_reply_beyond_the_limit_fails_only_its_call(
        self, daemon_factory: Callable[..., DaemonProcess], root: Path
    ) -> None:
        daemon = daemon_factory([root])
        _failed_saves(daemon, root, 40, 4000)
        with CheckpointClient(str(daemon.socket_path), max_reply=64 * 1024) as client:
            with pytest.raises(DaemonError) as raised:
                client.call(p.Status(id=0, root=str(root)), timeout=30.0)
            assert raised.value.code == "reply_too_long"
            assert "65536 bytes" in str(raised.value)
            # The connection lives on: the next call and a save go through it.
            assert client.ping(10.0)
            begun = client.begin(str(root), 100, 0, 1)
            assert begun.acknowledged
            (root / "tmp_step_100" / "w.bin").write_bytes(b"w" * 10)
            client.done(str(root), 100, 0, [FileEntry("w.bin", 10)])
            assert client.wait(str(root), 100, 30.0).state == "promoted"
        daemon.wait_event("client.disconnected", match=lambda e: e["conn"] > 1)
        assert _connections(daemon) == 2

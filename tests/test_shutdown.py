"""Stopping while a failed attempt is being set aside: the daemon still exits, cleanly."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

from tests.conftest import DaemonProcess, LineClient

TIMEOUT = 15.0
Start = Callable[..., DaemonProcess]


class TestStopDuringSetAside:
    """SIGTERM right after a save fails waits for its set-aside, then exits 0."""

    def test_exits_after_the_set_aside_is_journaled(self, start: Start, root: Path) -> None:
        daemon = start([root])
        at = {"root": str(root), "step": 1, "rank": 0}
        with LineClient(daemon.socket_path, timeout=TIMEOUT) as client:
            assert client.request("begin", **at, world_size=1)["ok"] is True
            # A file that was never written: verification fails and the attempt's
            # directory is set aside, which journals where it went.
            files = [{"path": f"model/part-{i}.distcp", "size": 1} for i in range(100)]
            assert client.request("done", **at, files=files)["ok"] is True
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGTERM)  # while the set-aside may be under way
        assert daemon.proc.wait(TIMEOUT) == 0
        names = [e["event"] for e in daemon.drain()]
        assert "daemon.stopped" in names
        assert names.index("checkpoint.failed") < names.index("daemon.stopped")
        assert not (root / "tmp_step_1").exists()  # moved into the trash, kept there
        assert any(
            p.name.startswith("tmp_step_1.attempt-") for p in (root / ".ckptd-trash").iterdir()
        )

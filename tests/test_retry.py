"""A failed step saved again by a resumed job starts over; the failed attempt never mixes in."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.conftest import DaemonProcess, LineClient

Factory = Callable[..., DaemonProcess]


def _fail_step(daemon: DaemonProcess, root: Path, step: int) -> LineClient:
    """Rank 0 begins, writes a partial file, and fails; its connection stays open."""
    rank = LineClient(daemon.socket_path)
    assert rank.request("begin", root=str(root), step=step, rank=0, world_size=1)["ok"]
    (root / f"tmp_step_{step}").mkdir()
    (root / f"tmp_step_{step}" / "partial.bin").write_bytes(b"old" * 10)
    assert rank.request("fail", root=str(root), step=step, rank=0, reason="disk full")["ok"]
    return rank


class TestNewAttempt:
    """Only a process that took no part in the failed attempt can start the step over."""

    def test_resumed_job_saves_the_step_again(self, daemon_factory: Factory, root: Path) -> None:
        daemon = daemon_factory([root])
        old = _fail_step(daemon, root, 5)
        # A late word from the failed attempt itself is refused.
        late = old.request("begin", root=str(root), step=5, rank=0, world_size=1)
        assert late["error"]["code"] == "step_failed"
        old.close()
        with LineClient(daemon.socket_path) as new:
            resent = new.request("begin", root=str(root), step=5, rank=0, world_size=1, resent=True)
            assert resent["error"]["code"] == "step_failed"  # a reconnect is not a new job
            assert new.request("begin", root=str(root), step=5, rank=0, world_size=1)["ok"]
            retried = daemon.wait_event("save.retried")
            assert retried["previous_reason"] == "rank 0 failed: disk full"
            moved = Path(daemon.wait_event("save.quarantined")["path"])
            assert (moved / "partial.bin").read_bytes() == b"old" * 10  # kept for inspection
            assert not (root / "tmp_step_5").exists()
            (root / "tmp_step_5").mkdir()
            (root / "tmp_step_5" / "new.bin").write_bytes(b"new")
            files = [{"path": "new.bin", "size": 3}]
            assert new.request("done", root=str(root), step=5, rank=0, files=files)["ok"]
            assert new.request("wait", root=str(root), step=5, timeout=30)["state"] == "promoted"
        assert sorted(p.name for p in (root / "step_5").iterdir()) == [
            ".ckptd-manifest.json",
            "new.bin",
        ]

    def test_after_a_restart(self, daemon_factory: Factory, root: Path) -> None:
        daemon = daemon_factory([root])
        _fail_step(daemon, root, 6).close()
        daemon.kill()
        restarted = daemon_factory([root])
        with LineClient(restarted.socket_path) as new:
            assert new.request("begin", root=str(root), step=6, rank=0, world_size=2)["ok"]
            status = new.request("status")["saves"]
        assert [(s["step"], s["state"], s["world_size"]) for s in status] == [(6, "open", 2)]
        restarted.kill()
        # The new attempt was journaled: it survives another restart as the open save.
        again = daemon_factory([root])
        with LineClient(again.socket_path) as client:
            status = client.request("status")["saves"]
        assert [(s["step"], s["state"]) for s in status] == [(6, "open")]

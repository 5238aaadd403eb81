"""Operator rescue: ``ckptd promote ROOT STEP`` for a step whose trainer died after its writes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from daemon.cli import main
from tests.conftest import DaemonProcess, LineClient

Factory = Callable[..., DaemonProcess]
STATE = {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(3, dtype=torch.int64)}


def _write_dcp(directory: Path) -> None:
    """A real, complete DCP checkpoint (one process), as a PROCESS-mode writer leaves it."""
    dcp_save(STATE, checkpoint_id=str(directory), no_dist=True)


def _dead_rank_save(daemon: DaemonProcess, root: Path, step: int) -> None:
    """Rank 0 begins, its data fully lands, then it dies before saying done."""
    with LineClient(daemon.socket_path) as rank:
        assert rank.request("begin", root=str(root), step=step, rank=0, world_size=1)["ok"]
        _write_dcp(root / f"tmp_step_{step}" / "model")


class TestRescue:
    """A verifiable step is promoted on an explicit command; anything else is refused."""

    def test_failed_by_lease_then_rescued(
        self, daemon_factory: Factory, root: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        daemon = daemon_factory([root], "--lease", "0.3")
        _dead_rank_save(daemon, root, 4)
        assert "lease" in daemon.wait_event("checkpoint.failed")["reason"]
        assert not (root / "step_4").exists()  # never promoted without the command

        code = main(["promote", str(root), "4", "--socket", str(daemon.socket_path)])
        assert (code, capsys.readouterr().out.strip()) == (0, str(root / "step_4"))
        rescue = daemon.wait_event("checkpoint.rescue")
        assert (rescue["step"], rescue["previous"]) == (4, "failed")
        assert daemon.wait_event("checkpoint.promoted")["step"] == 4
        loaded = {k: torch.empty_like(v) for k, v in STATE.items()}
        dcp_load(loaded, checkpoint_id=str(root / "step_4" / "model"), no_dist=True)
        assert all(torch.equal(loaded[k], v) for k, v in STATE.items())
        assert main(["verify", str(root / "step_4")]) == 0

        # The rescue was journaled: a restarted daemon still knows the step as promoted.
        daemon.kill()
        restarted = daemon_factory([root])
        with LineClient(restarted.socket_path) as client:
            reply = client.request("wait", root=str(root), step=4, timeout=5)
        assert (reply["state"], reply["path"]) == ("promoted", str(root / "step_4"))

    def test_orphan_rescued(self, daemon_factory: Factory, root: Path) -> None:
        _write_dcp(root / "tmp_step_2" / "model")  # written while no daemon ran
        daemon = daemon_factory([root])
        assert daemon.wait_event("save.orphaned")["step"] == 2
        with LineClient(daemon.socket_path) as client:
            reply = client.request("promote", root=str(root), step=2)
        assert (reply["state"], reply["path"]) == ("promoted", str(root / "step_2"))

    @pytest.mark.parametrize("damage", ["no_metadata", "short_shard", "no_dcp", "missing"])
    def test_unverifiable_refused(self, daemon_factory: Factory, root: Path, damage: str) -> None:
        tmp = root / "tmp_step_3"
        if damage != "missing":
            _write_dcp(tmp / "model")
        if damage == "no_metadata":
            (tmp / "model" / ".metadata").unlink()
        elif damage == "short_shard":
            shard = next((tmp / "model").glob("*.distcp"))
            shard.write_bytes(shard.read_bytes()[:10])
        elif damage == "no_dcp":
            for path in (tmp / "model").iterdir():
                path.unlink()
            (tmp / "model" / "weights.bin").write_bytes(b"x" * 100)
        daemon = daemon_factory([root])
        with LineClient(daemon.socket_path) as client:
            reply = client.request("promote", root=str(root), step=3)
        assert reply["error"]["code"] == "unverifiable", reply
        assert not (root / "step_3").exists()
        assert (tmp.exists()) is (damage != "missing")

    def test_live_writer_refused(self, daemon_factory: Factory, root: Path) -> None:
        daemon = daemon_factory([root])
        with LineClient(daemon.socket_path) as rank, LineClient(daemon.socket_path) as operator:
            assert rank.request("begin", root=str(root), step=5, rank=0, world_size=1)["ok"]
            _write_dcp(root / "tmp_step_5" / "model")
            reply = operator.request("promote", root=str(root), step=5)
            assert reply["error"]["code"] == "invalid_state"
            assert "still being written" in reply["error"]["message"]

    def test_already_promoted_refused(self, daemon_factory: Factory, root: Path) -> None:
        daemon = daemon_factory([root])
        with LineClient(daemon.socket_path) as rank:
            assert rank.request("begin", root=str(root), step=6, rank=0, world_size=1)["ok"]
            _write_dcp(root / "tmp_step_6" / "model")
            assert rank.request("done", root=str(root), step=6, rank=0)["ok"]
            assert rank.request("wait", root=str(root), step=6, timeout=30)["state"] == "promoted"
            reply = rank.request("promote", root=str(root), step=6)
        assert reply["error"]["code"] == "already_promoted"


class TestRescueInTheLedger:
    """After a rescue, a late report from a rank that never finished changes nothing."""

    @pytest.mark.parametrize("late", ["done", "fail"])
    def test_late_report_refused(self, late: str) -> None:
        from daemon.base._errors import RequestError
        from daemon.ledger._ledger import Ledger, SaveKey
        from orchestrator.protocol import ErrorCode, SaveState

        ledger = Ledger(lease=1.0, save_timeout=None)
        key = SaveKey("/ckpt/run", 3)
        ledger.begin(key, 0, 2, conn=1, now=0.0)
        ledger.begin(key, 1, 2, conn=2, now=0.0)
        ledger.done(key, 0, [], conn=1, now=0.5)
        ledger.disconnect(2, now=1.0)
        ledger.tick(now=5.0)  # rank 1's lease ran out: failed
        ledger.rescue(key, now=6.0)
        for state in ("verifying", "promoted"):
            if state == "promoted":
                ledger.verified(key)
                ledger.promoted(key, "/ckpt/run/step_3", now=7.0)
            with pytest.raises(RequestError) as refused:
                if late == "done":
                    ledger.done(key, 1, [], conn=3, now=8.0)
                else:
                    ledger.fail(key, 1, "late", now=8.0)
            assert refused.value.code in (ErrorCode.INVALID_STATE, ErrorCode.ALREADY_PROMOTED)
        save = ledger.get(key)
        assert save is not None and save.state is SaveState.PROMOTED

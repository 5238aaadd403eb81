"""Pins, holds and scores live on the root: a job requeued on a fresh state directory keeps them.

Job 1 pins step 1, holds step 2 for a day and scores steps 3 and 4. Its daemon stops and
its state directory is gone (a Slurm prolog, a k8s ``emptyDir``). Job 2's daemon starts
on the same root with an empty one, and its first retention pass must judge exactly as
job 1's daemon would have: nothing of those is retired.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

from tests.conftest import DaemonProcess, LineClient
from tests.test_retention import Start, configure, promote, settle, start_with, steps_on_disk
from tests.test_server import TIMEOUT, ok

POLICY = 'keep_last = 1\nkeep_best = { k = 1, metric = "loss", mode = "min", grace_s = 0 }'


def ask(daemon: DaemonProcess, op: str, **fields: Any) -> dict[str, Any]:
    with LineClient(daemon.socket_path, timeout=TIMEOUT) as client:
        return ok(client.request(op, **fields))


def kept(report: dict[str, Any]) -> dict[int, list[str]]:
    return {s["step"]: s["kept"] for s in report["steps"]}


class TestRequeueKeepsRetention:
    """A fresh state directory on the same root decides as the journal would have."""

    def test_pins_holds_and_scores_survive(self, start: Start, root: Path, tmp_path: Path) -> None:
        config = configure(tmp_path, root, POLICY)
        first = start_with(start, config)
        promote(first, root, 1)
        ask(first, "pin", root=str(root), step=1)
        facts = json.loads((root / ".ckptd-retention" / "step_1.json").read_text())
        assert facts["pinned"] is True  # on the root before the pin was acknowledged
        promote(first, root, 2)
        ask(first, "hold", root=str(root), step=2, ttl=86400)
        promote(first, root, 3)
        ask(first, "score", root=str(root), step=3, metrics={"loss": 0.1})
        promote(first, root, 4)
        ask(first, "score", root=str(root), step=4, metrics={"loss": 0.5})
        before = kept(settle(first, root))
        assert steps_on_disk(root) == [1, 2, 3, 4]
        first.stop(signal.SIGTERM)

        second = start_with(start, config, socket_name="d2.sock")  # an empty state directory
        assert second.state_dir != first.state_dir
        report = settle(second, root)
        assert report["retired"] == [] and steps_on_disk(root) == [1, 2, 3, 4]
        assert kept(report) == before
        assert "pinned" in kept(report)[1] and "held" in kept(report)[2]
        assert {s["step"]: s.get("metrics") for s in report["steps"] if s["step"] > 2} == {
            3: {"loss": 0.1},
            4: {"loss": 0.5},
        }
        assert report["info"]["best"] == 3

    def test_an_unpin_survives_too(self, start: Start, root: Path, tmp_path: Path) -> None:
        config = configure(tmp_path, root, "keep_last = 1")
        first = start_with(start, config)
        promote(first, root, 1)
        ask(first, "pin", root=str(root), step=1)
        promote(first, root, 2)
        ask(first, "unpin", root=str(root), step=1)
        first.stop(signal.SIGTERM)
        second = start_with(start, config, socket_name="d2.sock")
        report = settle(second, root)
        assert steps_on_disk(root) == [2], report
        assert not (root / ".ckptd-retention" / "step_1.json").exists()  # retired: forgotten


def _write_dcp(directory: Path) -> None:
    """A real, complete DCP checkpoint, saved by this one process."""
    import torch
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    dcp_save({"w": torch.arange(8.0)}, checkpoint_id=str(directory), no_dist=True)


class TestPinBeforeARescue:
    """A failed step set aside in the trash may be pinned, and its rescue then stays."""

    def test_pin_then_promote(self, start: Start, root: Path, tmp_path: Path) -> None:
        daemon = start_with(start, configure(tmp_path, root, "keep_last = 1"))
        promote(daemon, root, 2)
        with LineClient(daemon.socket_path, timeout=TIMEOUT) as client:
            ok(client.request("begin", root=str(root), step=1, rank=0, world_size=1))
            _write_dcp(root / "tmp_step_1" / "model")  # it landed; the rank still failed
            ok(client.request("fail", root=str(root), step=1, rank=0, reason="lost its upload"))
            reply = ok(client.request("wait", root=str(root), step=1, timeout=TIMEOUT))
            assert reply["state"] == "failed", reply
            ok(client.request("pin", root=str(root), step=1))  # its files are in the trash
            rescued = ok(client.request("promote", root=str(root), step=1))
            assert rescued["state"] == "promoted", rescued
        report = settle(daemon, root)
        assert kept(report)[1] == ["pinned"], report
        assert steps_on_disk(root) == [1, 2]

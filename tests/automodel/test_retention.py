"""Metrics through the real nemo_automodel Checkpointer: ``save_checkpoint(metrics=...)``.

A real 2-rank job (gloo, CPU, async DCP uploads) saves four steps through
``AutomodelCheckpointManager``, each with its validation loss; the daemon's root keeps
the newest step and the best by ``val_loss``, and reads NeMo-RL's ``training_info.json``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.automodel.conftest import RankJob
from tests.conftest import DaemonProcess, LineClient

pytestmark = pytest.mark.slow


class TestMetricsPassThrough:
    """keep_best judges by the metrics the trainer passed to save_checkpoint."""

    def test_best_and_newest_kept(
        self,
        daemon_factory: Callable[..., DaemonProcess],
        rank_jobs: Callable[..., RankJob],
        root: Path,
        tmp_path: Path,
    ) -> None:
        config = tmp_path / "ckptd.toml"
        config.write_text(
            f'[[roots]]\npath = "{root}"\n\n[roots.retention]\nkeep_last = 1\n'
            'keep_best = { k = 1, metric = "val_loss", mode = "min", grace_s = 0 }\n'
        )
        daemon = daemon_factory([], "--config", str(config))
        job = rank_jobs(
            "metrics", "--root", str(root), "--losses", "1=2.0,2=1.0,3=3.0,4=2.5",
            socket_path=daemon.socket_path,
        )  # fmt: skip
        codes = job.wait(timeout=300)
        assert codes == [0, 0], [line.get("line", line) for line in job.drain()][-20:]
        retired = [daemon.wait_event("checkpoint.retired", 60)["step"] for _ in (1, 3)]
        assert sorted(retired) == [1, 3]
        with LineClient(daemon.socket_path) as client:
            reply = client.request("retention", root=str(root), apply=True)
        assert reply["ok"], reply
        assert sorted(p.name for p in root.glob("step_*")) == ["step_2", "step_4"]
        assert os.readlink(root / "best") == "step_2"
        assert os.readlink(root / "latest") == "step_4"
        metrics = {s["step"]: s["metrics"] for s in reply["steps"]}
        # From the ranks' done (val_loss) and from training_info.json (step, val_reward).
        assert metrics[2] == {"step": 2.0, "val_reward": -1.0, "val_loss": 1.0}
        assert metrics[4] == {"step": 4.0, "val_reward": -2.5, "val_loss": 2.5}

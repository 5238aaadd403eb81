"""Only the daemon's own names are checkpoints: a zero-padded copy is no second step."""

from __future__ import annotations

import shutil
from pathlib import Path

from daemon.config._config import RootConfig
from tests.conftest import DaemonProcess
from tests.test_retention import Start, configure, promote, settle, start_with


class TestStepNames:
    """``step_03`` beside ``step_3`` is left alone and counts for nothing."""

    def test_the_name_parser(self) -> None:
        root = RootConfig(path="/ckpt/run")
        assert root.parse_step("step_3", "step_") == 3
        assert root.parse_step("step_0", "step_") == 0
        assert root.parse_step("step_10", "step_") == 10
        for name in ("step_03", "step_00", "step_", "step_3a", "step_٣"):
            assert root.parse_step(name, "step_") is None, name

    def test_a_copy_does_not_retire_the_oldest(
        self, start: Start, root: Path, tmp_path: Path
    ) -> None:
        daemon: DaemonProcess = start_with(start, configure(tmp_path, root, "keep_last = 3"))
        for step in (1, 2, 3):
            promote(daemon, root, step)
        shutil.copytree(root / "step_3", root / "step_03")
        report = settle(daemon, root)
        assert {s["step"] for s in report["steps"]} == {1, 2, 3}
        assert not report.get("retired"), report
        assert all(s["kept"] for s in report["steps"]), report
        assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == [
            "step_03",
            "step_1",
            "step_2",
            "step_3",
        ]

"""Names and reports: only the daemon's own step names count; ``gc --policy`` says who prunes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from daemon.cli import main
from daemon.config._config import RootConfig, load_config
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


class TestGcPolicyReport:
    """``gc --policy`` on the daemon that prunes the root does not say it does not."""

    def test_the_pruner_says_nothing_of_it(
        self, start: Start, root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        daemon = start_with(start, configure(tmp_path, root, "keep_last = 1"))
        promote(daemon, root, 1)
        capsys.readouterr()
        assert main(["gc", str(root), "--policy", "--socket", str(daemon.socket_path)]) == 0
        first = capsys.readouterr().out.splitlines()[0]
        assert first == f"{root}: policy keep_last=1", first


class TestBestPointerNames:
    """``best_pointer`` may not be a step's name or one of the daemon's own files."""

    @pytest.mark.parametrize(
        ("name", "extra", "message"),
        [
            ("step_3", "", "is a step's directory name"),
            ("tmp_step_7", "", "is a step's directory name"),
            ("ckpt-9", 'final_prefix = "ckpt-"\n', "is a step's directory name"),
            (".ckptd-trash", "", "the daemon's own files"),
            (".ckptd-layout.json", "", "the daemon's own files"),
        ],
    )
    def test_refused(
        self,
        root: Path,
        tmp_path: Path,
        name: str,
        extra: str,
        message: str,
        capsys: pytest.CaptureFixture[str],
    ) -> None:
        config = tmp_path / "ckptd.toml"
        config.write_text(
            f'[[roots]]\npath = "{root}"\n{extra}[roots.retention]\n'
            f'keep_last = 1\nbest_pointer = "{name}"\n'
        )
        code = main(["serve", "--config", str(config), "--socket", str(tmp_path / "x.sock")])
        assert code == 2
        assert message in capsys.readouterr().err

    def test_a_plain_name_is_fine(self, root: Path, tmp_path: Path) -> None:
        config = tmp_path / "ckptd.toml"
        config.write_text(
            f'[[roots]]\npath = "{root}"\n[roots.retention]\nkeep_last = 1\nbest_pointer = "top"\n'
        )
        loaded = load_config(config_file=str(config))
        (found,) = loaded.roots
        assert found.retention is not None and found.retention.best_pointer == "top"


BEST_BY_LOSS = 'keep_last = 1\nkeep_best = { k = 1, metric = "loss", mode = "min" }'


class TestAnEarlierBestPointer:
    """A ``best`` pointer the policy no longer names is removed, not left to dangle."""

    @pytest.mark.parametrize(
        ("second", "left"),
        [(f'{BEST_BY_LOSS}\nbest_pointer = "top"', "top"), ("keep_last = 1", None)],
    )
    def test_renamed_or_dropped(
        self, start: Start, root: Path, tmp_path: Path, second: str, left: str | None
    ) -> None:
        daemon = start_with(start, configure(tmp_path, root, BEST_BY_LOSS))
        promote(daemon, root, 1, metrics={"loss": 0.1})
        promote(daemon, root, 2, metrics={"loss": 0.5})
        settle(daemon, root)
        assert os.readlink(root / "best") == "step_1"
        daemon.stop()
        again = start_with(start, configure(tmp_path, root, second), socket_name="d2.sock")
        settle(again, root)
        assert not os.path.lexists(root / "best")
        if left is not None:
            assert os.readlink(root / left) == "step_1"  # its metrics are on the root
        assert os.readlink(root / "latest") == "step_2"

"""``orchestrator.CheckpointManager`` in a real 2-rank gloo job against a real daemon.

One job (``tests/_manager_worker.py``) runs every part and each test reads its findings:
DDP and FSDP2 models and optimizers saved and restored in place through torch's
``get_state_dict``/``set_state_dict``, the newest step and a step by name, the same
step on every rank; ``should_save``, ``latest_step`` and ``best_step`` (the root keeps
its best by the ``loss`` metric the saves carried); and under ``strict``, refusals that
raise in the trainer. The object-store path runs in ``tests/test_s3_demo.py`` (the
demo's job uses the manager).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._ranks import free_port, pump_lines, start_rank
from tests.conftest import REPO, DaemonProcess

pytestmark = pytest.mark.slow

WORKER = REPO / "tests" / "_manager_worker.py"
JOB_TIMEOUT = 180.0
"""Seconds the job may take: a deadline for a hang (about 10 s on a quiet machine)."""

CONFIG = """
[[roots]]
path = "{ddp}"

[roots.retention]
keep_last = 5
keep_best = {{ k = 1, metric = "loss", mode = "min" }}

[[roots]]
path = "{fsdp}"
"""


@pytest.fixture(scope="module")
def job() -> Iterator[dict[str, list[dict[str, Any]]]]:
    base = Path(tempfile.mkdtemp(prefix="ck-", dir="/tmp"))
    ddp, fsdp, unserved = base / "ddp", base / "fsdp", base / "unserved"
    for root in (ddp, fsdp, unserved):
        root.mkdir()
    config = base / "ckptd.toml"
    config.write_text(CONFIG.format(ddp=ddp, fsdp=fsdp))
    daemon = DaemonProcess(base / "d.sock", [], "--config", str(config))
    lines: list[dict[str, Any]] = []
    procs = []
    try:
        daemon.start()
        port = free_port()
        args = ["--ddp-root", str(ddp), "--fsdp-root", str(fsdp), "--unserved", str(unserved)]
        for rank in range(2):
            proc = start_rank([str(WORKER), *args], rank, 2, port, daemon.socket_path)
            procs.append(proc)
            pump_lines(proc, rank, lines.append)
        codes = [proc.wait(JOB_TIMEOUT) for proc in procs]
        output = "".join(line.get("line", "") for line in lines)
        assert codes == [0, 0], (codes, output)
        assert "Traceback" not in output, output
        found: dict[str, list[dict[str, Any]]] = {}
        for line in lines:
            found.setdefault(line["event"], []).append(line)
        yield found
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        daemon.kill()
        if daemon.proc is not None and daemon.proc.stdout is not None:
            daemon.proc.stdout.close()
        shutil.rmtree(base, ignore_errors=True)


def _each_rank(job: dict[str, list[dict[str, Any]]], event: str) -> list[dict[str, Any]]:
    lines = job.get(event, [])
    assert len(lines) == 2, (event, job)
    return lines


class TestSaveAndRestore:
    """Saves at the interval, restored in place into fresh DDP and FSDP2 objects."""

    def test_saves_at_the_interval_only(self, job: dict[str, list[dict[str, Any]]]) -> None:
        for line in _each_rank(job, "ddp_saved"):
            assert line["first"] is None  # an empty root: nothing restored
            assert line["asked"] == [False, True, False, True]
            assert line["saved"] == [2, 4]
            assert line["again"] is False

    def test_restores_the_newest_then_a_named_step(
        self, job: dict[str, list[dict[str, Any]]]
    ) -> None:
        for line in _each_rank(job, "ddp_restored"):
            assert (line["newest"], line["equal_newest"], line["epoch"]) == (4, True, 4)
            assert (line["named"], line["equal_named"]) == (2, True)
            assert "step 3" in line["missing"] and "not a promoted checkpoint" in line["missing"]

    def test_latest_best_and_should_save_after_restore(
        self, job: dict[str, list[dict[str, Any]]]
    ) -> None:
        for line in _each_rank(job, "ddp_restored"):
            assert (line["latest"], line["best"]) == (4, 4)
            # restored step 2 last: step 4 is after it again, 6 too
            assert (line["should_save_4"], line["should_save_6"]) == (True, True)

    def test_fsdp2(self, job: dict[str, list[dict[str, Any]]]) -> None:
        for line in _each_rank(job, "fsdp2"):
            assert (line["step"], line["equal"]) == (1, True)


class TestStrict:
    """Under strict (the default), a save the daemon refuses raises in the trainer."""

    def test_refusals_raise(self, job: dict[str, list[dict[str, Any]]]) -> None:
        for line in _each_rank(job, "refused"):
            assert line["codes"] == ["already_promoted", "root_not_configured"], line

    def test_not_strict_under_a_strict_environment(
        self, job: dict[str, list[dict[str, Any]]]
    ) -> None:
        # The manager applies strict itself; CKPTD_STRICT=1 does not override strict=False.
        for line in _each_rank(job, "not_strict"):
            assert line["raised"] == "", line
        assert len(job.get("done", [])) == 2

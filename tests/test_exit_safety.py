"""The last save of a training script survives the way the script ends.

Five real 2-rank gloo jobs (``tests/_exit_worker.py``), one per ending, run at once
against one real daemon, each in its own root: each saves step 1 (a model and its
optimizer, a few MB) and ends at once, while the upload still runs: with
``dist.destroy_process_group()`` and no close (``orchestrator.async_save``, and the
manager), by returning (plain interpreter exit), with the manager as a context manager,
or with ``client.close()`` first. In every case step 1 is promoted, every rank exits 0
and nothing prints a traceback. The daemon's lease is short (2 s), so that a rank that
went away without reporting fails its step within the test's deadline.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from orchestrator import CheckpointClient
from tests._ranks import free_port, pump_lines, start_rank
from tests.conftest import REPO, DaemonProcess

pytestmark = pytest.mark.slow

WORKER = REPO / "tests" / "_exit_worker.py"
ENDINGS = ("destroy", "exit", "manager-destroy", "manager-with", "close")
JOB_TIMEOUT = 120.0
"""Seconds a job may take: a deadline for a hang (a few seconds on a quiet machine)."""


@dataclass
class Ending:
    """One job's end: its ranks' exit codes and lines, and the daemon's word on step 1."""

    codes: list[int] = field(default_factory=list)
    lines: list[dict[str, Any]] = field(default_factory=list)
    state: str = ""
    reason: str | None = None


@pytest.fixture(scope="module")
def endings() -> Iterator[dict[str, Ending]]:
    base = Path(tempfile.mkdtemp(prefix="ck-", dir="/tmp"))
    roots = {name: base / name for name in ENDINGS}
    for root in roots.values():
        root.mkdir()
    daemon = DaemonProcess(base / "d.sock", list(roots.values()), "--lease", "2")
    results = {name: Ending() for name in ENDINGS}
    procs: list[tuple[str, subprocess.Popen[bytes]]] = []
    pumps: list[threading.Thread] = []
    try:
        daemon.start()
        for name, root in roots.items():
            port = free_port()
            for rank in range(2):
                cmd = [str(WORKER), "--root", str(root), "--ending", name]
                proc = start_rank(cmd, rank, 2, port, daemon.socket_path)
                procs.append((name, proc))
                pumps.append(pump_lines(proc, rank, results[name].lines.append))
        for name, proc in procs:
            results[name].codes.append(proc.wait(JOB_TIMEOUT))
        for pump in pumps:
            pump.join(30)
        with CheckpointClient(str(daemon.socket_path)) as client:
            for name, root in roots.items():
                outcome = client.wait(str(root), 1, timeout=60)
                results[name].state, results[name].reason = outcome.state, outcome.reason
        yield results
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        daemon.kill()
        if daemon.proc is not None and daemon.proc.stdout is not None:
            daemon.proc.stdout.close()
        shutil.rmtree(base, ignore_errors=True)


def _survived(ending: Ending) -> None:
    output = "".join(line.get("line", "") for line in ending.lines)
    assert "Traceback" not in output, output
    assert ending.codes == [0, 0], (ending.codes, output)
    assert sorted(line["rank"] for line in ending.lines if line["event"] == "ended") == [0, 1]
    assert ending.state == "promoted", (ending.state, ending.reason, output)


class TestEndings:
    """Each common ending of a training script keeps its last checkpoint."""

    def test_destroy_process_group_right_after_async_save(self, endings: dict[str, Ending]) -> None:
        _survived(endings["destroy"])

    def test_plain_exit_after_async_save(self, endings: dict[str, Ending]) -> None:
        _survived(endings["exit"])

    def test_destroy_process_group_with_the_manager_open(self, endings: dict[str, Ending]) -> None:
        _survived(endings["manager-destroy"])

    def test_manager_as_context_manager(self, endings: dict[str, Ending]) -> None:
        _survived(endings["manager-with"])

    def test_explicit_close_then_destroy(self, endings: dict[str, Ending]) -> None:
        _survived(endings["close"])

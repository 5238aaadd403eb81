"""The demo's training job end to end, as ``scripts/demo`` runs it, twice around a restart.

A real ``ckptd serve`` on a fresh root and state directory; ``torchrun`` with two ranks
running ``examples/train.py`` (DDP on gloo, ``dcp.async_save`` through the client); then
the daemon is stopped and started again on the same state directory and the job runs
again, resuming from ``latest``. Any traceback in any output (ranks, torchrun, daemon)
fails the test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests._ranks import TORCHRUN, run_python
from tests.conftest import REPO, DaemonProcess

pytestmark = pytest.mark.slow

TRAIN = REPO / "examples" / "train.py"
JOB_TIMEOUT = 180.0
"""Seconds one run of the job may take: a deadline for a hang. It takes about 10 s on a
quiet 2-core machine, 20 s beside the suite's other jobs, and more than 40 s on a slower
one (two ranks and torchrun importing torch while the other workers' jobs do too)."""
TRACEBACK = "Traceback (most recent call last)"

Start = Callable[..., DaemonProcess]


def train(daemon: DaemonProcess, root: Path, *, steps: int, every: int) -> str:
    """Run the demo job once to completion; returns its combined output.

    Fails the test if the job does not exit 0 in time or prints a traceback.
    """
    env = {**os.environ, "CKPTD_SOCKET": str(daemon.socket_path), "OMP_NUM_THREADS": "1"}
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(TRAIN), str(root)]
    cmd += ["--steps", str(steps), "--every", str(every)]
    code, out = run_python(cmd, env, JOB_TIMEOUT)
    if TRACEBACK in out:
        pytest.fail(f"the job printed a traceback (exit {code}):\n{out}")
    if code != 0:
        pytest.fail(f"the job exited {code}:\n{out}")
    return out


def ckptd(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    """The ``ckptd`` command line as a real subprocess, talking to ``daemon``."""
    cmd = [sys.executable, "-m", "daemon", *args]
    if args[0] != "verify":
        cmd += ["--socket", str(daemon.socket_path)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=30, check=False)


def promoted(daemon: DaemonProcess, root: Path, steps: list[int]) -> None:
    """Wait for ``checkpoint.promoted`` of each of ``steps`` in ``root``."""

    def of(step: int) -> Callable[[dict[str, Any]], bool]:
        return lambda e: bool(e["root"] == str(root) and e["step"] == step)

    for step in steps:
        event = daemon.wait_event("checkpoint.promoted", timeout=30.0, match=of(step))
        assert event["path"] == str(root / f"step_{step}")


def latest_verifies(daemon: DaemonProcess, root: Path, step: int) -> None:
    """``ckptd latest`` names ``step_<step>`` and ``ckptd verify`` passes on it."""
    latest = ckptd(daemon, "latest", str(root))
    assert latest.returncode == 0, latest
    assert latest.stdout.strip() == str(root / f"step_{step}")
    verify = ckptd(daemon, "verify", latest.stdout.strip())
    assert verify.returncode == 0, verify


def no_daemon_trouble(events: list[dict[str, Any]]) -> None:
    """The daemon printed no traceback, no internal error and no failed checkpoint."""
    lines = "".join(e.get("line", "") for e in events if e["event"] == "_stdout")
    if TRACEBACK in lines:
        pytest.fail(f"the daemon printed a traceback:\n{lines}")
    bad = [e for e in events if e["event"] in ("daemon.internal_error", "checkpoint.failed")]
    assert bad == [], bad


class TestDemoJob:
    """The demo's 2-rank job checkpoints through a real daemon and resumes after a restart."""

    def test_train_restart_resume(self, start: Start, tmp_path: Path) -> None:
        root = tmp_path / "ckpt"
        root.mkdir()
        daemon = start([root])

        out = train(daemon, root, steps=10, every=5)
        assert "[train] step 10: promoted" in out, out
        promoted(daemon, root, [5, 10])
        latest_verifies(daemon, root, 10)

        assert daemon.stop(signal.SIGTERM) == 0
        daemon.wait_event("daemon.stopped", timeout=10.0)
        no_daemon_trouble(daemon.drain())
        assert daemon.proc is not None and daemon.proc.stdout is not None
        daemon.proc.stdout.close()
        daemon = start([root], "--state-dir", str(daemon.state_dir))

        out = train(daemon, root, steps=10, every=5)
        assert f"[train] resumed from {root / 'step_10'}" in out, out
        assert "[train] step 20: promoted" in out, out
        promoted(daemon, root, [15, 20])
        latest_verifies(daemon, root, 20)
        assert sorted(p.name for p in root.glob("step_*")) == [
            "step_10",
            "step_15",
            "step_20",
            "step_5",
        ]
        assert list(root.glob("tmp_step_*")) == []
        no_daemon_trouble(daemon.drain())

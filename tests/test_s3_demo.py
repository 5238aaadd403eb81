"""The demo's job on an object store, as ``scripts/demo s3`` runs it, around a restart.

A real SeaweedFS (started here, as ``scripts/local-s3`` does for the demo), a real
``ckptd serve`` with an ``s3://`` root, and ``torchrun`` with two ranks of
``examples/train.py``; then the daemon is restarted on its state directory and the job
runs again, resuming from ``latest`` through one GET of the pointer object.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._ranks import TORCHRUN, run_python
from tests._s3 import S3Server, serve
from tests.conftest import REPO, DaemonProcess
from tests.test_demo import JOB_TIMEOUT, TRACEBACK

pytestmark = pytest.mark.slow

TRAIN = REPO / "examples" / "train.py"


@pytest.fixture(scope="module")
def seaweed() -> Iterator[S3Server]:
    yield from serve("seaweedfs")


def train(daemon: DaemonProcess, env: dict[str, str], root: str) -> str:
    """Run the demo job once (10 steps, a checkpoint every 5); its combined output."""
    full = {**os.environ, **env, "CKPTD_SOCKET": str(daemon.socket_path), "OMP_NUM_THREADS": "1"}
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(TRAIN), root]
    code, out = run_python([*cmd, "--steps", "10", "--every", "5"], full, JOB_TIMEOUT)
    assert TRACEBACK not in out, out
    assert code == 0, out
    return out


def ckptd(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The ``ckptd`` command line as a real subprocess (no daemon: the root is the truth)."""
    nowhere = ["--socket", "/nonexistent/ckptd.sock"]
    return subprocess.run(
        [sys.executable, "-m", "daemon", *args, *([] if args[0] == "verify" else nowhere)],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


class TestDemoOnS3:
    """The 2-rank demo job checkpoints to SeaweedFS and resumes after a daemon restart."""

    def test_train_restart_resume(self, seaweed: S3Server, short_dir: Path) -> None:
        root = seaweed.root()
        env = seaweed.env()
        state = short_dir / "state"
        daemon = DaemonProcess(short_dir / "d.sock", [], "--root", root, state_dir=state, env=env)
        daemon.start()
        try:
            out = train(daemon, env, root)
            assert f"[train] step 10: promoted {root}/step_10/" in out, out
            daemon.stop()
        finally:
            daemon.kill()
            assert daemon.proc is not None and daemon.proc.stdout is not None
            daemon.proc.stdout.close()
        again = DaemonProcess(short_dir / "d.sock", [], "--root", root, state_dir=state, env=env)
        again.start()
        try:
            out = train(again, env, root)
            assert f"[train] resumed from {root}/step_10/" in out, out
            assert "[train] step 20: promoted" in out, out
        finally:
            again.kill()
            assert again.proc is not None and again.proc.stdout is not None
            again.proc.stdout.close()
        latest = ckptd(env, "latest", root)
        assert latest.returncode == 0, latest
        assert latest.stdout.startswith(f"{root}/step_20/")
        verify = ckptd(env, "verify", latest.stdout.strip())
        assert verify.returncode == 0, verify
        listing = ckptd(env, "ls", root)
        assert listing.returncode == 0, listing
        steps = [line.split()[0] for line in listing.stdout.splitlines()[1:]]
        assert steps == ["5", "10", "15", "20"], listing.stdout
        assert "20 *" in listing.stdout

"""The ``deploy/slurm`` recipes on a real Slurm cluster (two slurmd on this machine).

One cluster (``tests/_slurm.py``) serves the whole module. slurmd runs the recipe's own
``prolog.sh``/``epilog.sh``; the no-admin jobs call ``ckptd-node.sh`` as
``example-noadmin.sbatch`` does; the training jobs run ``examples/train.py`` under
``srun``, two ranks a node, checkpointing through each node's daemon. The requeue
scenario runs once (a module fixture) and each test reads one promise from its outcome.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from daemon.config._config import load_config
from orchestrator.protocol import ATTEMPT_MARKER
from tests._nodes import wait_until
from tests._slurm import CKPTD, CRED_EXPIRE, NODES, SlurmCluster, pid_alive, slurm_cluster
from tests.conftest import REPO

pytestmark = pytest.mark.slow

NODE_SH = REPO / "deploy" / "slurm" / "ckptd-node.sh"
JOB_TIMEOUT = 180.0
"""Seconds a job may take to run: a deadline for a hang (a training run takes about 10 s
on a quiet machine, several times that beside the suite's other jobs on a slow one)."""
TRACEBACK = "Traceback (most recent call last)"


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    """The module's cluster: up once, down (daemons, munged, files) after its last test."""
    with slurm_cluster() as cluster:
        yield cluster


def ckptd(*args: str) -> subprocess.CompletedProcess[str]:
    """The ``ckptd`` command line as a real subprocess."""
    return subprocess.run([CKPTD, *args], capture_output=True, text=True, timeout=30, check=False)


def names(events: list[dict[str, Any]]) -> list[str]:
    """The events' names, in order."""
    return [str(e["event"]) for e in events]


def port() -> str:
    """A free loopback port for a job's ``MASTER_PORT`` (and the next, for its requeue)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def stopped_cleanly(events: list[dict[str, Any]], node: str) -> None:
    """A daemon's events end with SIGTERM, a drain and a clean stop."""
    seen = names(events)
    assert "daemon.ready" in seen, (node, seen)
    tail = [n for n in seen if n.startswith("daemon.")][-3:]
    assert tail == ["daemon.signal", "daemon.stopping", "daemon.stopped"], (node, seen)
    signalled = [e for e in events if e["event"] == "daemon.signal"]
    assert signalled[-1]["signal"] == "SIGTERM", signalled


class TestPrologEpilog:
    """slurmd's Prolog starts one daemon a node for a job naming its root; the Epilog stops it."""

    def test_a_daemon_per_node_for_the_job(self, slurm: SlurmCluster) -> None:
        root = slurm.base / "roots" / "admin"
        root.mkdir(parents=True)
        run = slurm.base / "run"
        script = (
            "#!/bin/bash\nset -euo pipefail\n"
            "srun --ntasks-per-node=1 bash -c '"
            f"sock={run}/$SLURMD_NODENAME/$SLURM_JOB_ID/ckptd.sock; "
            f'{CKPTD} health --socket "$sock" && '
            f'echo "$SLURMD_NODENAME pid $(<{run}/$SLURMD_NODENAME/$SLURM_JOB_ID/ckptd.pid)"'
            "'\n"
        )
        job = slurm.sbatch(script, "--nodes=2", f"--comment=ckptd_root={root}")
        info = slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, JOB_TIMEOUT)
        out = slurm.output(job)
        assert info["JobState"] == "COMPLETED", (info, out, slurm.logs())
        pids = {}
        for line in out.splitlines():
            if " pid " in line:
                node, _, pid = line.split()
                pids[node] = int(pid)
        assert sorted(pids) == list(NODES), out
        slurm.wait_epilogs(job)
        for node in NODES:
            events = slurm.events(node, job)
            ready = [e for e in events if e["event"] == "daemon.ready"]
            assert [e["pid"] for e in ready] == [pids[node]], events
            assert ready[0]["roots"] == [str(root)]
            stopped_cleanly(events, node)
            assert not pid_alive(pids[node])

    def test_no_daemon_without_a_root(self, slurm: SlurmCluster) -> None:
        job = slurm.sbatch("#!/bin/bash\nsrun true\n", "--nodes=2", "--comment=no roots here")
        info = slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, JOB_TIMEOUT)
        assert info["JobState"] == "COMPLETED", (info, slurm.output(job))
        for node in NODES:
            assert not slurm.run_dir(node, job).exists()
            assert slurm.events(node, job) == []


class TestNoAdmin:
    """``ckptd-node.sh start`` runs one daemon a node in a 4-task job; ``stop`` drains them."""

    def test_start_one_per_node_then_stop(self, slurm: SlurmCluster) -> None:
        root = slurm.base / "roots" / "noadmin"
        root.mkdir(parents=True)
        logs = slurm.base / "jobs"
        script = (
            "#!/bin/bash\nset -euo pipefail\n"
            f"export CKPTD_BIN={CKPTD} CKPTD_RUN_DIR={slurm.base}/nr/%j-%N CKPTD_NODE=%N\n"
            f"export CKPTD_LOG={logs}/ckptd-%j-%t.log CKPTD_STOP_GRACE=30\n"
            f"{NODE_SH} start --root {root}\n"
            # Every task of the job (two a node) reaches its own node's daemon.
            "srun bash -c '"
            f'{CKPTD} health --socket "$({NODE_SH} socket)" >/dev/null && '
            'echo "task $SLURM_PROCID on $SLURMD_NODENAME: healthy"\'\n'
            "began=$SECONDS\n"
            f"{NODE_SH} stop\n"
            'echo "stopped in $((SECONDS - began))s"\n'
        )
        job = slurm.sbatch(script, "--nodes=2", "--ntasks-per-node=2")
        info = slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, JOB_TIMEOUT)
        out = slurm.output(job)
        assert info["JobState"] == "COMPLETED", (info, out, slurm.logs())
        assert sum("healthy" in line for line in out.splitlines()) == 4, out
        assert "can't honor" not in out and "srun: error" not in out, out
        assert "Killed" not in out and "forcing job termination" not in out, out
        daemon_logs = sorted(logs.glob(f"ckptd-{job}-*.log"))
        assert [p.name for p in daemon_logs] == [f"ckptd-{job}-{t}.log" for t in (0, 1)]
        nodes = []
        for log in daemon_logs:
            text = log.read_text()
            assert "another daemon" not in text, text
            events = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
            assert names(events).count("daemon.ready") == 1, text
            sock = next(e for e in events if e["event"] == "daemon.ready")["socket"]
            nodes.append(Path(sock).parent.name.split("-", 1)[1])
            stopped_cleanly(events, log.name)
        assert sorted(nodes) == list(NODES)


@dataclass
class Requeued:
    """What the requeue scenario saw."""

    cluster: SlurmCluster
    job: int
    root: Path
    latest_before: int
    """The step ``latest`` named when the job was requeued (the newest complete one)."""
    in_flight: list[int]
    """Steps run 0 had begun and not promoted when it was requeued."""
    requeue_to_running: float
    """Seconds from ``scontrol requeue`` until the requeued run was running."""
    info: dict[str, str]
    output: str


PINNED = 2
RUN0_STEPS, RUN1_STEPS, EVERY = 8, 4, 2


def n1_done(root: Path, step: int) -> bool:
    """Whether node n1's marker of ``step`` says its ranks are done (or it is promoted)."""
    for where in (f"tmp_step_{step}", f"step_{step}"):
        try:
            marker = json.loads((root / where / ".ckptd-node-n1.json").read_text())
        except (OSError, ValueError):  # not there (yet), or renamed away meanwhile
            continue
        if marker.get("state") == "done":
            return True
    return False


@pytest.fixture(scope="module")
def requeued(slurm: SlurmCluster) -> Requeued:
    """A 2-node, 4-rank training job through the Prolog's daemons, requeued mid-save.

    Run 0 trains. Once node n1's daemon has marked step 2 it is killed: from then on no
    step can be promoted (the leader waits for n1's marker), so run 0's later saves stay
    in flight. ``step_2`` is promoted and pinned; once run 0's last save has left n0's
    ranks, the job is requeued. Run 1 (the Prolog's fresh daemons on fresh state
    directories) resumes and runs to completion. The site's file gives the root a
    ``keep_last = 1`` policy from run 1 on (run 0's daemons, with none, prune nothing
    before the pin).
    """
    root = slurm.base / "roots" / "requeue"
    root.mkdir(parents=True)
    config = slurm.base / "requeue.toml"
    config.write_text(f'[[roots]]\npath = "{root}"\n')
    listing = slurm.base / "jobs" / "ls-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}.json"
    n0_sock = slurm.base / "run" / "n0" / "$SLURM_JOB_ID" / "ckptd.sock"
    steps = f"$(( ${{SLURM_RESTART_COUNT:-0}} ? {RUN1_STEPS} : {RUN0_STEPS} ))"
    script = (
        "#!/bin/bash\nset -euo pipefail\n"
        'echo "run ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST"\n'
        f"srun --kill-on-bad-exit=1 {slurm.rank_sh} {root} --steps {steps} --every {EVERY}\n"
        f"{CKPTD} ls {root} --json --socket {n0_sock} > {listing}\n"
    )
    comment = f"--comment=ckptd_root={root} test_config={config}"
    env = {"MASTER_PORT": port()}
    job = slurm.sbatch(script, "--nodes=2", "--ntasks-per-node=2", "--requeue", comment, env=env)

    wait_until(lambda: n1_done(root, PINNED), JOB_TIMEOUT, "n1's marker of step 2 says done")
    os.kill(slurm.daemon_pid("n1", job), signal.SIGKILL)
    wait_until(lambda: (root / f"step_{PINNED}").is_dir(), JOB_TIMEOUT, "run 0 promoted step 2")
    leader = slurm.run_dir("n0", job) / "ckptd.sock"
    pinned = ckptd("pin", str(root), str(PINNED), "--socket", str(leader))
    assert pinned.returncode == 0, pinned
    last = RUN0_STEPS - RUN0_STEPS % EVERY
    wait_until(
        lambda: (
            (root / f"tmp_step_{last}" / ".ckptd-node-n0.json").exists()
            or (root / f"step_{last}").exists()
        ),
        JOB_TIMEOUT,
        f"run 0's ranks on n0 are done with step {last}",
    )
    latest_before = int(os.readlink(root / "latest").removeprefix("step_"))
    in_flight = sorted(int(p.name.removeprefix("tmp_step_")) for p in root.glob("tmp_step_*"))

    began = time.monotonic()
    slurm.run("scontrol", "requeue", str(job))
    pending = slurm.wait_state(job, {"PENDING"}, JOB_TIMEOUT, reason="BeginTime")
    assert pending["Reason"] == "BeginTime", pending
    config.write_text(f'[[roots]]\npath = "{root}"\n[roots.retention]\nkeep_last = 1\n')
    # It waits cred_expire seconds (tests/_slurm.py) before it runs again; do not skip
    # that (scontrol update StartTime=now): slurmd would not run the Prolog again for a
    # job id whose credential it still remembers, and the run would have no daemons.
    slurm.wait_state(job, {"RUNNING", "COMPLETING", "COMPLETED"}, JOB_TIMEOUT)
    requeue_to_running = time.monotonic() - began
    info = slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, JOB_TIMEOUT)
    slurm.wait_epilogs(job)
    return Requeued(
        cluster=slurm,
        job=job,
        root=root,
        latest_before=latest_before,
        in_flight=in_flight,
        requeue_to_running=requeue_to_running,
        info=info,
        output=slurm.output(job),
    )


def manifest(step_dir: Path) -> dict[str, Any]:
    """A promoted step's manifest."""
    found: dict[str, Any] = json.loads((step_dir / ".ckptd-manifest.json").read_text())
    return found


def attempt_marker(step_dir: Path) -> dict[str, Any]:
    """A step's attempt marker (which run's attempt owns it)."""
    found: dict[str, Any] = json.loads((step_dir / ATTEMPT_MARKER).read_text())
    return found


# The first test also pays for the scenario (two runs of a 4-rank job, about 40 s on a
# quiet 2-core machine, twice that beside a busy suite).
class TestRequeue:
    """A job requeued mid-save resumes from the newest complete step; runs never mix."""

    def test_the_job_ran_twice_and_completed(self, requeued: Requeued) -> None:
        out = requeued.output
        assert requeued.info["JobState"] == "COMPLETED", (requeued.info, out)
        assert requeued.info["Restarts"] == "1", requeued.info
        assert "run 0 on" in out and "run 1 on" in out, out
        assert TRACEBACK not in out, out
        # It waited out cred_expire (so slurmd ran the Prolog again), and no more than a
        # fraction of the default two minutes, however busy the machine.
        assert CRED_EXPIRE <= requeued.requeue_to_running < 60.0, requeued.requeue_to_running

    def test_run_0_was_requeued_mid_save(self, requeued: Requeued) -> None:
        assert requeued.latest_before >= PINNED
        assert [s for s in requeued.in_flight if s > requeued.latest_before], requeued

    def test_run_1_resumed_from_the_newest_complete_step(self, requeued: Requeued) -> None:
        step_dir = requeued.root / f"step_{requeued.latest_before}"
        assert f"[train] resumed from {step_dir}" in requeued.output, requeued.output
        last = requeued.latest_before + RUN1_STEPS
        assert f"[train] step {last}: promoted" in requeued.output, requeued.output
        assert os.readlink(requeued.root / "latest") == f"step_{last}"
        verify = ckptd("verify", str(requeued.root / f"step_{last}"))
        assert verify.returncode == 0, verify

    def test_every_promoted_step_is_one_runs(self, requeued: Requeued) -> None:
        job = requeued.job
        for step_dir in sorted(requeued.root.glob("step_*")):
            step = int(step_dir.name.removeprefix("step_"))
            marker = attempt_marker(step_dir)
            run = 0 if step <= requeued.latest_before else 1
            assert marker["run"] == f"slurm:{job}:{run}", (step, marker)
            assert manifest(step_dir)["attempt"] == marker["attempt"], step
            for node in NODES:
                inside = json.loads((step_dir / f".ckptd-node-{node}.json").read_text())
                assert inside["attempt"] == marker["attempt"], (step, node, inside)
            verify = ckptd("verify", str(step_dir))
            assert verify.returncode == 0, (step, verify)

    def test_the_pin_outlives_retention_in_the_requeued_run(self, requeued: Requeued) -> None:
        kept = sorted(int(p.name.removeprefix("step_")) for p in requeued.root.glob("step_*"))
        last = requeued.latest_before + RUN1_STEPS
        assert PINNED in kept and last in kept, kept
        listing = requeued.cluster.base / "jobs" / f"ls-{requeued.job}-1.json"
        rows = {r["step"]: r for r in json.loads(listing.read_text()) if r["state"] == "promoted"}
        assert "pinned" in rows[PINNED]["kept"], rows
        # keep_last = 1: run 1's earlier steps are retired; the pinned one is not.
        assert requeued.latest_before + EVERY not in kept, kept


class TestPrologRootInTheSiteConfig:
    """A root the Prolog names (``--root``) that the site's file lists is one root, the file's."""

    def test_the_files_policy_applies(self, tmp_path: Path) -> None:
        root = tmp_path / "run"
        root.mkdir()
        config = tmp_path / "slurm.toml"
        config.write_text(f'[[roots]]\npath = "{root}"\n[roots.retention]\nkeep_last = 2\n')
        loaded = load_config(config_file=str(config), roots=[f"{root}/"])
        assert [r.path for r in loaded.roots] == [str(root)]
        assert loaded.roots[0].retention is not None
        assert loaded.roots[0].retention.policy.keep_last == 2

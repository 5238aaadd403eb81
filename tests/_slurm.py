"""A real two-node Slurm cluster on this machine, for the ``deploy/slurm`` recipes.

``slurm_cluster()`` brings up, under one temporary directory ``D``: a ``munged`` on its
own socket and key (``D/munge.sock``; the host's munge is never touched), ``slurmctld``
and two ``slurmd -N n0`` / ``-N n1`` on free loopback ports, with every path of
``slurm.conf`` under ``D`` (``/work/shared/reference/slurm-testbed.md``). slurmd runs
the recipe's own ``prolog.sh`` and ``epilog.sh`` (``PrologFlags=Alloc``) through a
wrapper naming the site file ``D/slurm.env`` in ``CKPTD_SLURM_ENV``. Both "nodes" share
one host, so that file gives each node's daemon its own socket directory, event log and
name: ``D/run/<node>/<job>/ckptd.sock``, ``D/events/<node>/<job>.<node>.jsonl``,
``--node <node>``. Teardown cancels every job, stops the daemons by their pid files,
ends ``munged`` by its pid and removes ``D``, whatever happened before.

Everything here runs as root (slurmd runs prologs as root; the jobs' user is root too).
Without the tools, or not as root, a test skips; in CI (``CI=true``) it fails.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Final

from tests._nodes import wait_until
from tests._system import require_root, require_tool
from tests.conftest import REPO

__all__ = ["NODES", "SlurmCluster", "pid_alive", "require_slurm", "slurm_cluster"]

NODES: Final = ("n0", "n1")
"""The cluster's node names, in the order Slurm numbers them (n0 runs batch scripts)."""

START_TIMEOUT: Final = 30.0
"""Seconds each daemon (munged, slurmctld, both slurmd) has to come up."""

CRED_EXPIRE: Final = 8
"""Seconds a requeued job waits before it runs again (``AuthInfo=cred_expire``)."""

CKPTD: Final = str(Path(sys.executable).with_name("ckptd"))
"""The ``ckptd`` of the environment running the tests (what the recipes run)."""

TOOLS: Final = ("munged", "mungekey", "munge", "slurmctld", "slurmd", "sbatch", "scontrol")


def require_slurm() -> None:
    """Skip (in CI: fail) unless slurm-wlm and munge are installed and this is root."""
    for tool in TOOLS:
        require_tool(tool, "munge" if "munge" in tool else "slurm-wlm")
    require_root("slurmd runs the job Prolog and Epilog as root, and so does the test cluster")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _stop_pid_file(path: Path, timeout: float = 10.0) -> None:
    """SIGTERM the process ``path`` names, wait (bounded) for it, then SIGKILL it."""
    try:
        pid = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    if not pid_alive(pid):
        return
    try:
        handle = os.pidfd_open(pid)  # readable once the process has ended (not our child)
    except ProcessLookupError:
        return
    try:
        os.kill(pid, signal.SIGTERM)
        ended, _, _ = select.select([handle], [], [], timeout)
        if not ended and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    finally:
        os.close(handle)


class SlurmCluster:
    """A running test cluster: its ``slurm.conf``, its environment and what jobs left."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.conf = base / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        """What Slurm's commands (and the jobs submitted with them) run with."""
        self.rank_sh = base / "rank.sh"
        """Runs one rank of ``examples/train.py`` in a job step (``srun rank.sh ROOT ...``)."""

    # -- set-up ---------------------------------------------------------------------

    def write_files(self) -> None:
        """``slurm.conf``, the Prolog/Epilog wrappers, ``slurm.env`` and ``rank.sh``."""
        d = self.base
        for sub in ("state", "spool", "log", "run", "events", "jobs"):
            (d / sub).mkdir()
        for node in NODES:
            (d / "spool" / node).mkdir()
        ctld, *slurmd = (_free_port() for _ in range(1 + len(NODES)))
        nodes = [f"NodeName={n} Port={p} {_NODE}" for n, p in zip(NODES, slurmd, strict=True)]
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=ckptd-test",
                    "SlurmctldHost=localhost",
                    f"SlurmctldPort={ctld}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    # cred_expire: how long slurmd remembers a job's credential, and so how
                    # long a requeued job waits before it runs again (default 120 s). While
                    # slurmd remembers it, it does not run the Prolog for that job id again.
                    f"AuthInfo=socket={d}/munge.sock,cred_expire={CRED_EXPIRE}",
                    f"StateSaveLocation={d}/state",
                    f"SlurmdSpoolDir={d}/spool/%n",
                    f"SlurmctldPidFile={d}/slurmctld.pid",
                    f"SlurmdPidFile={d}/slurmd-%n.pid",
                    f"SlurmctldLogFile={d}/log/slurmctld.log",
                    f"SlurmdLogFile={d}/log/slurmd-%n.log",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "ReturnToService=2",
                    "JobRequeue=1",
                    "KillWait=5",
                    "SchedulerParameters=batch_sched_delay=0",
                    f"Prolog={d}/prolog",
                    f"Epilog={d}/epilog",
                    "PrologFlags=Alloc",
                    *nodes,
                    "PartitionName=debug Nodes=n[0-1] Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        for name in ("prolog", "epilog"):
            wrapper = d / name
            wrapper.write_text(
                "#!/bin/bash\n"
                f"export CKPTD_SLURM_ENV={d}/slurm.env\n"
                f"exec {REPO}/deploy/slurm/{name}.sh\n"
            )
            wrapper.chmod(0o755)
        # Sourced by the recipe's prolog.sh/epilog.sh on each node: one socket directory,
        # event log and name per node. A job's comment may name a daemon config file
        # (test_config=FILE), which is how a test gives its root a retention policy.
        (d / "slurm.env").write_text(
            f"CKPTD_BIN={CKPTD}\n"
            f"CKPTD_RUN_BASE={d}/run/$SLURMD_NODENAME\n"
            f"CKPTD_LOG_BASE={d}/events/$SLURMD_NODENAME\n"
            "CKPTD_NODE=$SLURMD_NODENAME\n"
            "CKPTD_START_TIMEOUT=30\n"
            "CKPTD_STOP_GRACE=30\n"
            "CKPTD_PROLOG_STRICT=1\n"
            "for word in ${SLURM_JOB_COMMENT:-}; do\n"
            "\tif [[ $word == test_config=* ]]; then CKPTD_CONFIG=${word#test_config=}; fi\n"
            "done\n"
        )
        # torch.distributed's variables from Slurm's; the node's socket from the recipe
        # in use (the Prolog's directory, or ckptd-node.sh's when NODE_SH is set).
        self.rank_sh.write_text(
            "#!/bin/bash\n"
            "set -euo pipefail\n"
            "export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID\n"
            "export MASTER_ADDR=127.0.0.1 OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1\n"
            "export MASTER_PORT=$((MASTER_PORT + ${SLURM_RESTART_COUNT:-0}))\n"
            'if [[ -n ${NODE_SH:-} ]]; then CKPTD_SOCKET=$("$NODE_SH" socket); else\n'
            f"\tCKPTD_SOCKET={d}/run/$SLURMD_NODENAME/$SLURM_JOB_ID/ckptd.sock\n"
            "fi\n"
            "export CKPTD_SOCKET\n"
            f"cd {REPO}\n"
            f'exec {sys.executable} examples/train.py "$@"\n'
        )
        self.rank_sh.chmod(0o755)

    def start_munge(self) -> None:
        """Start ``munged`` on the cluster's own socket and a fresh key; wait until it answers."""
        d = self.base
        key = d / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True)
        subprocess.run(
            [
                "munged",
                "--force",  # root, and a socket directory others cannot search
                f"--socket={d}/munge.sock",
                f"--key-file={key}",
                f"--pid-file={d}/munged.pid",
                f"--log-file={d}/log/munged.log",
                f"--seed-file={d}/munge.seed",
            ],
            check=True,
        )

        def answers() -> bool:
            cred = subprocess.run(
                ["munge", f"--socket={d}/munge.sock", "--no-input"],
                capture_output=True,
                check=False,
            )
            return cred.returncode == 0

        wait_until(answers, START_TIMEOUT, "munged answers", interval=0.05)

    def start_slurm(self) -> None:
        """Start slurmctld and both slurmd; wait until ``sinfo`` shows both nodes idle."""
        subprocess.run(["slurmctld", "-f", str(self.conf)], env=self.env, check=True)
        for node in NODES:
            subprocess.run(["slurmd", "-f", str(self.conf), "-N", node], env=self.env, check=True)

        def idle() -> str | None:
            out = self.run("sinfo", "--noheader", "--Node", "--format=%N %T", check=False).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            return out if all(states.get(n) == "idle" for n in NODES) else None

        wait_until(idle, START_TIMEOUT, f"both nodes idle ({self.logs()})", interval=0.1)

    def stop(self) -> None:
        """Cancel every job, stop the daemons, end munged; each step runs whatever failed."""
        d = self.base
        with ExitStack() as stack:
            stack.callback(_stop_pid_file, d / "munged.pid")
            stack.callback(_stop_pid_file, d / "slurmctld.pid")
            for node in NODES:
                stack.callback(_stop_pid_file, d / f"slurmd-{node}.pid")
            if (d / "slurmctld.pid").exists():
                self._cancel_all()
            # Daemons whose Epilog never ran (a test that failed half-way).
            for pid_file in (d / "run").glob("*/*/ckptd.pid"):
                _stop_pid_file(pid_file)

    def _cancel_all(self) -> None:
        self.run("scancel", "--full", "--user=root", check=False)

        def none_left() -> bool:
            out = self.run("squeue", "--noheader", "--format=%i", check=False)
            return out.returncode == 0 and not out.stdout.strip()

        try:
            wait_until(none_left, 30.0, "every job ended", interval=0.1)
        except AssertionError:
            pass  # the daemons are stopped anyway

    # -- use ------------------------------------------------------------------------

    def run(
        self, *cmd: str, check: bool = True, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """A Slurm command (``sbatch``, ``scontrol`` ...) against this cluster."""
        result = subprocess.run(
            cmd, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}: {result.stderr}")
        return result

    def sbatch(self, script: str, *options: str, env: Mapping[str, str] | None = None) -> int:
        """Submit ``script`` (its text) with ``options``; returns the job id."""
        path = Path(tempfile.mkstemp(dir=self.base / "jobs", suffix=".sbatch")[1])
        path.write_text(script)
        out = self.base / "jobs" / "%j.out"
        cmd = ["sbatch", "--parsable", f"--output={out}", "--open-mode=append", *options]
        result = subprocess.run(
            [*cmd, str(path)],
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if result.returncode != 0:
            raise AssertionError(f"sbatch exited {result.returncode}: {result.stderr}")
        return int(result.stdout.strip().split(";")[0])

    def job(self, job: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (``JobState``, ``Restarts``, ``Reason`` ...)."""
        out = self.run("scontrol", "--oneliner", "show", "job", str(job)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_state(
        self, job: int, states: set[str], timeout: float, reason: str | None = None
    ) -> dict[str, str]:
        """The job's fields once its ``JobState`` is one of ``states`` (with ``reason``).

        A requeued job is ``PENDING`` with reason ``None`` for a moment before slurmctld
        gives it its begin time: ``reason`` waits for the one that matters.
        """

        def reached() -> dict[str, str] | None:
            info = self.job(job)
            if info.get("JobState") not in states:
                return None
            return info if reason is None or info.get("Reason") == reason else None

        found: dict[str, str] = wait_until(
            reached, timeout, f"job {job} in {states} (output: {self.output(job)})", interval=0.1
        )
        return found

    def output(self, job: int) -> str:
        """The job's batch output so far (every run of it: ``--open-mode=append``)."""
        path = self.base / "jobs" / f"{job}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def run_dir(self, node: str, job: int) -> Path:
        """Where the Prolog put the job's daemon on ``node`` (socket, pid, journal)."""
        return self.base / "run" / node / str(job)

    def wait_epilogs(self, job: int, timeout: float = 30.0) -> None:
        """Return once ``job``'s Epilog has stopped its daemons and removed their dirs.

        slurmd runs the Epilog on every node once the job's steps have ended.
        """

        def done() -> bool:
            return not any(self.run_dir(node, job).exists() for node in NODES)

        wait_until(done, timeout, f"the Epilog of job {job} on every node")

    def daemon_pid(self, node: str, job: int) -> int:
        """The pid of the daemon the Prolog started for ``job`` on ``node``."""
        return int((self.run_dir(node, job) / "ckptd.pid").read_text())

    def events(self, node: str, job: int) -> list[dict[str, Any]]:
        """The events the Prolog's daemons for ``job`` on ``node`` printed (every run)."""
        path = self.base / "events" / node / f"{job}.{node}.jsonl"
        found = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                found.append(json.loads(line))
            except ValueError:
                found.append({"event": "_stdout", "line": line})
        return found

    def logs(self) -> str:
        """The tail of every Slurm daemon's log, for a failure message."""
        return "\n".join(
            f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-15:])
            for log in sorted((self.base / "log").glob("*.log"))
        )


_NODE = "NodeHostname=localhost NodeAddr=127.0.0.1 CPUs=2 RealMemory=2000 State=UNKNOWN"


@contextmanager
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A running two-node cluster under a fresh directory; everything is gone after."""
    require_slurm()
    base = Path(tempfile.mkdtemp(prefix="ckslurm-", dir="/tmp"))
    cluster = SlurmCluster(base)
    try:
        cluster.write_files()
        cluster.start_munge()
        cluster.start_slurm()
        yield cluster
    finally:
        try:
            cluster.stop()
        finally:
            shutil.rmtree(base, ignore_errors=True)

"""transformers' Trainer on ckptd in real jobs: killed mid-save, resumed; across two nodes.

The job is ``tests/_hf_worker.py``: a 1-layer GPT-2 from a config, a Trainer subclass of
the job's own switched with ``orchestrator.transformers.with_ckptd``, a save and an
evaluation every step (best at step 3), ``save_total_limit = 2`` and
``load_best_model_at_end``.

- Under ``torchrun`` (its command line, ``python -m torch.distributed.run --standalone
  --nproc-per-node 2``: 2 ranks, gloo on CPU), rank 1 SIGKILLs itself in the middle of
  step 6's save. torchrun ends the job; the daemon fails step 6 once the rank's lease
  runs out, and nothing of it is ever named ``checkpoint-6``. A new run with
  ``resume_from_checkpoint=True`` resumes from ``checkpoint-5`` with its weights, trains
  to step 8 and loads the best checkpoint (3) at the end. Retention keeps what
  ``save_total_limit`` says, and the best, at every point.
- On two simulated nodes (a mount namespace each, the shared directory on a caching
  bindfs mount, a daemon each), one rank per node: the case that broke transformers'
  own staging (``tmp-checkpoint-N -> checkpoint-N`` raced across nodes). Each
  checkpoint is renamed once, by the leader's daemon, and both nodes agree.

torchrun and the ranks are forked from the test zygote that imported transformers once
(``tests/_zygote.py``; torchrun's ranks through ``tests/_zygote_launch.py``), as
``tests/_ranks.py`` ``run_python`` forks torchrun: each would spend about 7 s of CPU
importing it afresh.
"""

from __future__ import annotations

import os
import queue
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.transformers._daemon import STAGING_SUFFIX, Retention, root_toml
from tests._nodes import Cluster, make_cluster
from tests._ranks import TORCHRUN, free_port, pump_lines
from tests._zygote import zygote
from tests.conftest import REPO, DaemonProcess

__all__ = ["make_cluster"]  # the fixture, imported for pytest

pytestmark = pytest.mark.slow

WORKER = str(REPO / "tests" / "_hf_worker.py")
DEADLINE = 180.0
"""Seconds a job may take to say what a test waits for (a hang's deadline)."""
RETENTION = Retention(2, "eval_score", "max")


class Job:
    """One process (torchrun, or a rank in a node), its ranks' JSON lines queued.

    ``argv``: the Python process's arguments (``python argv...``).
    """

    def __init__(self, argv: list[str], env: dict[str, str], mount_ns: int | None = None) -> None:
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        full = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env}
        full.pop("TORCHELASTIC_RESTART_COUNT", None)
        forked = zygote("transformers")
        if forked is None:
            pytest.skip("the test zygote is off (CKPTD_TEST_FORK=0)")
        self.proc = forked.spawn(argv, full, REPO, mount_ns=mount_ns)
        pump_lines(self.proc, -1, self.lines.put)

    def wait(self, event: str, **match: Any) -> dict[str, Any]:
        """The next line ``event`` that matches; fails on a hang."""
        deadline = time.monotonic() + DEADLINE
        for line in self.seen:
            if _matches(line, event, match) and not line.get("_taken"):
                line["_taken"] = True
                return line
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                raise AssertionError(f"no {event}: {self.output()}") from None
            self.seen.append(line)
            if _matches(line, event, match):
                line["_taken"] = True
                return line

    def exit_code(self) -> int:
        """Wait for the process to exit."""
        code: int = self.proc.wait(DEADLINE)
        return code

    def output(self) -> str:
        """The last lines (for a failure's message)."""
        return "\n".join(str(line)[:300] for line in self.seen[-40:])

    def kill(self) -> None:
        """End it if it still runs: SIGTERM (torchrun stops its ranks), then SIGKILL."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def _matches(line: dict[str, Any], event: str, match: dict[str, Any]) -> bool:
    return line.get("event") == event and all(line.get(k) == v for k, v in match.items())


def checkpoints(out: Path) -> list[int]:
    """What transformers lists: the steps of ``output_dir``'s ``checkpoint-N`` entries."""
    return sorted(int(n.split("-")[1]) for n in os.listdir(out) if n.startswith("checkpoint-"))


def torchrun(out: Path, *options: str) -> list[str]:
    """``torchrun``'s command line for the job: 2 ranks of the worker writing to ``out``.

    ``--standalone``: a rendezvous of its own, and a new run id each time it starts.
    """
    return [*TORCHRUN, "--standalone", "--nproc-per-node", "2", WORKER, "rank", str(out), *options]


def at(step: int) -> Callable[[dict[str, Any]], bool]:
    return lambda event: event.get("step") == step


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[DaemonProcess, Path]]:
    """A daemon (lease 1 s) serving ``tmp_path/out`` as ``root_toml`` says, and that root."""
    out, staging = tmp_path / "out", tmp_path / f"out{STAGING_SUFFIX}"
    out.mkdir()
    staging.mkdir()
    config = tmp_path / "ckptd.toml"
    config.write_text(root_toml(str(out), RETENTION))
    home = Path(tempfile.mkdtemp(prefix="ck-hf-", dir="/tmp"))
    daemon = DaemonProcess(home / "d.sock", [], "--config", str(config), "--lease", "1")
    try:
        yield daemon.start(), out
    finally:
        daemon.kill()
        if daemon.proc is not None and daemon.proc.stdout is not None:
            daemon.proc.stdout.close()


def test_killed_mid_save_then_resumed(served: tuple[DaemonProcess, Path]) -> None:
    daemon, out = served
    staging = out.with_name(out.name + STAGING_SUFFIX)
    env = {"CKPTD_SOCKET": str(daemon.socket_path)}
    first = Job(torchrun(out, "--steps", "8", "--die-at", "6"), env)
    try:
        for rank in (0, 1):
            assert first.wait("loaded", rank=rank)["step"] == 0
        saved = {first.wait("saved", rank=0, step=s)["step"]: None for s in (1, 2, 3, 4, 5)}
        digest_5 = next(line for line in first.seen if _matches(line, "saved", {"step": 5}))
        first.wait("dying", rank=1, step=6)
        assert first.exit_code() != 0, first.output()
    finally:
        first.kill()
    assert list(saved) == [1, 2, 3, 4, 5]
    daemon.wait_event("checkpoint.promoted", match=at(5))
    failed = daemon.wait_event("checkpoint.failed", match=at(6))
    daemon.wait_event("checkpoint.retired", match=at(2))
    # The newest two and the best (3); nothing of step 6 under its final name, nor staged.
    assert checkpoints(out) == [3, 4, 5], failed
    assert os.listdir(staging) == []
    assert (out / "latest").resolve().name == "checkpoint-5"
    assert (out / "best").resolve().name == "checkpoint-3"

    second = Job(torchrun(out, "--steps", "8", "--resume"), env)
    try:
        for rank in (0, 1):
            loaded = second.wait("loaded", rank=rank)
            assert (loaded["step"], loaded["digest"]) == (5, digest_5["digest"]), loaded
        finished = [second.wait("finished", rank=rank) for rank in (0, 1)]
        assert second.exit_code() == 0, second.output()
    finally:
        second.kill()
    best_3 = next(line for line in first.seen if _matches(line, "saved", {"step": 3}))
    for line in finished:  # load_best_model_at_end: checkpoint-3's weights, on each rank
        assert line["best"] == str(out / "checkpoint-3") and line["daemon"] is True
        assert line["digest"] == best_3["digest"]
    for step in (6, 7, 8):
        daemon.wait_event("checkpoint.promoted", match=at(step))
    for step in (5, 6):
        daemon.wait_event("checkpoint.retired", match=at(step))
    assert checkpoints(out) == [3, 7, 8]
    assert os.listdir(staging) == []


def test_two_nodes_promote_once_and_agree(make_cluster: Callable[..., Cluster]) -> None:
    nodes = make_cluster(2)
    root = nodes.root
    staging = root.with_name(root.name + STAGING_SUFFIX)
    (nodes.backing / staging.name).mkdir()
    for node in nodes:
        config = node.home / "hf.toml"
        config.write_text(root_toml(str(root), RETENTION, staging=str(staging)))
        node.start_daemon([], "--config", str(config))
    port = free_port()
    ranks = []
    for rank, node in enumerate(nodes):
        env = {
            "CKPTD_SOCKET": str(node.socket),
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": "hf-nodes",
            "TORCHELASTIC_RESTART_COUNT": "0",
        }
        ranks.append(Job([WORKER, "rank", str(root), "--steps", "4"], env, mount_ns=node.pid))
    try:
        finished = [job.wait("finished") for job in ranks]
        assert [job.exit_code() for job in ranks] == [0, 0], ranks[1].output()
    finally:
        for job in ranks:
            job.kill()
    assert finished[0]["best"] == finished[1]["best"] == str(root / "checkpoint-3")
    assert finished[0]["digest"] == finished[1]["digest"]
    leader, follower = (node.daemon for node in nodes)
    assert leader is not None and follower is not None
    for step in (1, 2, 3, 4):
        for daemon in (leader, follower):
            promoted = daemon.wait_event("checkpoint.promoted", match=at(step))
            assert promoted["path"] == str(root / f"checkpoint-{step}"), promoted
    leader.wait_event("checkpoint.retired", match=at(2))
    for step in (3, 4):  # the kept ones (a retired step is forgotten)
        answers = [node.wait(root, step) for node in nodes]
        assert [a["state"] for a in answers] == ["promoted", "promoted"], answers
        assert answers[0]["path"] == answers[1]["path"] == str(root / f"checkpoint-{step}")
    # One rename per checkpoint, by the leader; the follower only learned of them.
    renames = [e for e in follower.drain() if e["event"] == "checkpoint.promoting"]
    assert renames == []
    promoting = [e["step"] for e in leader.drain() if e["event"] == "checkpoint.promoting"]
    assert sorted(promoting) == [1, 2, 3, 4]
    assert checkpoints(nodes.backing_root) == [3, 4]
    assert os.listdir(nodes.backing / staging.name) == []

"""A dead run is superseded at once, and a trainer's mistakes are loud.

A ``begin`` of a later run of the same launch (torchelastic's run id with a higher
restart count, or the same Slurm job requeued) proves the earlier run dead: its open
attempt fails at once, "superseded by run ...", and is set aside, on one node and
across nodes (the leader decides, the other nodes learn it from the shared directory).
Unrelated runs still conflict. Under ``strict`` a refused ``begin`` raises in the
trainer; a relative root is made absolute; a refused save leaves no directory.
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from daemon.base._errors import RequestError
from daemon.ledger._ledger import Ledger, SaveKey
from orchestrator._run import run_identity
from orchestrator.protocol import ErrorCode, SaveState, run_supersedes
from tests.conftest import REPO, DaemonProcess, LineClient
from tests.test_spanning import Job, cluster  # noqa: F401 - the cluster fixture

KEY = SaveKey("/ckpt/run-42", 5)
DEAD, RESTARTED, UNRELATED = "torchelastic:job:0", "torchelastic:job:1", "torchelastic:other:0"
WORKER = REPO / "tests" / "_loud_worker.py"
DEADLINE = 120.0


class TestTheRule:
    """Only a later run of the same torchelastic or Slurm launch supersedes."""

    def test_a_restart_of_the_same_launch(self) -> None:
        assert run_supersedes("torchelastic:job:1", "torchelastic:job:0")
        assert run_supersedes("slurm:77:2", "slurm:77:1")
        assert run_supersedes("torchelastic:a:b:10", "torchelastic:a:b:9")

    def test_never_an_earlier_the_same_or_an_unrelated_run(self) -> None:
        assert not run_supersedes("torchelastic:job:0", "torchelastic:job:1")
        assert not run_supersedes("torchelastic:job:1", "torchelastic:job:1")
        assert not run_supersedes("torchelastic:job:1", "torchelastic:other:0")
        assert not run_supersedes("slurm:job:1", "torchelastic:job:0")
        assert not run_supersedes("mine-2", "mine-1")
        assert not run_supersedes(None, "torchelastic:job:0")
        assert not run_supersedes("torchelastic:job:1", "")

    def test_a_digested_launch_id_keeps_its_restart_count(self) -> None:
        env = {"TORCHELASTIC_RUN_ID": "a run / with spaces", "TORCHELASTIC_RESTART_COUNT": "0"}
        first = run_identity(None, env)
        again = run_identity(None, {**env, "TORCHELASTIC_RESTART_COUNT": "1"})
        assert first is not None and first.startswith("torchelastic:sha256-")
        assert run_supersedes(again, first)


class TestTheLedger:
    """The ledger fails a superseded open attempt; only its decider does; replay agrees."""

    def test_a_later_run_fails_the_open_attempt(self) -> None:
        ledger = Ledger(lease=300.0, save_timeout=None)
        ledger.begin(KEY, 0, 2, conn=1, now=0.0, fresh="a1", run=DEAD)
        ledger.disconnect(1, now=1.0)
        with pytest.raises(RequestError) as caught:
            ledger.begin(KEY, 0, 2, conn=2, now=2.0, fresh="a2", run=UNRELATED)
        assert caught.value.code is ErrorCode.RUN_CONFLICT
        assert ledger.supersede(KEY, UNRELATED, 2.0) == []
        effects = ledger.supersede(KEY, RESTARTED, 2.0)
        save = ledger.get(KEY)
        assert save is not None and save.state is SaveState.FAILED
        assert save.reason == f"superseded by run {RESTARTED}"
        assert [type(e).__name__ for e in effects] == ["Emit", "SetAside"]
        ledger.begin(KEY, 1, 2, conn=2, now=2.0, fresh="a2", run=RESTARTED)
        renewed = ledger.get(KEY)
        assert renewed is not None and (renewed.attempt, renewed.run) == ("a2", RESTARTED)
        replayed = Ledger(lease=300.0, save_timeout=None)
        for record in ledger.drain_records():
            replayed.replay(record, 0.0)
        again = replayed.get(KEY)
        assert again is not None and (again.attempt, again.state) == ("a2", SaveState.OPEN)

    def test_a_node_that_does_not_lead_leaves_it_to_the_leader(self) -> None:
        ledger = Ledger(lease=300.0, save_timeout=None)
        ledger.begin(KEY, 1, 2, conn=1, now=0.0, fresh="a1", local_world_size=1, run=DEAD)
        assert ledger.superseded_by(KEY, RESTARTED) is not None
        assert not ledger.may_supersede(KEY)
        assert ledger.supersede(KEY, RESTARTED, 1.0) == []
        save = ledger.get(KEY)
        assert save is not None and save.state is SaveState.OPEN

    def test_a_save_past_open_is_judged_on_its_files(self) -> None:
        ledger = Ledger(lease=300.0, save_timeout=None)
        ledger.begin(KEY, 0, 1, conn=1, now=0.0, fresh="a1", run=DEAD)
        ledger.done(KEY, 0, [], conn=1, now=1.0)
        assert ledger.supersede(KEY, RESTARTED, 2.0) == []


def _begin(daemon: DaemonProcess, root: Path, step: int, rank: int, run: str) -> dict[str, Any]:
    """One rank's begin, on a connection closed right after (the rank then dies)."""
    with LineClient(daemon.socket_path) as c:
        return c.request("begin", root=str(root), step=step, rank=rank, world_size=2, run=run)


def _done(daemon: DaemonProcess, root: Path, step: int, rank: int) -> dict[str, Any]:
    (root / f"tmp_step_{step}" / f"r{rank}.bin").write_bytes(b"x" * 8)
    files = [{"path": f"r{rank}.bin", "size": 8}]
    with LineClient(daemon.socket_path) as c:
        return c.request("done", root=str(root), step=step, rank=rank, files=files)


def _trash(root: Path) -> list[str]:
    return sorted(os.listdir(root / ".ckptd-trash"))


class TestOneNode:
    """On one node the daemon supersedes the dead run's attempt at the restarted run's begin."""

    def test_the_restarted_run_saves_the_step_at_once(
        self, start: Callable[..., DaemonProcess], tmp_path: Path
    ) -> None:
        root = tmp_path / "ckpt"
        root.mkdir()
        daemon = start([root], "--lease", "300")
        dead = [_begin(daemon, root, 5, r, DEAD) for r in (0, 1)]
        assert all(r["ok"] for r in dead), dead
        refused = _begin(daemon, root, 5, 0, UNRELATED)
        assert refused["error"]["code"] == "run_conflict", refused
        again = [_begin(daemon, root, 5, r, RESTARTED) for r in (1, 0)]
        assert all(r["ok"] for r in again), again
        assert {r["attempt"] for r in again} != {dead[0]["attempt"]}
        assert len({r["attempt"] for r in again}) == 1
        failed = daemon.wait_event(
            "checkpoint.failed", match=lambda e: e["attempt"] == dead[0]["attempt"]
        )
        assert failed["reason"] == f"superseded by run {RESTARTED}"
        event = daemon.wait_event("save.superseded")
        assert (event["run"], event["by_run"]) == (DEAD, RESTARTED)
        assert any(dead[0]["attempt"] in name for name in _trash(root))
        assert all(_done(daemon, root, 5, r)["ok"] for r in (0, 1))
        with LineClient(daemon.socket_path) as c:
            reply = c.request("wait", root=str(root), step=5, timeout=30)
        assert reply["state"] == "promoted", reply

    def test_a_daemon_with_an_empty_state_directory_decides_the_same(
        self, start: Callable[..., DaemonProcess], tmp_path: Path
    ) -> None:
        root = tmp_path / "ckpt"
        root.mkdir()
        daemon = start([root], "--lease", "300")
        dead = _begin(daemon, root, 5, 0, DEAD)
        daemon.kill()
        shutil.rmtree(daemon.state_dir)
        fresh = start([root], "--lease", "300", socket_name="e.sock")
        again = [_begin(fresh, root, 5, r, RESTARTED) for r in (0, 1)]
        assert all(r["ok"] for r in again), again
        assert any(dead["attempt"] in name for name in _trash(root))


def _begin_all(job: Job, run: str, order: list[int]) -> dict[int, dict[str, Any]]:
    """Every rank's begin of step 5 at once, started in ``order``, each on its node."""
    replies: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()

    def one(rank: int) -> None:
        replies.put((rank, job.begin(5, rank, run=run)))

    threads = [threading.Thread(target=one, args=(r,)) for r in order]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE)
    return dict(replies.get(timeout=1) for _ in threads)


class TestAcrossNodes:
    """Across nodes the leader supersedes; the other node learns it, then joins the new attempt."""

    @pytest.mark.parametrize("first", ["follower", "leader"])
    def test_the_restarted_job_saves_the_step_at_once(
        self,
        cluster: Callable[..., Job],  # noqa: F811 - the fixture imported above
        first: str,
    ) -> None:
        job = cluster(2, 1, "--lease", "300")
        dead = _begin_all(job, DEAD, [1, 0])
        assert all(r["ok"] for r in dead.values()), dead
        old = dead[0]["attempt"]
        assert old == dead[1]["attempt"]
        got = _begin_all(job, RESTARTED, [1, 0] if first == "follower" else [0, 1])
        assert all(r["ok"] for r in got.values()), got
        assert got[0]["attempt"] == got[1]["attempt"] != old
        for node in (0, 1):
            job.daemons[node].wait_event(
                "checkpoint.failed",
                match=lambda e: e["attempt"] == old and "superseded by run" in e["reason"],
            )
        assert all(job.write_and_done(5, r)["ok"] for r in (0, 1))
        for node in (0, 1):
            assert job.wait(node, 5)["state"] == "promoted"

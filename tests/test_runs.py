"""Runs of a job: every begin names its run, and no run joins another run's attempt.

A requeued or restarted job is another run. Its ranks name it without asking a daemon
(``orchestrator._run``), the attempt marker records it, the ledger never lets a begin of
one run join the attempt of another, and a node whose state was lost joins only a
marker of its own run (``tests/test_multinode_requeue.py`` on simulated nodes).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from daemon.base._errors import RequestError
from daemon.config._config import RootConfig
from daemon.ledger._ledger import Ledger, SaveKey
from daemon.ledger._records import JBegin
from daemon.store._attempts import prepare
from daemon.store._markers import write_verdict
from orchestrator import CheckpointClient
from orchestrator._run import run_identity
from orchestrator.protocol import ATTEMPT_MARKER, ErrorCode, SaveState
from tests.conftest import DaemonProcess, LineClient

KEY = SaveKey("/ckpt/run-42", 5)


class TestRunIdentity:
    """The run comes from an explicit id, else torchelastic's, else Slurm's environment."""

    def test_explicit_wins(self) -> None:
        env = {"TORCHELASTIC_RUN_ID": "abc", "SLURM_JOB_ID": "77"}
        assert run_identity("mine-1", env) == "mine-1"

    def test_torchelastic_with_its_restart_count(self) -> None:
        env = {"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "2"}
        assert run_identity(None, env) == "torchelastic:abc:2"
        assert run_identity(None, {**env, "SLURM_JOB_ID": "77"}) == "torchelastic:abc:2"

    def test_slurm_requeue_is_another_run(self) -> None:
        first = run_identity(None, {"SLURM_JOB_ID": "77"})
        again = run_identity(None, {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"})
        assert first == "slurm:77:0" and again == "slurm:77:1"

    def test_none_without_a_source(self) -> None:
        assert run_identity(None, {}) is None

    def test_torchruns_default_id_names_no_run(self) -> None:
        # A static rendezvous across nodes without --rdzv-id: "none" at every launch.
        env = {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0"}
        assert run_identity(None, env) is None
        assert run_identity(None, {**env, "SLURM_JOB_ID": "77"}) == "slurm:77:0"

    def test_an_id_that_does_not_fit_becomes_its_digest(self) -> None:
        env = {"TORCHELASTIC_RUN_ID": "a run / with spaces"}
        found = run_identity(None, env)
        assert found is not None and found.startswith("torchelastic:sha256-")
        assert found.endswith(":0")  # the restart count stays comparable
        assert run_identity(None, {"SLURM_JOB_ID": "j" * 200}) is not None
        assert found == run_identity(None, dict(env))  # the same on every rank

    def test_a_bad_explicit_id_is_refused(self) -> None:
        with pytest.raises(ValueError, match="run 'no spaces'"):
            run_identity("no spaces", {})


class TestLedgerRuns:
    """A begin of another run never joins the step's attempt."""

    def test_another_runs_begin_is_refused_while_the_attempt_is_open(self) -> None:
        ledger = Ledger(lease=10.0, save_timeout=None)
        ledger.begin(KEY, 0, 2, 1, 0.0, fresh="a1", run="job:1")
        with pytest.raises(RequestError) as caught:
            ledger.begin(KEY, 1, 2, 2, 1.0, fresh="a2", run="job:2")
        assert caught.value.code is ErrorCode.RUN_CONFLICT
        assert "job:1" in str(caught.value) and "job:2" in str(caught.value)
        save = ledger.get(KEY)
        assert save is not None and sorted(save.ranks) == [0] and save.attempt == "a1"

    def test_the_same_run_joins(self) -> None:
        ledger = Ledger(lease=10.0, save_timeout=None)
        ledger.begin(KEY, 0, 2, 1, 0.0, fresh="a1", run="job:1")
        ledger.begin(KEY, 1, 2, 2, 1.0, fresh="a2", run="job:1")
        save = ledger.get(KEY)
        assert save is not None and sorted(save.ranks) == [0, 1] and save.attempt == "a1"

    def test_another_run_starts_a_failed_step_over(self) -> None:
        ledger = Ledger(lease=10.0, save_timeout=None)
        ledger.begin(KEY, 0, 2, 1, 0.0, fresh="a1", run="job:1")
        ledger.fail(KEY, 0, "disk full", 1.0)
        # On the failed attempt's own connection: only another run may start it over.
        assert not ledger.starts_new_attempt(KEY, 1, run="job:1")
        assert ledger.starts_new_attempt(KEY, 1, run="job:2")
        ledger.begin(KEY, 0, 2, 1, 2.0, fresh="a2", run="job:2")
        save = ledger.get(KEY)
        assert save is not None and save.attempt == "a2" and save.run == "job:2"
        assert save.state is SaveState.OPEN

    def test_the_run_is_journaled_and_replayed(self) -> None:
        ledger = Ledger(lease=10.0, save_timeout=None)
        ledger.begin(KEY, 0, 2, 1, 0.0, fresh="a1", run="job:1")
        records = ledger.drain_records()
        assert [r.run for r in records if isinstance(r, JBegin)] == ["job:1"]
        replayed = Ledger(lease=10.0, save_timeout=None)
        for record in records:
            replayed.replay(record, 0.0)
        save = replayed.get(KEY)
        assert save is not None and save.run == "job:1"
        assert [r.run for r in replayed.snapshot() if isinstance(r, JBegin)] == ["job:1"]

    def test_unnamed_runs_keep_todays_rule(self) -> None:
        ledger = Ledger(lease=10.0, save_timeout=None)
        ledger.begin(KEY, 0, 2, 1, 0.0, fresh="a1")
        ledger.begin(KEY, 1, 2, 2, 1.0, fresh="a2", run="job:2")  # joins: nothing says no
        save = ledger.get(KEY)
        assert save is not None and sorted(save.ranks) == [0, 1]


def _marker(root: Path, step: int) -> dict[str, object]:
    found: dict[str, object] = json.loads((root / f"tmp_step_{step}" / ATTEMPT_MARKER).read_text())
    return found


class TestTheMarkerRecordsTheRun:
    """The attempt marker in ``tmp_step_N`` says whose run the directory is."""

    def test_a_begin_on_the_wire(self, start: Callable[..., DaemonProcess], root: Path) -> None:
        daemon = start([root])
        with LineClient(daemon.socket_path) as conn:
            reply = conn.request(
                "begin", root=str(root), step=3, rank=0, world_size=1, run="slurm:77:1"
            )
            assert reply["ok"], reply
            assert _marker(root, 3)["run"] == "slurm:77:1"
            other = conn.request(  # another job's run (a requeue would supersede it)
                "begin", root=str(root), step=3, rank=0, world_size=1, run="slurm:78:0"
            )
            assert not other["ok"] and other["error"]["code"] == "run_conflict", other

    def test_the_client_names_its_run(
        self, start: Callable[..., DaemonProcess], root: Path
    ) -> None:
        daemon = start([root])
        with CheckpointClient(str(daemon.socket_path), run="torchelastic:x:0") as client:
            begun = client.begin(str(root), 4, 0, 1)
            assert begun.acknowledged
        assert _marker(root, 4)["run"] == "torchelastic:x:0"

    def test_a_run_the_protocol_cannot_carry_is_refused(self) -> None:
        with pytest.raises(ValueError, match="run"):
            CheckpointClient("/nonexistent.sock", run="has spaces")


class TestOnlyTheLeaderDecides:
    """Once a follower's ranks are all done, no timer of its own fails the step."""

    def test_a_followers_save_timeout_waits_for_the_leader(self) -> None:
        ledger = Ledger(lease=5.0, save_timeout=20.0)
        for rank in (2, 3):  # this node: ranks 2 and 3 of 4, rank 0 elsewhere
            ledger.begin(KEY, rank, 4, rank, 0.0, fresh="a1", local_world_size=2)
            ledger.done(KEY, rank, [], rank, 1.0)
        ledger.node_marked(KEY, 1.5)
        assert ledger.tick(25.0) == []
        save = ledger.get(KEY)
        assert save is not None and save.state is SaveState.OPEN and not save.leader

    def test_a_follower_still_writing_times_out(self) -> None:
        ledger = Ledger(lease=5.0, save_timeout=20.0)
        for rank in (2, 3):
            ledger.begin(KEY, rank, 4, rank, 0.0, fresh="a1", local_world_size=2)
        ledger.done(KEY, 2, [], 2, 1.0)
        assert ledger.tick(25.0)
        save = ledger.get(KEY)
        assert save is not None and save.state is SaveState.FAILED
        assert save.reason is not None and "ranks not done: 0-1,3" in save.reason


def _spanning_dir(root: Path, step: int, run: str) -> None:
    """``tmp_step_N`` as a save spanning nodes leaves it: its attempt, another node's marker."""
    tmp = root / f"tmp_step_{step}"
    tmp.mkdir()
    marker = {"attempt": "span1", "root": str(root), "step": step, "world_size": 4}
    (tmp / ATTEMPT_MARKER).write_text(json.dumps({**marker, "created": "", "run": run}))
    (tmp / ".ckptd-node-n1.json").write_text("{}")


class TestSingleNodeBeginOnASpanningDirectory:
    """A begin without local_world_size never sets a spanning attempt aside as in the way."""

    def test_refused_naming_local_world_size(
        self, start: Callable[..., DaemonProcess], root: Path
    ) -> None:
        daemon = start([root])
        _spanning_dir(root, 5, "job:1")
        _spanning_dir(root, 6, "")
        with LineClient(daemon.socket_path) as conn:
            for step, run in ((5, {"run": "job:1"}), (6, {})):
                reply = conn.request(
                    "begin", root=str(root), step=step, rank=1, world_size=4, **run
                )
                assert not reply["ok"] and reply["error"]["code"] == "node_conflict", reply
                assert "local_world_size" in reply["error"]["message"]
                assert (root / f"tmp_step_{step}" / ".ckptd-node-n1.json").exists()

    def test_another_runs_directory_is_set_aside(
        self, start: Callable[..., DaemonProcess], root: Path
    ) -> None:
        daemon = start([root])
        _spanning_dir(root, 5, "job:1")
        with LineClient(daemon.socket_path) as conn:
            reply = conn.request("begin", root=str(root), step=5, rank=0, world_size=1, run="job:2")
            assert reply["ok"], reply
        assert _marker(root, 5)["run"] == "job:2"
        assert not (root / "tmp_step_5" / ".ckptd-node-n1.json").exists()


class TestAFreshDaemonAndTheRoot:
    """A daemon that lost its state takes a re-sent begin's attempt over only if it lives."""

    def _attempt_on_root(self, root: Path, *, failed: bool) -> str:
        config = RootConfig(path=str(root), real=str(root))
        prepare(config, 5, "a1", 4, run="job:1")
        if failed:
            write_verdict(config, 5, "a1", "n0", "node n1: disk full")
        return "a1"

    @pytest.mark.parametrize("failed", [False, True])
    def test_a_resent_spanning_begin(
        self, start: Callable[..., DaemonProcess], root: Path, failed: bool
    ) -> None:
        attempt = self._attempt_on_root(root, failed=failed)
        daemon = start([root])
        with LineClient(daemon.socket_path) as conn:
            reply = conn.request(
                "begin", root=str(root), step=5, rank=2, world_size=4, local_world_size=2,
                resent=True, attempt=attempt, run="job:1",
            )  # fmt: skip
        if failed:  # the leader's verdict failed it: nobody's to take over
            assert not reply["ok"] and reply["error"]["code"] == "step_failed", reply
        else:
            assert reply["ok"] and reply["attempt"] == attempt, reply
        assert (root / "tmp_step_5" / ATTEMPT_MARKER).is_file()  # nothing moved either way

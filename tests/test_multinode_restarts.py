"""Node daemons killed, restarted, gone for good and stopped in the middle of spanning saves.

Simulated nodes as in ``tests/test_multinode.py``. A daemon is stopped exactly where the
test wants it by hanging its node's mount first (SIGSTOP to that node's bindfs): its
calls on the shared directory block, so it can be SIGKILLed with its ranks' ``done``
journaled but its marker unwritten, or, the leader, with every marker down but nothing
promoted.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from tests._node_jobs import (
    NODE_TIMEOUT,
    Job,
    events,
    manifest,
    marked,
    marker,
    settles_everywhere,
    the_daemon,
    three,
)
from tests._nodes import Cluster, SimNode, make_cluster

pytestmark = pytest.mark.waits

__all__ = ["make_cluster", "three"]  # the fixtures, imported for pytest

MakeCluster = Callable[..., Cluster]


class TestFollowerRestart:
    """A follower SIGKILLed after its ranks' done finishes its marker once restarted."""

    def test_killed_before_its_marker(self, three: tuple[Cluster, Job]) -> None:
        nodes, job = three
        follower = nodes[1]
        job.begin(1)
        job.save(1, job.on(nodes[0]) + job.on(nodes[2]))
        ranks = job.on(follower)
        entries = [r.write(1) for r in ranks]
        assert ranks[0].done(1, entries[0])["ok"]
        # Its mount hangs: the daemon journals the last done but cannot write the marker.
        follower.freeze()
        ranks[1].conn.send_raw(
            json.dumps(
                {
                    "op": "done",
                    "id": 999,
                    "root": str(nodes.root),
                    "step": 1,
                    "rank": ranks[1].rank,
                    "files": entries[1],
                    "attempt": ranks[1].attempts[1],
                }
            ).encode()
            + b"\n"
        )
        the_daemon(follower).wait_event(
            "save.rank_done", 30.0, match=lambda e: e.get("rank") == ranks[1].rank
        )
        follower.kill_daemon(signal.SIGKILL)
        follower.thaw()
        assert marker(nodes.backing_root, 1, "n1") is None or (
            (marker(nodes.backing_root, 1, "n1") or {}).get("state") != "done"
        )
        follower.restart_daemon()
        marked(nodes.backing_root, 1, "n1")
        settles_everywhere(nodes, 1, "promoted")
        got = marker_files(nodes.backing_root / "step_1", "n1")
        assert got == {str(r.rank) for r in ranks}, got

    @pytest.mark.parametrize("wipe", [False, True], ids=["journal", "empty-state-dir"])
    def test_killed_right_after_done(self, three: tuple[Cluster, Job], wipe: bool) -> None:
        nodes, job = three
        job.begin(1)
        job.save(1)
        nodes[2].kill_daemon(signal.SIGKILL)
        nodes[2].restart_daemon(wipe=wipe)
        if wipe:  # its ranks' done were in the journal only: they re-send, as clients do
            for rank in job.on(nodes[2]):
                rank.reconnect()
                assert rank.begin(1, resent=True, attempt=rank.attempts[1])["ok"]
                assert rank.done(1, [{"path": f"rank{rank.rank}.bin", "size": 64}])["ok"]
        settles_everywhere(nodes, 1, "promoted")


def marker_files(step_dir: Path, node: str) -> set[str]:
    """The ranks a node marker carried into the promoted step (none if it is not there)."""
    try:
        found = json.loads((step_dir / f".ckptd-node-{node}.json").read_text())
    except FileNotFoundError:
        return set()
    return set(found.get("files", {}))


class TestLeaderRestart:
    """The leader SIGKILLed before it promotes finishes the promotion exactly once."""

    @pytest.mark.parametrize("wipe", [False, True], ids=["journal", "empty-state-dir"])
    def test_killed_with_every_marker_down(self, three: tuple[Cluster, Job], wipe: bool) -> None:
        # With an empty state directory (a requeued job's node) the root decides: every
        # node's marker is done and this node holds rank 0, so it promotes as before.
        nodes, job = three
        leader = nodes[0]
        back = nodes.backing_root
        (attempt,) = {r["attempt"] for r in job.begin(1)}
        job.save(1, job.on(leader))
        marked(back, 1, "n0")
        leader.freeze()  # it cannot look at the others' markers, nor rename
        job.save(1, job.on(nodes[1]) + job.on(nodes[2]))
        for name in ("n1", "n2"):
            marked(back, 1, name)
        killed = the_daemon(leader)
        leader.kill_daemon(signal.SIGKILL)
        leader.thaw()
        assert not events(killed, "checkpoint.promoted", 1)
        assert not (back / "step_1").exists()
        restarted = leader.restart_daemon(wipe=wipe)
        answers = settles_everywhere(nodes, 1, "promoted")
        assert answers[0]["path"] == str(nodes.root / "step_1")
        assert manifest(back, 1)["attempt"] == attempt
        assert os.readlink(back / "latest") == "step_1"
        # Exactly once: one promotion event, one step directory, nothing else made of it.
        assert len(events(restarted, "checkpoint.promoted", 1)) == 1
        assert sorted(p.name for p in back.iterdir() if "step_1" in p.name) == ["step_1"]
        trash = back / ".ckptd-trash"
        assert not trash.exists() or not [p for p in trash.iterdir() if "step_1" in p.name]

    @pytest.mark.parametrize("wipe", [False, True], ids=["journal", "empty-state-dir"])
    def test_killed_right_after_the_last_done(self, three: tuple[Cluster, Job], wipe: bool) -> None:
        nodes, job = three
        job.begin(1)
        job.save(1)
        killed = the_daemon(nodes[0])
        nodes[0].kill_daemon(signal.SIGKILL)
        restarted = nodes[0].restart_daemon(wipe=wipe)
        settles_everywhere(nodes, 1, "promoted")
        promoted = events(killed, "checkpoint.promoted", 1)
        promoted += events(restarted, "checkpoint.promoted", 1)
        assert len(promoted) == 1, promoted
        for rank in job.on(nodes[0]):
            rank.reconnect()
        job.begin(2)
        job.save(2)
        settles_everywhere(nodes, 2, "promoted")


def dcp_part(tmp: Path, part: str) -> list[dict[str, Any]]:
    """A real DCP checkpoint of a small state in ``tmp/part``; its files as ``done`` lists them."""
    state = {"weight": torch.arange(64, dtype=torch.float32)}
    dcp_save(state, checkpoint_id=str(tmp / part), no_dist=True)
    return [
        {"path": str(p.relative_to(tmp)), "size": p.stat().st_size}
        for p in sorted((tmp / part).iterdir())
    ]


class TestPromoteWithoutLeader:
    """With the leader's node gone, ``ckptd promote`` on another node finishes from markers."""

    def _leader_gone(self, nodes: Cluster, job: Job, done_nodes: list[SimNode]) -> None:
        back = nodes.backing_root
        leader = nodes[0]
        job.begin(1)
        # The step holds a real DCP directory (rank 0 its coordinator): .metadata and
        # the shard sizes it records are what a rescue checks besides the markers.
        first, second = job.on(leader)
        files = dcp_part(back / "tmp_step_1", "model")
        assert first.done(1, files + first.write(1))["ok"]
        assert second.save(1)["ok"]
        marked(back, 1, "n0")
        leader.freeze()
        for node in done_nodes:
            job.save(1, job.on(node))
            marked(back, 1, node.name)
        leader.kill_daemon(signal.SIGKILL)
        leader.thaw()

    def promote(self, node: SimNode, root: Path) -> tuple[int, str]:
        cmd = [sys.executable, "-m", "daemon", "promote", str(root), "1"]
        done = node.run([*cmd, "--socket", str(node.socket)], timeout=120)
        return done.returncode, done.stdout + done.stderr

    def test_promotes_from_complete_markers(self, three: tuple[Cluster, Job]) -> None:
        nodes, job = three
        self._leader_gone(nodes, job, [nodes[1], nodes[2]])
        code, out = self.promote(nodes[1], nodes.root)
        assert code == 0, out
        assert (nodes.backing_root / "step_1").is_dir()
        answer = nodes[2].wait(nodes.root, 1, 30.0)
        assert answer["state"] == "promoted", answer
        assert nodes[1].wait(nodes.root, 1, 30.0)["state"] == "promoted"
        step_dir = nodes.backing_root / "step_1"
        assert sorted(p.name for p in step_dir.glob("rank*.bin")) == [
            f"rank{r}.bin" for r in range(6)
        ]
        assert (step_dir / "model" / ".metadata").is_file()

    def test_refuses_naming_what_is_missing(self, three: tuple[Cluster, Job]) -> None:
        nodes, job = three
        self._leader_gone(nodes, job, [nodes[1]])
        code, out = self.promote(nodes[1], nodes.root)
        assert code != 0, out
        assert "4-5" in out or "n2" in out, out
        assert not (nodes.backing_root / "step_1").exists()
        assert (nodes.backing_root / "tmp_step_1" / "rank0.bin").exists()  # nothing lost


class TestStopDuringAHungLook:
    """A leader stopped while its look at the markers hangs stops once the look is done."""

    def test_sigterm_while_the_shared_mount_hangs(self, make_cluster: MakeCluster) -> None:
        nodes = make_cluster(3)
        nodes.start_daemons(settings={"node_timeout": NODE_TIMEOUT, "fs_stall_after": 0.5})
        job = Job(list(nodes), nodes.root, 2)
        try:
            leader = nodes[0]
            daemon = the_daemon(leader)
            job.begin(1)
            job.save(1, job.on(leader))
            marked(nodes.backing_root, 1, "n0")  # the leader now looks for the others'
            leader.freeze()
            daemon.wait_event("root.stalled", 30.0)  # a look is stuck on the mount
            assert daemon.proc is not None
            daemon.proc.send_signal(signal.SIGTERM)
            daemon.wait_event("daemon.stopping", 30.0)
            # Meanwhile the other nodes finish: the hung look, once answered, finds them
            # and takes their markers into the journal (which must still be running).
            job.save(1, job.on(nodes[1]) + job.on(nodes[2]))
            marked(nodes.backing_root, 1, "n1")
            marked(nodes.backing_root, 1, "n2")
            leader.thaw()
            # It stops by itself: with the journal stopped under the look's commit, it
            # would wait for ever.
            assert daemon.proc.wait(30.0) == 0
            daemon.wait_event("daemon.stopped", 5.0)
            # The look took every marker: the step was promoted before it stopped, or
            # is once it is restarted, from what it journaled and the markers.
            leader.restart_daemon()
            answers = [node.wait(nodes.root, 1, 30.0) for node in nodes]
            assert [a.get("state") for a in answers] == ["promoted"] * 3, answers
        finally:
            job.close()


class TestShutdown:
    """Every node's daemon stops on SIGTERM once its spanning saves have settled."""

    @pytest.fixture(params=["poll", "inotify"])
    def watched(
        self, request: pytest.FixtureRequest, make_cluster: MakeCluster
    ) -> Iterator[tuple[Cluster, Job]]:
        """Three nodes of 2 ranks, the root watched as ``watch`` says."""
        nodes = make_cluster(3)
        settings = {"node_timeout": NODE_TIMEOUT}
        nodes.start_daemons(settings=settings, root_settings={"watch": request.param})
        job = Job(list(nodes), nodes.root, 2)
        try:
            yield nodes, job
        finally:
            job.close()

    def test_sigterm_after_a_promoted_step(self, watched: tuple[Cluster, Job]) -> None:
        nodes, job = watched
        job.begin(1)
        job.save(1)
        settles_everywhere(nodes, 1, "promoted")
        job.close()
        _stop_all(nodes)

    def test_sigterm_after_the_leader_marked_first(self, watched: tuple[Cluster, Job]) -> None:
        nodes, job = watched
        job.begin(1)
        job.save(1, job.on(nodes[0]))
        marked(nodes.backing_root, 1, "n0")  # the leader waits for the others' markers
        job.save(1, job.on(nodes[1]) + job.on(nodes[2]))
        settles_everywhere(nodes, 1, "promoted")
        job.close()
        _stop_all(nodes)

    def test_followers_learn_unasked_then_stop(self, watched: tuple[Cluster, Job]) -> None:
        nodes, job = watched
        job.begin(1)
        job.save(1, job.on(nodes[0]))
        marked(nodes.backing_root, 1, "n0")
        job.save(1, job.on(nodes[1]) + job.on(nodes[2]))
        job.close()
        # No wait is asked of anyone: each node's own stdout says the step is promoted.
        for node in nodes:
            the_daemon(node).wait_event(
                "checkpoint.promoted", 20.0, match=lambda e: e.get("step") == 1
            )
        for node in reversed(list(nodes)):
            code = the_daemon(node).stop(signal.SIGTERM, timeout=20.0)
            assert code == 0, (node.name, code)

    def test_sigterm_while_a_follower_waits_for_the_outcome(
        self, watched: tuple[Cluster, Job]
    ) -> None:
        nodes, job = watched
        job.begin(1)
        job.save(1, job.on(nodes[0]) + job.on(nodes[1]))
        marked(nodes.backing_root, 1, "n1")  # n1 now follows the step's outcome
        code = the_daemon(nodes[1]).stop(signal.SIGTERM, timeout=20.0)
        assert code == 0, code
        nodes[1].restart_daemon()
        job.save(1, job.on(nodes[2]))
        settles_everywhere(nodes, 1, "promoted")


def _stop_all(nodes: Cluster) -> None:
    """SIGTERM every node's daemon, followers first; each must exit 0 within 20 s."""
    for node in reversed(list(nodes)):
        code = the_daemon(node).stop(signal.SIGTERM, timeout=20.0)
        assert code == 0, (node.name, code)

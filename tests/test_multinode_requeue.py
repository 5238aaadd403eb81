"""A requeued run on fresh state directories never takes the run it replaced for its own.

Two simulated nodes (bindfs with 1 s caching, one mount namespace each), two ranks a
node. Run 1 is preempted mid-save of step 5: node 1's marker is ``done``, rank 0 is done,
rank 1 never is. Every daemon is stopped within the lease (so no verdict is written) and
its state directory wiped, as a Slurm prolog or a k8s ``emptyDir`` does. Run 2, on fresh
daemons, saves step 5 again. Its ranks name their run (``begin``'s ``run``); the old
run's marker and files are never joined or counted, whatever order the ranks begin in.
And once a node's ranks are done, only the leader decides: a follower's own save_timeout
never fails the step (nor rewrites its done marker) while the leader has yet to.
"""

from __future__ import annotations

import json
import shutil
import signal
import threading
from collections.abc import Callable
from typing import Any

import pytest

from tests._node_jobs import NODE_TIMEOUT, SETTLE, Job, manifest, marked, settles_everywhere
from tests._nodes import Cluster, make_cluster

pytestmark = pytest.mark.waits

__all__ = ["make_cluster"]  # the fixture, imported for pytest

MakeCluster = Callable[..., Cluster]
OLD, NEW = "job:1", "job:2"


def preempted_run(nodes: Cluster) -> str:
    """Run 1 of the job, preempted mid-save of step 5; its attempt."""
    old = Job(list(nodes), nodes.root, 2)
    try:
        replies = [r.begin(5, run=OLD) for r in old.ranks]
        assert all(r["ok"] for r in replies), replies
        for rank in old.on(nodes[1]):
            assert rank.save(5)["ok"]
        marked(nodes.backing_root, 5, nodes[1].name)
        assert old.ranks[0].save(5)["ok"]  # rank 1 never finishes
    finally:
        old.close()
    for node in nodes:  # preempted within the lease: no verdict; the state is wiped
        node.kill_daemon(signal.SIGTERM)
        shutil.rmtree(node.state_dir, ignore_errors=True)
        node.restart_daemon()
    attempt: str = replies[0]["attempt"]
    return attempt


def begin_later(rank: Any, step: int) -> tuple[threading.Thread, list[dict[str, Any]]]:
    """``begin`` from ``rank`` in a thread (it may wait for the leader's marker)."""
    reply: list[dict[str, Any]] = []
    thread = threading.Thread(target=lambda: reply.append(rank.begin(step, run=NEW)))
    thread.start()
    return thread, reply


def run_two_finishes(nodes: Cluster, new: Job, attempt: str) -> None:
    """Run 2's ranks, all begun in ``attempt``, write; only all of them promote step 5."""
    back = nodes.backing_root
    for rank in new.on(nodes[0]):
        assert rank.save(5, 128)["ok"]
    answer = nodes[0].wait(nodes.root, 5, SETTLE)
    assert answer["state"] == "pending", answer  # node 1's old done marker is not counted
    assert not (back / "step_5").exists()
    for rank in new.on(nodes[1]):
        assert rank.save(5, 128)["ok"]
    settles_everywhere(nodes, 5, "promoted")
    found = manifest(back, 5)
    assert found["attempt"] == attempt
    sizes = {path: size for path, size in found["files"].items() if path.startswith("rank")}
    assert sizes == {f"rank{r}.bin": 128 for r in range(4)}, sizes  # run 2's files only


class TestRequeueOnFreshDaemons:
    """Run 2 joins only its own attempt; run 1's directory is set aside, never promoted."""

    def test_the_leaders_other_rank_begins_first(self, make_cluster: MakeCluster) -> None:
        nodes = make_cluster(2)
        nodes.start_daemons(settings={"node_timeout": NODE_TIMEOUT})
        old_attempt = preempted_run(nodes)
        new = Job(list(nodes), nodes.root, 2)
        try:
            # Local rank 1 first, as at 8 ranks a node: it must not join run 1's marker.
            waiting, reply = begin_later(new.ranks[1], 5)
            waiting.join(SETTLE)
            assert waiting.is_alive(), f"rank 1 joined before the leader marked run 2: {reply}"
            leader = new.ranks[0].begin(5, run=NEW)
            assert leader["ok"], leader
            waiting.join(30)
            assert reply and reply[0]["ok"], reply
            rest = [r.begin(5, run=NEW) for r in new.on(nodes[1])]
            attempts = {leader["attempt"], reply[0]["attempt"], *(r["attempt"] for r in rest)}
            assert attempts == {leader["attempt"]} and leader["attempt"] != old_attempt
            run_two_finishes(nodes, new, leader["attempt"])
        finally:
            new.close()

    def test_the_other_nodes_ranks_begin_first(self, make_cluster: MakeCluster) -> None:
        nodes = make_cluster(2)
        nodes.start_daemons(settings={"node_timeout": NODE_TIMEOUT})
        old_attempt = preempted_run(nodes)
        new = Job(list(nodes), nodes.root, 2)
        try:
            first = [begin_later(r, 5) for r in new.on(nodes[1])]
            for thread, reply in first:
                thread.join(SETTLE)
                assert thread.is_alive(), f"node 1 joined run 1's attempt: {reply}"
            replies = [r.begin(5, run=NEW) for r in new.on(nodes[0])]
            for thread, _ in first:
                thread.join(30)
            replies += [reply[0] for _, reply in first]
            assert all(r["ok"] for r in replies), replies
            (attempt,) = {r["attempt"] for r in replies}
            assert attempt != old_attempt
            run_two_finishes(nodes, new, attempt)
        finally:
            new.close()

    def test_rank_zero_first_promotes_without_waiting_out_node_timeout(
        self, make_cluster: MakeCluster
    ) -> None:
        nodes = make_cluster(2)
        nodes.start_daemons(settings={"node_timeout": NODE_TIMEOUT})
        old_attempt = preempted_run(nodes)
        new = Job(list(nodes), nodes.root, 2)
        try:
            replies = [r.begin(5, run=NEW) for r in new.ranks]
            assert all(r["ok"] for r in replies), replies
            (attempt,) = {r["attempt"] for r in replies}
            assert attempt != old_attempt
            run_two_finishes(nodes, new, attempt)
        finally:
            new.close()


class TestOnlyTheLeaderDecides:
    """A follower whose ranks are done waits out its save_timeout for the leader's word."""

    def test_a_followers_save_timeout_while_the_leader_gathers(
        self, make_cluster: MakeCluster
    ) -> None:
        timeout = 4.0
        nodes = make_cluster(2)
        for node, save_timeout in zip(nodes, (NODE_TIMEOUT, timeout), strict=True):
            settings = {"node_timeout": NODE_TIMEOUT, "save_timeout": save_timeout}
            node.start_daemon([nodes.root], settings=settings)
        job = Job(list(nodes), nodes.root, 2)
        back = nodes.backing_root
        try:
            job.begin(7)
            for rank in job.on(nodes[1]):
                assert rank.save(7)["ok"]
            marked(back, 7, nodes[1].name)
            leaders = job.on(nodes[0])
            files = [rank.write(7) for rank in leaders]
            nodes[0].freeze()  # the leader cannot read the follower's marker yet
            sent = []
            try:
                for rank, listed in zip(leaders, files, strict=True):
                    thread = threading.Thread(target=rank.done, args=(7, listed))
                    thread.start()
                    sent.append(thread)
                # Past the follower's save_timeout, while the leader still gathers.
                answer = nodes[1].wait(nodes.root, 7, timeout + SETTLE)
                assert answer["state"] == "pending", answer
            finally:
                nodes[0].thaw()
            for thread in sent:
                thread.join(30)
            settles_everywhere(nodes, 7, "promoted")
            inside = json.loads((back / "step_7" / f".ckptd-node-{nodes[1].name}.json").read_text())
            assert inside["state"] == "done", inside  # never rewritten to failed
        finally:
            job.close()

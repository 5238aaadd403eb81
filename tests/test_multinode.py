"""One checkpoint across several nodes, promoted from the evidence on the shared filesystem.

Every test runs simulated nodes (``tests/_nodes.py``): a mount namespace each, with the
shared root mounted through bindfs with 1 s lookup and attribute caching, and a real
``ckptd serve --node nI`` inside each. Protocol-level ranks speak the wire protocol to
their own node's daemon; node 0 holds global rank 0, so its daemon leads. What is read
of the outcome is read from every node: its ``wait`` answer and its own stdout events.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests._node_jobs import (
    SETTLE,
    Job,
    Rank,
    events,
    manifest,
    marked,
    marker,
    settles_everywhere,
    the_daemon,
    three,
)
from tests._nodes import Cluster, make_cluster

pytestmark = pytest.mark.waits

__all__ = ["make_cluster", "three"]  # the fixtures, imported for pytest

MakeCluster = Callable[..., Cluster]


class TestGating:
    """A spanning step is promoted only once every node's ranks are done, and every node says so."""

    def test_promoted_only_when_every_node_is_done(self, three: tuple[Cluster, Job]) -> None:
        nodes, job = three
        back = nodes.backing_root
        replies = job.begin(1)
        attempts = {r["attempt"] for r in replies}
        assert len(attempts) == 1, f"the nodes' ranks joined different attempts: {replies}"
        (attempt,) = attempts
        job.save(1, job.on(nodes[0]) + job.on(nodes[1]))
        job.save(1, job.on(nodes[2])[:1])  # one of node 2's two ranks is done
        for name in ("n0", "n1"):
            marked(back, 1, name)
        assert (marker(back, 1, "n0") or {})["attempt"] == attempt
        assert (marker(back, 1, "n2") or {}).get("state") != "done"
        pending = nodes[0].wait(nodes.root, 1, SETTLE)
        assert pending["state"] == "pending", pending
        assert not (back / "step_1").exists()
        job.save(1, job.on(nodes[2])[1:])
        answers = settles_everywhere(nodes, 1, "promoted")
        assert {a["path"] for a in answers} == {str(nodes.root / "step_1")}
        assert sorted(p.name for p in (back / "step_1").glob("rank*.bin")) == [
            f"rank{r}.bin" for r in range(6)
        ]
        assert manifest(back, 1)["attempt"] == attempt
        assert os.readlink(back / "latest") == "step_1"
        assert not (back / "tmp_step_1").exists()
        for node in nodes:  # every node's latest reads the pointer through its own mount
            latest = node.request("latest", root=str(nodes.root))
            assert latest["ok"] and latest["step"] == 1, (node.name, latest)
        assert len(events(the_daemon(nodes[0]), "checkpoint.promoted", 1)) == 1

    def test_several_steps_in_a_row(self, three: tuple[Cluster, Job]) -> None:
        nodes, job = three
        for step in (1, 2, 3):
            job.begin(step)
            job.save(step)
        for step in (1, 2, 3):
            settles_everywhere(nodes, step, "promoted")
        assert os.readlink(nodes.backing_root / "latest") == "step_3"


class TestRankFailure:
    """A rank failing on one node fails the step on every node; the next step promotes."""

    def test_fail_on_a_follower(self, three: tuple[Cluster, Job]) -> None:
        nodes, job = three
        job.begin(1)
        job.save(1, job.on(nodes[0]) + job.on(nodes[2]))
        failing = job.on(nodes[1])[0]
        assert failing.fail(1, "CUDA OOM in async_save")["ok"]
        answers = settles_everywhere(nodes, 1, "failed")
        for answer in answers:
            assert "CUDA OOM" in answer["reason"], answer
            assert str(failing.rank) in answer["reason"], answer
        assert not (nodes.backing_root / "step_1").exists()
        late = job.on(nodes[1])[1].save(1)  # the failed node's other rank, too late
        assert not late["ok"] and late["error"]["code"] == "step_failed", late
        job.begin(2)
        job.save(2)
        settles_everywhere(nodes, 2, "promoted")
        assert os.readlink(nodes.backing_root / "latest") == "step_2"

    def test_fail_on_the_leader(self, three: tuple[Cluster, Job]) -> None:
        nodes, job = three
        job.begin(1)
        job.save(1, job.on(nodes[1]) + job.on(nodes[2]))
        assert job.on(nodes[0])[1].fail(1, "disk full")["ok"]
        for answer in settles_everywhere(nodes, 1, "failed"):
            assert "disk full" in answer["reason"], answer
        job.begin(2)
        job.save(2)
        settles_everywhere(nodes, 2, "promoted")


class TestMissingNode:
    """Nodes missing past node_timeout fail the step, naming the missing ranks and nodes."""

    def test_node_never_done(self, make_cluster: MakeCluster) -> None:
        nodes = make_cluster(3)
        nodes.start_daemons(settings={"node_timeout": 2.0})
        job = Job(list(nodes), nodes.root, 2)
        try:
            job.begin(1)
            job.save(1, job.on(nodes[0]) + job.on(nodes[1]))
            # Node 2's ranks began (its daemon knows the attempt) but never finish.
            answers = [node.wait(nodes.root, 1, 60.0) for node in (nodes[0], nodes[1])]
            for node, answer in zip(nodes, answers, strict=False):
                assert answer["state"] == "failed", (node.name, answer)
                the_daemon(node).wait_event(
                    "checkpoint.failed", 10.0, match=lambda e: e.get("step") == 1
                )
            reason = answers[0]["reason"]
            assert "4-5" in reason, reason
            assert "n2" in reason, reason
            assert "node_timeout" in reason, reason
            assert answers[1]["reason"] == reason, answers[1]
            assert not (nodes.backing_root / "step_1").exists()
        finally:
            job.close()

    def test_the_node_still_writing_learns_the_failure(self, make_cluster: MakeCluster) -> None:
        nodes = make_cluster(3)
        nodes.start_daemons(settings={"node_timeout": 2.0})
        job = Job(list(nodes), nodes.root, 2)
        try:
            job.begin(1)
            job.save(1, job.on(nodes[0]) + job.on(nodes[1]))
            assert nodes[0].wait(nodes.root, 1, 60.0)["state"] == "failed"
            # The verdict is on the shared disk: a cache time and a poll later, node 2
            # (its two ranks still connected and writing) knows.
            answer = nodes[2].wait(nodes.root, 1, 15.0)
            assert answer["state"] == "failed", answer
            assert "4-5" in answer["reason"], answer
        finally:
            job.close()

    def test_node_never_began(self, make_cluster: MakeCluster) -> None:
        nodes = make_cluster(3)
        nodes.start_daemons(settings={"node_timeout": 2.0})
        job = Job(list(nodes), nodes.root, 2)
        try:
            job.begin(1, job.on(nodes[0]) + job.on(nodes[1]))
            job.save(1, job.on(nodes[0]) + job.on(nodes[1]))
            for node in nodes[0], nodes[1]:
                answer = node.wait(nodes.root, 1, 60.0)
                assert answer["state"] == "failed", (node.name, answer)
                assert "4-5" in answer["reason"], answer
        finally:
            job.close()


def zombie(root: Path, step: int, node: str, attempt: str, state: str, ranks: range) -> None:
    """Write a marker of another attempt into ``tmp_step_N`` as a late writer would."""
    body = {
        "format": "ckptd-node/1",
        "node": node,
        "attempt": attempt,
        "step": step,
        "world_size": 6,
        "local_world_size": len(ranks),
        "state": state,
        "files": {str(r): [{"path": f"rank{r}.bin", "size": 64}] for r in ranks}
        if state == "done"
        else {},
        "reason": "zombie" if state == "failed" else "",
        "written": "2026-01-01T00:00:00+00:00",
    }
    path = root / f"tmp_step_{step}" / f".ckptd-node-{node}.json"
    path.write_text(json.dumps(body))
    for r in ranks:
        (root / f"tmp_step_{step}" / f"rank{r}.bin").write_bytes(b"\0" * 64)


class TestZombieMarkers:
    """Markers of another attempt never count, for a promotion or for a failure."""

    def test_older_attempts_markers_ignored(self, three: tuple[Cluster, Job]) -> None:
        nodes, job = three
        back = nodes.backing_root
        (attempt,) = {r["attempt"] for r in job.begin(1)}
        # Node 1's ranks, and a node 9 (failed), as an older attempt left them.
        zombie(back, 1, "n1", "zombie-old-1", "done", range(2, 4))
        zombie(back, 1, "n9", "zombie-old-2", "failed", range(0))
        job.save(1, job.on(nodes[0]) + job.on(nodes[2]))
        for node in nodes:
            answer = node.wait(nodes.root, 1, SETTLE)
            assert answer["state"] == "pending", (node.name, answer)
        assert not (back / "step_1").exists()
        job.save(1, job.on(nodes[1]))
        settles_everywhere(nodes, 1, "promoted")
        assert manifest(back, 1)["attempt"] == attempt
        assert (json.loads((back / "step_1" / ".ckptd-node-n1.json").read_text()))[
            "attempt"
        ] == attempt


class TestContradictions:
    """Nodes that contradict each other fail the step on every node, naming the contradiction."""

    def test_two_nodes_claiming_one_rank(self, make_cluster: MakeCluster) -> None:
        nodes = make_cluster(2)
        nodes.start_daemons(settings={"node_timeout": 30.0})
        ranks = [
            Rank(nodes[0], nodes.root, 0, 4, 2),
            Rank(nodes[0], nodes.root, 1, 4, 2),
            Rank(nodes[1], nodes.root, 1, 4, 2),  # rank 1 again, on the other node
            Rank(nodes[1], nodes.root, 2, 4, 2),
        ]
        try:
            for r in ranks:
                assert r.begin(1)["ok"]
            for r in ranks:
                try:
                    r.save(1)  # refused or not: the step must fail either way
                except OSError as exc:
                    # The leader saw both claims in the writing markers and failed the
                    # step first: its directory was set aside before this rank wrote.
                    assert "FileNotFoundError" in str(exc), exc
            for answer in settles_everywhere(nodes, 1, "failed"):
                assert "rank 1" in answer["reason"], answer
            assert not (nodes.backing_root / "step_1").exists()
        finally:
            for r in ranks:
                r.close()

    def test_local_world_sizes_that_cannot_add_up(self, make_cluster: MakeCluster) -> None:
        nodes = make_cluster(2)
        nodes.start_daemons(settings={"node_timeout": 30.0})
        ranks = [
            Rank(nodes[0], nodes.root, 0, 4, 2),
            Rank(nodes[0], nodes.root, 1, 4, 2),
            Rank(nodes[1], nodes.root, 2, 4, 3),  # 2 + 3 ranks for a world of 4
        ]
        try:
            for r in ranks:
                assert r.begin(1)["ok"]
            for r in ranks[:2]:  # the leader's own ranks are done: it reads the others
                reply = r.save(1)
                # A look of the leader's may already have read node 1's writing marker
                # (it looks every 5 s while its ranks write): then the step failed first.
                assert reply["ok"] or reply["error"]["code"] == "step_failed", reply
            # The leader fails it; node 1, its rank still writing, learns it too.
            answer = nodes[0].wait(nodes.root, 1, 30.0)
            assert answer["state"] == "failed", answer
            assert "local world sizes cannot add up" in answer["reason"], answer
            other = nodes[1].wait(nodes.root, 1, 30.0)
            assert other["state"] == "failed", other
            the_daemon(nodes[0]).wait_event(
                "checkpoint.failed", 10.0, match=lambda e: e.get("step") == 1
            )
        finally:
            for r in ranks:
                r.close()

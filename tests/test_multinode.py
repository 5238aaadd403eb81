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
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from tests._nodes import Cluster, Job, SimNode, make_cluster, wait_until
from tests.conftest import DaemonProcess

__all__ = ["make_cluster"]  # the fixture, imported for pytest

MakeCluster = Callable[..., Cluster]

NODE_TIMEOUT = 60.0
"""node_timeout of the tests that do not wait for it: far beyond any test's length."""
SETTLE = 3.0
"""Seconds a bounded negative check waits: above the 1 s cache plus a 0.25 s poll, twice."""


def marker(root: Path, step: int, node: str) -> dict[str, Any] | None:
    """``node``'s marker in ``tmp_step_N``, read uncached from the backing directory."""
    try:
        text = (root / f"tmp_step_{step}" / f".ckptd-node-{node}.json").read_text()
    except FileNotFoundError:
        return None
    found: dict[str, Any] = json.loads(text)
    return found


def marked(root: Path, step: int, node: str, timeout: float = 30.0) -> dict[str, Any]:
    """``node``'s ``done`` marker, once it is in ``tmp_step_N`` (within ``timeout``)."""

    def done() -> dict[str, Any] | None:
        found = marker(root, step, node)
        return found if found is not None and found.get("state") == "done" else None

    found: dict[str, Any] = wait_until(done, timeout, f"{node}'s done marker of step {step}")
    return found


def manifest(root: Path, step: int) -> dict[str, Any]:
    """The promoted step's manifest, read uncached."""
    found: dict[str, Any] = json.loads((root / f"step_{step}" / ".ckptd-manifest.json").read_text())
    return found


def events(daemon: DaemonProcess, name: str, step: int) -> list[dict[str, Any]]:
    """Every ``name`` event for ``step`` the daemon printed so far."""
    return [e for e in daemon.drain() if e["event"] == name and e.get("step") == step]


def the_daemon(node: SimNode) -> DaemonProcess:
    """The node's running daemon."""
    assert node.daemon is not None
    return node.daemon


def settles_everywhere(
    nodes: Cluster, step: int, state: str, timeout: float = 30.0
) -> list[dict[str, Any]]:
    """Every node's ``wait`` answers ``state`` and its stdout says so; the answers."""
    answers = [node.wait(nodes.root, step, timeout) for node in nodes]
    for node, answer in zip(nodes, answers, strict=True):
        assert answer["ok"] and answer["state"] == state, (node.name, answer)
        event = f"checkpoint.{state}"
        the_daemon(node).wait_event(event, timeout, match=lambda e: e.get("step") == step)
    return answers


@pytest.fixture
def three(make_cluster: MakeCluster) -> Iterator[tuple[Cluster, Job]]:
    """Three nodes with daemons (node_timeout 60 s) and a job of 2 ranks on each."""
    nodes = make_cluster(3)
    nodes.start_daemons(settings={"node_timeout": NODE_TIMEOUT})
    job = Job(list(nodes), nodes.root, 2)
    try:
        yield nodes, job
    finally:
        job.close()


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
        assert len(events(the_daemon(nodes[0]), "checkpoint.promoted", 1)) <= 1

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

    @pytest.mark.xfail(
        strict=True,
        reason="a node whose ranks are still writing does not watch the shared directory "
        "(Watch comes only after its own marker), so it never learns the leader's "
        "node_timeout verdict while its ranks hang",
    )
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

    def test_killed_right_after_done(self, three: tuple[Cluster, Job]) -> None:
        nodes, job = three
        job.begin(1)
        job.save(1)
        nodes[2].kill_daemon(signal.SIGKILL)
        nodes[2].restart_daemon()
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

    def test_killed_with_every_marker_down(self, three: tuple[Cluster, Job]) -> None:
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
        restarted = leader.restart_daemon()
        answers = settles_everywhere(nodes, 1, "promoted")
        assert answers[0]["path"] == str(nodes.root / "step_1")
        assert manifest(back, 1)["attempt"] == attempt
        assert os.readlink(back / "latest") == "step_1"
        # Exactly once: one promotion event, one step directory, nothing else made of it.
        assert len(events(restarted, "checkpoint.promoted", 1)) == 1
        assert sorted(p.name for p in back.iterdir() if "step_1" in p.name) == ["step_1"]
        trash = back / ".ckptd-trash"
        assert not trash.exists() or not [p for p in trash.iterdir() if "step_1" in p.name]

    def test_killed_right_after_the_last_done(self, three: tuple[Cluster, Job]) -> None:
        nodes, job = three
        job.begin(1)
        job.save(1)
        killed = the_daemon(nodes[0])
        nodes[0].kill_daemon(signal.SIGKILL)
        restarted = nodes[0].restart_daemon()
        settles_everywhere(nodes, 1, "promoted")
        promoted = events(killed, "checkpoint.promoted", 1)
        promoted += events(restarted, "checkpoint.promoted", 1)
        assert len(promoted) == 1, promoted
        for rank in job.on(nodes[0]):
            rank.reconnect()
        job.begin(2)
        job.save(2)
        settles_everywhere(nodes, 2, "promoted")


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
        for node in reversed(list(nodes)):
            daemon = the_daemon(node)
            code = daemon.stop(signal.SIGTERM, timeout=20.0)
            assert code == 0, (node.name, code)

    def test_sigterm_after_the_leader_marked_first(self, watched: tuple[Cluster, Job]) -> None:
        nodes, job = watched
        job.begin(1)
        job.save(1, job.on(nodes[0]))
        marked(nodes.backing_root, 1, "n0")  # the leader waits for the others' markers
        job.save(1, job.on(nodes[1]) + job.on(nodes[2]))
        settles_everywhere(nodes, 1, "promoted")
        job.close()
        for node in reversed(list(nodes)):
            daemon = the_daemon(node)
            code = daemon.stop(signal.SIGTERM, timeout=20.0)
            assert code == 0, (node.name, code)

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

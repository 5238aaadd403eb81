"""Saves spanning nodes, with every node's daemon on one machine sharing a local root.

Each "node" is a real daemon process with its own ``--node`` name, socket and journal;
all serve the same root directory, as node daemons on a shared filesystem do. (The same
jobs through per-node caching FUSE mounts in private mount namespaces are in
``tests/test_multinode.py``.) Ranks speak the protocol over real Unix sockets.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.base._errors import ConfigError
from daemon.config._config import RootConfig, load_config
from daemon.store._fence import claim
from tests.conftest import DaemonProcess, LineClient

pytestmark = pytest.mark.waits

Start = Callable[..., DaemonProcess]


class Job:
    """A job of ``nodes`` nodes with ``per_node`` ranks each, rank r on node r // per_node."""

    def __init__(
        self,
        root: Path,
        daemons: list[DaemonProcess],
        per_node: int,
        relaunch: Callable[[int], DaemonProcess],
    ) -> None:
        self.root = root
        self.daemons = daemons
        self.per_node = per_node
        self.world = per_node * len(daemons)
        self._relaunch = relaunch

    def restart(self, node: int) -> DaemonProcess:
        """SIGKILL node ``node``'s daemon and start it again (same name, journal, socket)."""
        self.daemons[node].kill()
        self.daemons[node] = self._relaunch(node)
        return self.daemons[node]

    def daemon_of(self, rank: int) -> DaemonProcess:
        """The daemon serving ``rank``."""
        return self.daemons[rank // self.per_node]

    def begin(self, step: int, rank: int, **extra: Any) -> dict[str, Any]:
        """One rank's begin, on its node's daemon."""
        with LineClient(self.daemon_of(rank).socket_path) as c:
            return c.request(
                "begin",
                root=str(self.root),
                step=step,
                rank=rank,
                world_size=self.world,
                local_world_size=self.per_node,
                **extra,
            )

    def begin_all(self, step: int, ranks: list[int] | None = None) -> dict[int, dict[str, Any]]:
        """Begins of ``ranks`` (all by default), sent at once, as a job's ranks do."""
        out: dict[int, dict[str, Any]] = {}
        todo = list(range(self.world)) if ranks is None else ranks

        def one(rank: int) -> None:
            out[rank] = self.begin(step, rank)

        threads = [threading.Thread(target=one, args=(r,)) for r in reversed(todo)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return out

    def write_and_done(self, step: int, rank: int, size: int = 64) -> dict[str, Any]:
        """Write the rank's file into tmp_step_N and say done."""
        name = f"rank{rank}.bin"
        (self.root / f"tmp_step_{step}" / name).write_bytes(b"x" * size)
        with LineClient(self.daemon_of(rank).socket_path) as c:
            return c.request(
                "done",
                root=str(self.root),
                step=step,
                rank=rank,
                files=[{"path": name, "size": size}],
            )

    def fail(self, step: int, rank: int, reason: str) -> dict[str, Any]:
        """One rank reports failure."""
        with LineClient(self.daemon_of(rank).socket_path) as c:
            return c.request("fail", root=str(self.root), step=step, rank=rank, reason=reason)

    def wait(self, node: int, step: int, timeout: float = 30.0) -> dict[str, Any]:
        """``wait`` on node ``node``'s daemon."""
        with LineClient(self.daemons[node].socket_path, timeout=timeout + 10) as c:
            return c.request("wait", root=str(self.root), step=step, timeout=timeout)


@pytest.fixture
def cluster(start: Start, tmp_path: Path) -> Iterator[Callable[..., Job]]:
    """Start ``n`` node daemons on one root: ``cluster(n, per_node, *flags)``."""

    def make(
        n: int,
        per_node: int = 2,
        *flags: str,
        configured: bool = False,
        env: dict[int, dict[str, str]] | None = None,
    ) -> Job:
        root = tmp_path / "ckpt"
        root.mkdir(exist_ok=True)
        roots = [] if configured else [root]  # else the config file names it

        def launch(i: int, first: bool = False) -> DaemonProcess:
            extra = (env or {}).get(i) if first else None
            return start(roots, "--node", f"n{i}", *flags, socket_name=f"n{i}.sock", env=extra)

        return Job(root, [launch(i, True) for i in range(n)], per_node, launch)

    yield make


def _events(daemon: DaemonProcess, name: str) -> list[dict[str, Any]]:
    return [e for e in daemon.seen if e.get("event") == name]


class TestGating:
    """A spanning step is promoted only once every node's ranks are done, and every node says so."""

    def test_three_nodes_promote_once_all_are_done(self, cluster: Callable[..., Job]) -> None:
        job = cluster(3)
        begun = job.begin_all(1)
        attempts = {r["attempt"] for r in begun.values()}
        assert all(r["ok"] for r in begun.values()), begun
        assert len(attempts) == 1, "every node's ranks joined one attempt"
        for rank in range(4):  # nodes 0 and 1 done, node 2 not
            assert job.write_and_done(1, rank)["ok"]
        job.daemons[1].wait_event("node.marked", match=lambda e: e["step"] == 1)
        assert job.wait(0, 1, timeout=0.5)["state"] == "pending"
        job.daemons[0].wait_event("node.done", match=lambda e: e["node"] == "n1")
        with LineClient(job.daemons[0].socket_path) as c:
            (leader,) = c.request("status")["saves"]
        with LineClient(job.daemons[2].socket_path) as c:
            (other,) = c.request("status")["saves"]
        assert (leader["role"], leader["local_world_size"], other["role"]) == ("leader", 2, "node")
        assert [r.get("node") for r in leader["ranks"]] == [None, None, "n1", "n1"]
        assert not (job.root / "step_1").exists()
        for rank in (4, 5):
            assert job.write_and_done(1, rank)["ok"]
        for node in range(3):
            reply = job.wait(node, 1)
            assert reply["state"] == "promoted", (node, reply)
            assert reply["attempt"] in attempts
        promoted = sorted(os.listdir(job.root / "step_1"))
        assert [f"rank{r}.bin" for r in range(6)] == [n for n in promoted if n.startswith("rank")]
        manifest = json.loads((job.root / "step_1" / ".ckptd-manifest.json").read_bytes())
        assert sorted(manifest["ranks"]) == [str(r) for r in range(6)]
        assert os.readlink(job.root / "latest") == "step_1"
        for daemon in job.daemons:
            daemon.wait_event("checkpoint.promoted", match=lambda e: e["step"] == 1)

    def test_polling_roots_promote_too(self, cluster: Callable[..., Job], tmp_path: Path) -> None:
        config = tmp_path / "poll.toml"
        root = tmp_path / "ckpt"
        root.mkdir()
        config.write_text(f'[[roots]]\npath = "{root}"\nwatch = "poll"\npoll_interval = 0.05\n')
        job = cluster(2, 1, "--config", str(config), configured=True)
        assert all(r["ok"] for r in job.begin_all(3).values())
        for rank in range(2):
            assert job.write_and_done(3, rank)["ok"]
        assert job.wait(1, 3)["state"] == "promoted"
        assert job.wait(0, 3)["state"] == "promoted"


class TestFailures:
    """A failure on any node fails the step on every node; the next step still promotes."""

    def test_a_rank_failing_on_one_node_fails_it_everywhere(
        self, cluster: Callable[..., Job]
    ) -> None:
        job = cluster(3)
        assert all(r["ok"] for r in job.begin_all(1).values())
        for rank in (0, 1, 4, 5):
            assert job.write_and_done(1, rank)["ok"]
        assert job.fail(1, 3, "disk full")["ok"]
        for node in range(3):
            reply = job.wait(node, 1)
            assert reply["state"] == "failed", (node, reply)
            assert "disk full" in reply["reason"]
        assert not (job.root / "step_1").exists()
        assert all(r["ok"] for r in job.begin_all(2).values())
        for rank in range(6):
            assert job.write_and_done(2, rank)["ok"]
        assert [job.wait(n, 2)["state"] for n in range(3)] == ["promoted"] * 3

    def test_a_node_missing_past_node_timeout_is_named(
        self, cluster: Callable[..., Job], tmp_path: Path
    ) -> None:
        config = tmp_path / "t.toml"
        config.write_text("node_timeout = 1\n")
        job = cluster(3, 2, "--config", str(config))
        assert all(r["ok"] for r in job.begin_all(1).values())
        for rank in range(4):
            assert job.write_and_done(1, rank)["ok"]
        reply = job.wait(0, 1)
        assert reply["state"] == "failed"
        assert "ranks 4-5 have no node marker" in reply["reason"]
        assert "still writing: n2" in reply["reason"]
        for node in (1, 2):
            assert job.wait(node, 1)["state"] == "failed"

    def test_two_nodes_claiming_one_rank_fail_the_step(self, cluster: Callable[..., Job]) -> None:
        job = cluster(2)
        assert all(r["ok"] for r in job.begin_all(1, [0, 1, 2]).values())
        # Node 1 says rank 1 is its own as well (a misconfigured launcher).
        with LineClient(job.daemons[1].socket_path) as c:
            reply = c.request(
                "begin", root=str(job.root), step=1, rank=1, world_size=4, local_world_size=2
            )
        assert reply["ok"]
        for rank in (0, 1, 2):
            job.write_and_done(1, rank)
        with LineClient(job.daemons[1].socket_path) as c:
            assert c.request(
                "done",
                root=str(job.root),
                step=1,
                rank=1,
                files=[{"path": "rank1.bin", "size": 64}],
            )["ok"]
        reply = job.wait(0, 1)
        assert reply["state"] == "failed"
        assert "rank 1 is claimed by node n1" in reply["reason"]

    def test_a_node_saying_more_ranks_than_its_size_is_refused(
        self, cluster: Callable[..., Job]
    ) -> None:
        job = cluster(2)
        assert all(r["ok"] for r in job.begin_all(1, [2, 3, 0, 1]).values())
        with LineClient(job.daemons[1].socket_path) as c:
            reply = c.request(
                "begin", root=str(job.root), step=1, rank=0, world_size=4, local_world_size=2
            )
        assert reply["error"]["code"] == "node_conflict"
        with LineClient(job.daemons[1].socket_path) as c:
            reply = c.request(
                "begin", root=str(job.root), step=1, rank=2, world_size=4, local_world_size=3
            )
        assert reply["error"]["code"] == "node_conflict"


class TestRestarts:
    """A node daemon SIGKILLed mid-save finishes its part when it comes back."""

    def test_a_follower_killed_after_its_ranks_done_finishes_its_marker(
        self, cluster: Callable[..., Job]
    ) -> None:
        # Node 2's daemon dies after writing its marker, before journaling it.
        job = cluster(3, env={2: {"CKPTD_CRASH_AT": "after_node_marker"}})
        assert all(r["ok"] for r in job.begin_all(1).values())
        for rank in range(6):
            assert job.write_and_done(1, rank)["ok"]
        job.daemons[2].wait_event("_exit")
        job.restart(2)
        assert job.wait(0, 1)["state"] == "promoted"
        assert job.wait(2, 1)["state"] == "promoted"

    def test_the_leader_killed_and_restarted_promotes_exactly_once(
        self, cluster: Callable[..., Job]
    ) -> None:
        job = cluster(3)
        assert all(r["ok"] for r in job.begin_all(1).values())
        for rank in range(2, 6):
            assert job.write_and_done(1, rank)["ok"]
        job.restart(0)
        for rank in (0, 1):  # the ranks reconnect to the restarted leader
            assert job.begin(1, rank, resent=True)["ok"]
            assert job.write_and_done(1, rank)["ok"]
        assert [job.wait(n, 1)["state"] for n in range(3)] == ["promoted"] * 3
        job.daemons[0].wait_event("checkpoint.promoted")
        promoted = [e for e in job.daemons[0].drain() if e["event"] == "checkpoint.promoted"]
        assert len(promoted) == 1


class TestDurableOutcome:
    """Another node reports a spanning step promoted only once the leader's rename is durable."""

    def test_a_rename_the_leader_did_not_make_durable_is_not_reported(
        self, cluster: Callable[..., Job]
    ) -> None:
        # The leader dies right after the rename, before it fsyncs the root.
        job = cluster(2, env={0: {"CKPTD_CRASH_AT": "after_rename"}})
        assert all(r["ok"] for r in job.begin_all(1).values())
        for rank in range(4):
            assert job.write_and_done(1, rank)["ok"]
        job.daemons[0].wait_event("_exit")
        assert (job.root / "step_1").is_dir()  # renamed, not yet durable
        assert job.wait(1, 1, timeout=1.0)["state"] == "pending"
        job.restart(0)  # finishes the promotion: root fsync, pointer, its verdict
        assert job.wait(1, 1)["state"] == "promoted"
        assert job.wait(0, 1)["state"] == "promoted"


class TestShutdown:
    """SIGTERM stops a node daemon that is watching the shared directory, and it resumes."""

    def test_watching_daemons_stop_and_resume(self, cluster: Callable[..., Job]) -> None:
        job = cluster(3)
        assert all(r["ok"] for r in job.begin_all(1).values())
        for rank in range(4):  # the leader gathers, node 1 waits for the outcome
            assert job.write_and_done(1, rank)["ok"]
        job.daemons[1].wait_event("node.marked")
        for node in (0, 1):
            assert job.daemons[node].stop(signal.SIGTERM, timeout=20) == 0
        for node in (0, 1):
            job.daemons[node] = job._relaunch(node)
        for rank in (0, 1):  # the leader's ranks reconnect after its restart
            assert job.begin(1, rank, resent=True)["ok"]
        for rank in (4, 5):
            assert job.write_and_done(1, rank)["ok"]
        assert [job.wait(n, 1)["state"] for n in range(3)] == ["promoted"] * 3


class TestZombies:
    """Markers of an older attempt never count for a newer one."""

    def test_an_old_attempts_marker_does_not_complete_a_new_attempt(
        self, cluster: Callable[..., Job], tmp_path: Path
    ) -> None:
        config = tmp_path / "t.toml"
        config.write_text("node_timeout = 2\n")
        job = cluster(2, 2, "--config", str(config))
        first = job.begin_all(1)
        old = first[0]["attempt"]
        for rank in (0, 1):
            job.write_and_done(1, rank)
        assert job.fail(1, 2, "killed")["ok"]
        assert job.wait(0, 1)["state"] == "failed"
        # A zombie of the old attempt drops a done marker into the new attempt's directory.
        begun = job.begin_all(1, [0, 1])
        assert begun[0]["attempt"] != old
        zombie = {
            "node": "n1",
            "attempt": old,
            "step": 1,
            "world_size": 4,
            "local_world_size": 2,
            "state": "done",
            "files": {"2": [], "3": []},
        }
        (job.root / "tmp_step_1" / ".ckptd-node-n1.json").write_text(json.dumps(zombie))
        for rank in (0, 1):
            job.write_and_done(1, rank)
        reply = job.wait(0, 1)
        assert reply["state"] == "failed"
        assert "ranks 2-3 have no node marker" in reply["reason"]


class TestRescue:
    """``ckptd promote`` on any node promotes from complete markers, or says what is missing."""

    def test_a_follower_promotes_when_the_leaders_node_is_gone(
        self, cluster: Callable[..., Job]
    ) -> None:
        # The leader's node is lost right after its marker landed, before it promoted.
        job = cluster(2, env={0: {"CKPTD_CRASH_AT": "after_node_marker"}})
        assert all(r["ok"] for r in job.begin_all(1).values())
        for rank in (2, 3):
            assert job.write_and_done(1, rank)["ok"]
        job.daemons[1].wait_event("node.marked")
        with LineClient(job.daemons[1].socket_path) as c:
            refused = c.request("promote", root=str(job.root), step=1, timeout=5)
        assert refused["error"]["code"] == "unverifiable"
        assert "ranks 0-1 have no node marker" in refused["error"]["message"]
        # The leader's ranks finish their writes (rank 0 a DCP directory, as trainers
        # save); then its node is lost for good.
        import torch
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        model = job.root / "tmp_step_1" / "model"
        dcp_save({"w": torch.ones(4)}, checkpoint_id=str(model), no_dist=True)
        for rank in (0, 1):
            job.write_and_done(1, rank)
        job.daemons[0].wait_event("_exit")
        assert (job.root / "tmp_step_1" / ".ckptd-node-n0.json").exists()
        with LineClient(job.daemons[1].socket_path) as c:
            reply = c.request("promote", root=str(job.root), step=1, timeout=20)
        assert reply.get("state") == "promoted", reply
        assert (job.root / "step_1" / "rank0.bin").exists()
        assert (job.root / "step_1" / "model" / ".metadata").exists()
        assert os.readlink(job.root / "latest") == "step_1"


class TestSharedGc:
    """``gc`` on a node but the leader never takes a spanning save's shared directory."""

    def test_a_followers_gc_leaves_the_shared_directory(self, cluster: Callable[..., Job]) -> None:
        job = cluster(2)
        assert all(r["ok"] for r in job.begin_all(1).values())
        for rank in (0, 1, 2):
            assert job.write_and_done(1, rank)["ok"]
        leader = job.daemons[0]
        assert leader.proc is not None
        leader.proc.send_signal(signal.SIGSTOP)  # the leader cannot set it aside yet
        try:
            assert job.fail(1, 3, "oom")["ok"]
            assert job.wait(1, 1)["state"] == "failed"
            with LineClient(job.daemons[1].socket_path) as c:
                reply = c.request("gc", root=str(job.root), remove=True)
            assert reply["ok"], reply
            assert (job.root / "tmp_step_1" / "rank0.bin").exists()
        finally:
            leader.proc.send_signal(signal.SIGCONT)
        assert job.wait(0, 1)["state"] == "failed"
        assert not (job.root / "tmp_step_1").exists()  # the leader set it aside


class TestNodeConfig:
    """Node options are validated with messages that say how to fix them."""

    def test_defaults_and_flags(self, tmp_path: Path) -> None:
        config = load_config(roots=[str(tmp_path)], state_dir=str(tmp_path / "s"), env={})
        assert config.node == socket.gethostname().split(".")[0]
        assert config.node_timeout == 600.0
        assert (config.roots[0].watch, config.roots[0].poll_interval) == ("auto", 0.25)
        assert config.roots[0].poll_budget == 1500.0
        named = load_config(roots=[str(tmp_path)], node="gpu-7", env={})
        assert named.node == "gpu-7"

    @pytest.mark.parametrize(
        ("toml", "why"),
        [
            ('node = "a/b"', "node 'a/b' must be 1-64 letters"),
            ("node_timeout = 0", "node_timeout must be > 0"),
            ('watch = "fanotify"', "watch 'fanotify' of root"),
            ("poll_interval = 0", "poll_interval 0 of root"),
            ("poll_budget = 5", "poll_budget 5 of root"),
        ],
    )
    def test_bad_values_are_refused(self, tmp_path: Path, toml: str, why: str) -> None:
        file = tmp_path / "c.toml"
        key = toml.split(" ")[0]
        if key in ("watch", "poll_interval", "poll_budget"):
            file.write_text(f'[[roots]]\npath = "{tmp_path}"\n{toml}\n')
        else:
            file.write_text(f'{toml}\n[[roots]]\npath = "{tmp_path}"\n')
        with pytest.raises(ConfigError, match=re.escape(why)):
            load_config(config_file=str(file), env={})


class TestClaimed:
    """A leader that finds another node's claim on the step does not promote it."""

    def test_the_leader_yields_to_another_nodes_claim(self, cluster: Callable[..., Job]) -> None:
        job = cluster(2)
        assert all(r["ok"] for r in job.begin_all(1).values())
        for rank in (1, 2, 3):
            assert job.write_and_done(1, rank)["ok"]
        # Another node (an operator's ckptd promote there) claims the step first.
        claim(RootConfig(path=str(job.root), real=str(job.root)), 1, "n9", "x")
        assert job.write_and_done(1, 0)["ok"]
        claimed = job.daemons[0].wait_event("checkpoint.claimed")
        assert "node n9" in claimed["reason"]
        assert job.wait(0, 1, timeout=0.5)["state"] == "pending"
        assert not (job.root / "step_1").exists()
        # That node gives up (its claim goes): the leader promotes the step after all.
        (job.root / "tmp_step_1" / ".ckptd-claim").unlink()
        assert job.wait(0, 1)["state"] == "promoted"
        assert job.wait(1, 1)["state"] == "promoted"

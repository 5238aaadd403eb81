"""Protocol-level multi-node jobs on simulated nodes, and how their outcome is read.

A :class:`Rank` speaks the wire protocol to its node's daemon (raw JSON lines, as
``docs/protocol.md`` describes them): ``begin`` with ``local_world_size``, its file
written through its node's mount, ``done`` or ``fail`` naming the attempt it joined. A
:class:`Job` numbers its ranks in node order, so node 0's daemon serves global rank 0
and leads. The helpers below read the outcome: markers and manifests uncached from the
backing directory, and every node's ``wait`` answer and stdout events.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests._nodes import Cluster, SimNode, wait_until
from tests.conftest import DaemonProcess

__all__ = [
    "NODE_TIMEOUT",
    "SETTLE",
    "Job",
    "Rank",
    "events",
    "manifest",
    "marked",
    "marker",
    "settles_everywhere",
    "the_daemon",
    "three",
]

MakeCluster = Callable[..., Cluster]


class Rank:
    """One protocol-level rank of a multi-node job, talking to its node's daemon.

    Args:
        node: The node the rank runs on.
        root: The checkpoint root (as the nodes name it).
        rank: Its global rank.
        world_size: The job's ranks.
        local_world_size: The job's ranks on this node.
    """

    def __init__(
        self, node: SimNode, root: Path, rank: int, world_size: int, local_world_size: int
    ) -> None:
        self.node = node
        self.root = root
        self.rank = rank
        self.world_size = world_size
        self.local_world_size = local_world_size
        self.attempts: dict[int, str | None] = {}
        self.conn = node.connect()

    def reconnect(self) -> None:
        """A new connection (after the node's daemon restarted)."""
        self.conn.close()
        self.conn = self.node.connect()

    def begin(self, step: int, **fields: Any) -> dict[str, Any]:
        """``begin`` with ``local_world_size``; remembers the attempt it joined."""
        reply = self.conn.request(
            "begin",
            root=str(self.root),
            step=step,
            rank=self.rank,
            world_size=self.world_size,
            local_world_size=self.local_world_size,
            **fields,
        )
        if reply.get("ok"):
            self.attempts[step] = reply.get("attempt")
        return reply

    def write(self, step: int, size: int = 64) -> list[dict[str, Any]]:
        """Write this rank's one file of the step through its node's mount."""
        name = f"rank{self.rank}.bin"
        self.node.fs.write(self.root / f"tmp_step_{step}" / name, size)
        return [{"path": name, "size": size}]

    def done(self, step: int, files: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """``done`` naming the attempt this rank joined."""
        fields: dict[str, Any] = {"files": files or []}
        if self.attempts.get(step):
            fields["attempt"] = self.attempts[step]
        return self.conn.request("done", root=str(self.root), step=step, rank=self.rank, **fields)

    def fail(self, step: int, reason: str) -> dict[str, Any]:
        """``fail`` naming the attempt this rank joined."""
        fields: dict[str, Any] = {"reason": reason}
        if self.attempts.get(step):
            fields["attempt"] = self.attempts[step]
        return self.conn.request("fail", root=str(self.root), step=step, rank=self.rank, **fields)

    def save(self, step: int, size: int = 64) -> dict[str, Any]:
        """Write this rank's file and send ``done`` (after ``begin``)."""
        return self.done(step, self.write(step, size))

    def close(self) -> None:
        """Close its connection."""
        self.conn.close()


class Job:
    """A protocol-level job: ``per_node`` ranks on each of ``nodes``.

    Ranks are numbered in node order: node 0 holds rank 0, so its daemon leads.
    """

    def __init__(self, nodes: Sequence[SimNode], root: Path, per_node: int) -> None:
        world = per_node * len(nodes)
        self.world_size = world
        self.ranks = [
            Rank(node, root, i * per_node + local, world, per_node)
            for i, node in enumerate(nodes)
            for local in range(per_node)
        ]

    def on(self, node: SimNode) -> list[Rank]:
        """The ranks on ``node``."""
        return [r for r in self.ranks if r.node is node]

    def begin(self, step: int, ranks: Sequence[Rank] | None = None) -> list[dict[str, Any]]:
        """``begin`` from each rank (every one by default); every reply must be ok."""
        replies = [r.begin(step) for r in (self.ranks if ranks is None else ranks)]
        for reply in replies:
            assert reply.get("ok"), reply
        return replies

    def save(self, step: int, ranks: Sequence[Rank] | None = None) -> None:
        """Each rank (every one by default) writes its file and sends ``done``."""
        for r in self.ranks if ranks is None else ranks:
            reply = r.save(step)
            assert reply.get("ok"), reply

    def close(self) -> None:
        """Close every rank's connection."""
        for r in self.ranks:
            r.close()


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

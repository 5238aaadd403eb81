"""What the ledger keeps of each save, and the effects it asks the daemon to carry out.

Plain data: no I/O, no clock. :mod:`daemon.ledger._ledger` changes these records and returns
effects; the server turns the effects into events, promotions, directory moves and woken
waiters.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from orchestrator.protocol import FileEntry, RankState, SaveState

__all__ = [
    "Effect",
    "Emit",
    "MarkNode",
    "NodeFailed",
    "RankRecord",
    "SaveKey",
    "SaveRecord",
    "SetAside",
    "Settled",
    "Verify",
    "Watch",
    "ids",
    "ranges",
]


class SaveKey(NamedTuple):
    """Identity of one checkpoint: its configured root and its step."""

    root: str
    step: int


@dataclass(frozen=True, slots=True)
class Emit:
    """Effect: log and publish the event ``name`` with ``fields``."""

    name: str
    fields: dict[str, Any]
    level: str = "info"


@dataclass(frozen=True, slots=True)
class Verify:
    """Effect: every rank is done; verify the save's files and, if sound, promote it."""

    key: SaveKey


@dataclass(frozen=True, slots=True)
class Settled:
    """Effect: the save reached a terminal state; wake whoever waits for it."""

    key: SaveKey


@dataclass(frozen=True, slots=True)
class SetAside:
    """Effect: attempt ``attempt`` of ``key`` failed; move its directory into the trash.

    ``then`` (the failure's report: its event, woken waiters) is carried out only once
    the directory was moved, so nobody learns of the failure while the failed attempt's
    files still sit where the next attempt will write.
    """

    key: SaveKey
    attempt: str
    then: tuple[Emit | Settled, ...]


@dataclass(frozen=True, slots=True)
class MarkNode:
    """Effect: this node's ranks of a spanning save are done; write its node marker.

    The ranks' files are checked first; then ``Ledger.node_marked``.
    """

    key: SaveKey


@dataclass(frozen=True, slots=True)
class Watch:
    """Effect: this node's marker is durable; watch the shared directory.

    The leader watches for the other nodes' markers, every other node for the outcome.
    """

    key: SaveKey


@dataclass(frozen=True, slots=True)
class NodeFailed:
    """Effect: attempt ``attempt`` of a save that spans nodes failed here.

    Write this node's failure marker (the leader also writes the step's verdict and sets
    the directory aside), then carry out ``then``. ``announce`` is False when the failure
    was learned from the shared directory: it is already there.
    """

    key: SaveKey
    attempt: str
    reason: str
    leader: bool
    then: tuple[Emit | Settled, ...]
    announce: bool = True


Effect = Emit | Verify | Settled | SetAside | MarkNode | Watch | NodeFailed


@dataclass(slots=True)
class RankRecord:
    """One writer of a save."""

    state: RankState
    begun_at: float
    conn: int | None
    lease_deadline: float | None = None
    files: tuple[FileEntry, ...] = ()
    reason: str | None = None
    node: str | None = None
    """The node whose marker reported this rank (on the leader); None: a local rank."""
    flushed: bool = False
    """A remote rank whose node flushed its files before its marker."""


@dataclass(slots=True)
class SaveRecord:
    """One attempt at one checkpoint step, and its writers."""

    key: SaveKey
    world_size: int
    first_begin: float
    deadline: float | None
    attempt: str = ""
    """The attempt's id ("" for a save journaled before attempts had ids)."""
    run: str = ""
    """The run of the job the attempt belongs to (its first ``begin``'s); "": unnamed."""
    state: SaveState = SaveState.OPEN
    ranks: dict[int, RankRecord] = field(default_factory=dict)
    reason: str | None = None
    path: str | None = None
    settled_at: float | None = None
    rescued: bool = False
    set_aside: str | None = None
    """Where the failed attempt's directory was moved (inside the root's trash)."""
    conns: set[int] = field(default_factory=set)
    """Connections that wrote this attempt (this daemon run): their begins never restart it."""
    local_world_size: int = 0
    """Ranks of the job on this node; 0: all of them (the save does not span nodes)."""
    marked: bool = False
    """This node's marker is durable (a save that spans nodes)."""
    gather_deadline: float | None = None
    """When the leader fails the save if other nodes' markers are still missing."""
    learned: bool = False
    """Its outcome was read from the shared directory (a node other than the leader)."""
    fenced: bool = False
    """Promoted under the shared-root fences (a spanning step rescued by an operator)."""
    taken: set[str] = field(default_factory=set)
    """Nodes whose done marker the leader took (rebuilt by replay)."""
    remote: int = 0
    """Ranks the leader has from other nodes' markers."""
    declared: dict[str, int] = field(default_factory=dict)
    """Each other node's local world size, as its markers said (the leader)."""
    declared_ranks: int = 0
    """The sum of :attr:`declared`, kept as it changes: each marker is checked against
    it, and a large job's thousands of markers must not each add up the others'."""
    writing_nodes: set[str] = field(default_factory=set)
    """Nodes whose marker says they are writing (the leader; not journaled)."""

    @property
    def spans(self) -> bool:
        """Whether the save's ranks are spread over several nodes."""
        return 0 < self.local_world_size < self.world_size

    @property
    def leader(self) -> bool:
        """Whether this node serves global rank 0 of a save that spans nodes."""
        record = self.ranks.get(0)
        return self.spans and record is not None and record.node is None

    def local_ranks(self) -> list[int]:
        """The ranks that write through this daemon."""
        return [r for r, rec in self.ranks.items() if rec.node is None]

    def locally_done(self) -> bool:
        """Whether all of this node's ranks have begun and are done."""
        local = [rec for rec in self.ranks.values() if rec.node is None]
        return len(local) == self.local_world_size and all(
            rec.state is RankState.DONE for rec in local
        )

    def all_done(self) -> bool:
        """Whether every rank has begun and is done (no :meth:`missing_ranks`).

        Stops at the first rank not done, so the ``done`` of each rank but the last
        costs little, where listing what is missing walks the whole world.
        """
        return len(self.ranks) == self.world_size and all(
            rec.state is RankState.DONE for rec in self.ranks.values()
        )

    def missing_ranks(self) -> list[int]:
        """Ranks that have not begun, or have begun but are not done."""
        return [
            r
            for r in range(self.world_size)
            if r not in self.ranks or self.ranks[r].state is not RankState.DONE
        ]

    def reported_files(self) -> dict[int, tuple[FileEntry, ...]]:
        """The files each rank listed in its ``done``."""
        return {rank: rec.files for rank, rec in sorted(self.ranks.items())}

    def flushed_files(self) -> frozenset[str]:
        """The files, relative to the save's directory, flushed by the nodes that wrote them.

        Another node's, when its marker says so; this node's own, once its marker is
        durable (its files were flushed before it was written).
        """
        own = self.spans and self.marked
        return frozenset(
            posixpath.normpath(entry.path)
            for rec in self.ranks.values()
            if rec.flushed or (own and rec.node is None)
            for entry in rec.files
        )


def ids(key: SaveKey, rank: int) -> dict[str, Any]:
    """The fields naming one rank of one save in an event."""
    return {"root": key.root, "step": key.step, "rank": rank}


def ranges(ranks: list[int]) -> str:
    """Compact ``0-3,7`` form, so a 1,000-rank job's event stays short."""
    parts: list[str] = []
    start = prev = None
    for r in ranks:
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(parts)

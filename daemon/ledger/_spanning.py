"""The ledger's rules for a save whose ranks are spread over several nodes.

Each node's daemon sees only its own ranks (``local_world_size`` of them). When they are
all done, the node writes a marker into the shared ``tmp_step_N`` (:class:`MarkNode`);
once it is durable (:meth:`SpanningLedger.node_marked`) the leader, the daemon serving
global rank 0, takes the other nodes' markers (:meth:`SpanningLedger.remote_done`) until
they cover ranks ``0..world_size-1``, then verifies and promotes as a single node does.
Every other node learns the outcome from the shared directory
(:meth:`SpanningLedger.learned`). A failure anywhere fails the step everywhere.

Pure, like the rest of the ledger: no I/O, no clock; :class:`daemon.ledger._ledger.Ledger`
inherits these rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from orchestrator.protocol import ErrorCode, FileEntry, RankState, SaveState

from ..base._errors import RequestError
from ._records import JLearned, JNodeMarked, JournalRecord, JRemote
from ._saves import (
    Effect,
    Emit,
    MarkNode,
    RankRecord,
    SaveKey,
    SaveRecord,
    Settled,
    Verify,
    Watch,
    ranges,
)

__all__ = ["SpanningLedger"]


class SpanningLedger:
    """Multi-node rules of :class:`daemon.ledger._ledger.Ledger` (a mixin over its state)."""

    _saves: dict[SaveKey, SaveRecord]
    _node_timeout: float

    if TYPE_CHECKING:  # what the ledger provides (no stubs at runtime: no MRO shadowing)

        def _record(self, record: JournalRecord) -> None: ...

        def _arm(self, when: float, key: SaveKey) -> None: ...

        def _fail_save(
            self,
            save: SaveRecord,
            reason: str,
            now: float,
            *,
            journal: bool = True,
            learned: bool = False,
        ) -> list[Effect]: ...

        def _settle(self, save: SaveRecord, now: float) -> None: ...

    # -- a node's own ranks ------------------------------------------------------------

    def _check_local(self, save: SaveRecord, rank: int, local_world_size: int | None) -> None:
        """A ``begin`` must agree with what the step's node already said.

        Raises:
            RequestError: ``node_conflict``, naming the contradiction.
        """
        lws = save.world_size if local_world_size is None else local_world_size
        if lws > save.world_size:
            raise RequestError(
                ErrorCode.NODE_CONFLICT,
                f"local_world_size {lws} is larger than world_size {save.world_size}",
            )
        mine = 0 if lws == save.world_size else lws
        if save.ranks and mine != save.local_world_size:
            said = save.local_world_size or save.world_size
            raise RequestError(
                ErrorCode.NODE_CONFLICT,
                f"step {save.key.step}: rank {rank} says this node has {lws} of the job's "
                f"ranks, but earlier ranks said {said}",
            )
        if not save.ranks:
            save.local_world_size = mine
        record = save.ranks.get(rank)
        if record is not None and record.node is not None:
            raise RequestError(
                ErrorCode.NODE_CONFLICT,
                f"step {save.key.step}: rank {rank} is claimed by node {record.node} too",
            )
        if record is None and save.spans and len(save.local_ranks()) >= save.local_world_size:
            raise RequestError(
                ErrorCode.NODE_CONFLICT,
                f"step {save.key.step}: rank {rank} would be rank number "
                f"{len(save.local_ranks()) + 1} on this node, which said it has "
                f"{save.local_world_size} (ranks {ranges(sorted(save.local_ranks()))})",
            )

    def _after_local_done(self, save: SaveRecord) -> list[Effect]:
        """What a spanning save does when one of its local ranks is done."""
        if save.locally_done() and not save.marked:
            return [MarkNode(save.key)]
        return []

    def node_marked(self, key: SaveKey, now: float) -> list[Effect]:
        """This node's marker is durable: watch for the rest (or the outcome)."""
        save = self._saves.get(key)
        if save is None or save.marked or not save.spans or save.state is not SaveState.OPEN:
            return []
        if not save.locally_done():
            return []  # only the marker of a node whose ranks are all done counts
        save.marked = True
        self._record(JNodeMarked(key.root, key.step, save.attempt, now))
        effects: list[Effect] = [
            Emit(
                "node.marked",
                {
                    "root": key.root,
                    "step": key.step,
                    "attempt": save.attempt,
                    "ranks": ranges(sorted(save.local_ranks())),
                    "leader": save.leader,
                },
            )
        ]
        if save.leader:
            save.gather_deadline = now + self._node_timeout
            self._arm(save.gather_deadline, key)
        return [*effects, *self._covered(save), Watch(key)]

    # -- the leader --------------------------------------------------------------------

    def remote_done(
        self,
        key: SaveKey,
        node: str,
        attempt: str,
        local_world_size: int,
        files: Mapping[int, Sequence[FileEntry]],
        now: float,
        *,
        flushed: bool = False,
    ) -> list[Effect]:
        """The leader read node ``node``'s marker: its ranks are done with ``files``.

        ``flushed``: the node flushed those files (the promotion need not).

        A marker of another attempt is ignored (a zombie's). A marker that contradicts the
        others (a rank claimed twice, a rank out of range, node sizes that cannot add up
        to ``world_size``) fails the step, naming it.
        """
        save = self._saves.get(key)
        if (
            save is None
            or attempt != save.attempt
            or save.state
            in (
                SaveState.PROMOTED,
                SaveState.PROMOTING,
            )
        ):
            return []
        if node in save.taken:
            return []  # taken already (a marker is read again after a restart)
        save.taken.add(node)
        self._record(
            JRemote(
                key.root,
                key.step,
                node,
                attempt,
                local_world_size,
                sorted(files),
                [list(files[r]) for r in sorted(files)],
                now,
                flushed,
            )
        )
        problem = self._contradiction(save, node, local_world_size, files)
        for rank, entries in files.items():
            if rank not in save.ranks and 0 <= rank < save.world_size:
                save.ranks[rank] = RankRecord(
                    state=RankState.DONE,
                    begun_at=now,
                    conn=None,
                    files=tuple(entries),
                    node=node,
                    flushed=flushed,
                )
                save.remote += 1
        if save.state is not SaveState.OPEN:
            return []
        if problem is not None:
            return self._fail_save(save, problem, now)
        event = {
            "root": key.root,
            "step": key.step,
            "attempt": attempt,
            "node": node,
            "ranks": ranges(sorted(files)),
            # A count, not a list: O(1) per marker, so a job of thousands of nodes costs
            # the leader linear work, not quadratic.
            "missing": save.world_size - save.local_world_size - save.remote,
        }
        return [Emit("node.done", event), *self._covered(save)]

    def _contradiction(
        self,
        save: SaveRecord,
        node: str,
        local_world_size: int,
        files: Mapping[int, Sequence[FileEntry]],
    ) -> str | None:
        out = sorted(r for r in files if not 0 <= r < save.world_size)
        if out:
            return f"node {node} reports ranks {ranges(out)}, outside world_size {save.world_size}"
        for rank in sorted(files):
            record = save.ranks.get(rank)
            if record is not None:
                other = record.node or "the leader"
                return f"rank {rank} is claimed by node {node} and by {other}"
        if len(files) != local_world_size:
            return (
                f"node {node} said it has {local_world_size} ranks but reports "
                f"{len(files)} ({ranges(sorted(files))})"
            )
        return self._oversized(save, node, local_world_size)

    def _oversized(self, save: SaveRecord, node: str, local_world_size: int) -> str | None:
        """Whether the nodes' local world sizes add up to more than ``world_size``."""
        save.declared_ranks += local_world_size - save.declared.get(node, 0)
        save.declared[node] = local_world_size
        total = save.local_world_size + save.declared_ranks
        if total > save.world_size:
            sizes = ", ".join(f"{n} {k}" for n, k in sorted(save.declared.items()))
            return (
                f"the nodes' local world sizes cannot add up to world_size "
                f"{save.world_size}: the leader {save.local_world_size}, {sizes}"
            )
        return None

    def remote_writing(
        self, key: SaveKey, node: str, attempt: str, local_world_size: int, now: float
    ) -> list[Effect]:
        """The leader read node ``node``'s ``writing`` marker; its size is checked.

        Not journaled: it only names the node if it is still missing at ``node_timeout``.
        """
        save = self._saves.get(key)
        if save is None or attempt != save.attempt or save.state is not SaveState.OPEN:
            return []
        save.writing_nodes.add(node)
        problem = self._oversized(save, node, local_world_size)
        return [] if problem is None else self._fail_save(save, problem, now)

    def remote_failed(
        self, key: SaveKey, node: str, attempt: str, reason: str, now: float
    ) -> list[Effect]:
        """The leader read node ``node``'s failure marker for ``attempt``."""
        save = self._saves.get(key)
        if save is None or attempt != save.attempt or save.state is not SaveState.OPEN:
            return []
        return self._fail_save(save, f"node {node}: {reason}", now)

    def _covered(self, save: SaveRecord) -> list[Effect]:
        """Verify once this node is marked and the markers cover every rank."""
        if save.state is SaveState.OPEN and save.marked and save.leader:
            # Marked means every local rank is done; the others come done from markers.
            if len(save.ranks) == save.world_size:
                save.state = SaveState.VERIFYING
                save.gather_deadline = None
                return [Verify(save.key)]
        return []

    def _gather_expired(self, save: SaveRecord, now: float) -> list[Effect]:
        """Fail a leader's save whose other nodes stayed missing past ``node_timeout``."""
        if save.gather_deadline is None or save.gather_deadline > now:
            return []
        if save.state is not SaveState.OPEN:
            return []
        nodes = sorted({rec.node for rec in save.ranks.values() if rec.node is not None})
        writing = sorted(save.writing_nodes - set(nodes))
        reason = (
            f"nodes missing after node_timeout {self._node_timeout:g}s: ranks "
            f"{ranges(save.missing_ranks())} have no node marker"
            + (f"; still writing: {', '.join(writing)}" if writing else "")
            + (f"; done: the leader and {', '.join(nodes)}" if nodes else "; done: the leader")
        )
        return self._fail_save(save, reason, now)

    def resume(self) -> list[Effect]:
        """After a restart: what each spanning save in flight still needs.

        Every one watches the shared directory again; a node whose ranks were all done
        but whose marker was not journaled also writes it (again: the same content).
        """
        effects: list[Effect] = []
        for save in self._saves.values():
            if save.state is not SaveState.OPEN or not save.spans:
                continue
            effects.append(Watch(save.key))
            if not save.marked and save.locally_done():
                effects.append(MarkNode(save.key))
        return effects

    # -- every other node --------------------------------------------------------------

    def learned(
        self, key: SaveKey, attempt: str, *, promoted: bool, detail: str, now: float
    ) -> list[Effect]:
        """The outcome of a spanning save, read from the shared directory.

        Args:
            key: The save.
            attempt: The attempt the outcome is for; another attempt's changes nothing.
            promoted: Whether it was promoted or failed.
            detail: The checkpoint's path if promoted, else the failure's reason.
            now: Ledger time.
        """
        save = self._saves.get(key)
        if save is None or save.attempt != attempt:
            return []
        if save.state not in (SaveState.OPEN, SaveState.VERIFYING):
            return []  # VERIFYING: a leader that found another node's claim
        self._record(JLearned(key.root, key.step, attempt, promoted, detail, now))
        save.learned = True
        if not promoted:
            return self._fail_save(save, detail, now, journal=False, learned=True)
        save.state = SaveState.PROMOTED
        save.path = detail
        self._settle(save, now)
        event = {
            "root": key.root,
            "step": key.step,
            "path": detail,
            "attempt": attempt,
            "by": "leader",
            "duration_s": round(now - save.first_begin, 6),
        }
        return [Emit("checkpoint.promoted", event), Settled(key)]

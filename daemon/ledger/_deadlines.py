"""The ledger's clock-driven rules: leases, save timeouts and the leader's wait for nodes.

Every deadline of every save goes into one heap (stale entries are skipped as they come
up), so the server's timekeeper learns the next instant anything is due without
scanning the saves. Pure: time comes in as an argument. :class:`daemon.ledger._ledger.Ledger`
inherits these rules.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from orchestrator.protocol import ErrorCode, RankState, SaveState

from ..base._errors import RequestError
from ._saves import Effect, Emit, RankRecord, SaveKey, SaveRecord, ranges
from ._saves import ids as _ids

__all__ = ["Deadlines"]


class Deadlines:
    """Deadline rules of :class:`daemon.ledger._ledger.Ledger` (a mixin over its state)."""

    _saves: dict[SaveKey, SaveRecord]
    _by_conn: dict[int, set[tuple[SaveKey, int]]]
    _deadlines: list[tuple[float, SaveKey]]
    _lease: float
    _save_timeout: float | None

    if TYPE_CHECKING:  # what the ledger provides (no stubs at runtime: no MRO shadowing)

        def _fail_rank(
            self, save: SaveRecord, rank: int, record: RankRecord, reason: str, now: float
        ) -> list[Effect]: ...

        def _fail_save(
            self,
            save: SaveRecord,
            reason: str,
            now: float,
            *,
            journal: bool = True,
            learned: bool = False,
        ) -> list[Effect]: ...

        def _gather_expired(self, save: SaveRecord, now: float) -> list[Effect]: ...

    def next_deadline(self) -> float | None:
        """The earliest instant at which :meth:`tick` has something to do."""
        while self._deadlines and not self._live(*self._deadlines[0]):
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def _arm(self, when: float, key: SaveKey) -> None:
        """Remember that ``key`` has a deadline at ``when`` (entries go stale lazily)."""
        heapq.heappush(self._deadlines, (when, key))

    def _live(self, when: float, key: SaveKey) -> bool:
        """Whether a heap entry is still one of ``key``'s current deadlines."""
        save = self._saves.get(key)
        if save is None or save.state is not SaveState.OPEN:
            return False
        return when in (save.deadline, save.gather_deadline) or any(
            r.lease_deadline == when for r in save.ranks.values()
        )

    def tick(self, now: float) -> list[Effect]:
        """Fail every save whose lease or deadline has passed at ``now``."""
        due: set[SaveKey] = set()
        while (when := self.next_deadline()) is not None and when <= now:
            due.add(heapq.heappop(self._deadlines)[1])
        effects: list[Effect] = []
        if due:  # in the order the saves began, as a full scan would meet them
            for save in [s for s in self._saves.values() if s.key in due]:
                effects += self._expire(save, now)
        return effects

    def _expire(self, save: SaveRecord, now: float) -> list[Effect]:
        """Fail ``save`` if a lease or its deadline has passed at ``now``."""
        if save.state is not SaveState.OPEN:
            return []
        for rank, record in sorted(save.ranks.items()):
            if record.lease_deadline is not None and record.lease_deadline <= now:
                reason = (
                    f"rank {rank} disconnected and did not reconnect within its "
                    f"{self._lease:g}s lease"
                )
                return self._fail_rank(save, rank, record, reason, now)
        if save.deadline is not None and save.deadline <= now:
            if save.spans and not save.leader and save.locally_done():
                # This node's marker is done: only the leader decides the step now, and
                # this node reports what the leader says, never an outcome of its own.
                return []
            reason = f"timed out after {now - save.first_begin:.1f}s; {_outstanding(save)}"
            return self._fail_save(save, reason, now)
        return self._gather_expired(save, now)

    def _expired_first(self, save: SaveRecord, now: float) -> None:
        """A late input must not revive a save whose time ran out before the next tick.

        Raises:
            RequestError: ``step_failed``, carrying the expiry's effects.
        """
        effects = self._expire(save, now)
        if effects:
            raise RequestError(
                ErrorCode.STEP_FAILED,
                f"step {save.key.step} failed: {save.reason}",
                effects=effects,
            )

    def rearm(self, now: float) -> list[Effect]:
        """After a restart: every rank still writing gets a lease from ``now``."""
        effects: list[Effect] = []
        for save in self._saves.values():
            if save.state is not SaveState.OPEN:
                continue
            for rank, record in sorted(save.ranks.items()):
                if record.state is RankState.WRITING and record.conn is None:
                    record.lease_deadline = now + self._lease
                    self._arm(record.lease_deadline, save.key)
                    effects.append(
                        Emit(
                            "save.rank_disconnected",
                            {**_ids(save.key, rank), "lease_s": self._lease},
                        )
                    )
        return effects

    def disconnect(self, conn: int, now: float) -> list[Effect]:
        """A connection closed: each rank it held mid-save starts its lease."""
        effects: list[Effect] = []
        for key, rank in sorted(self._by_conn.pop(conn, set())):
            save = self._saves.get(key)
            record = None if save is None else save.ranks.get(rank)
            if save is None or record is None or record.conn != conn:
                continue
            record.conn = None
            if save.state is SaveState.OPEN and record.state is RankState.WRITING:
                record.lease_deadline = now + self._lease
                self._arm(record.lease_deadline, key)
                effects.append(
                    Emit("save.rank_disconnected", {**_ids(key, rank), "lease_s": self._lease})
                )
        return effects


def _outstanding(save: SaveRecord) -> str:
    """What an open save was still waiting for when its time ran out.

    Ranks not done, if any. A leader whose ranks (its own, and the other nodes' from
    their markers) are all done waits only for its own node marker to be durable: the
    save becomes ``VERIFYING`` the moment it is.
    """
    missing = save.missing_ranks()
    if missing:
        return f"ranks not done: {ranges(missing)}"
    if save.spans and not save.marked:
        return "every rank is done, but this node's marker (the leader's) was not yet durable"
    return "every rank is done, but verification had not begun"  # pragma: no cover

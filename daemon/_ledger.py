"""The ledger: every in-flight save as a pure state machine.

No I/O and no clock: the server passes the time in and carries out the returned effects
(emit an event, start verification, wake waiters). Every change of state also queues a
journal record (:meth:`Ledger.drain_records`); :meth:`Ledger.replay` applies those
records to rebuild the same ledger after a restart.

A save is keyed by ``(root, step)``. Its ranks are the writers the daemon has heard from;
it becomes ``VERIFYING`` only when ranks ``0..world_size-1`` have all begun and are all
done. A save that fails never leaves ``FAILED``.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from orchestrator.protocol import ErrorCode, FileEntry, RankState, SaveState

from ._errors import RequestError
from ._journal import (
    JBegin,
    JDone,
    JFail,
    JForget,
    JIntent,
    JournalRecord,
    JPromoted,
    JRescue,
    JSaveFailed,
)

__all__ = ["Effect", "Emit", "Ledger", "RankRecord", "SaveKey", "SaveRecord", "Settled", "Verify"]

_TERMINAL = frozenset({SaveState.PROMOTED, SaveState.FAILED})
_PROMOTED_OWN = frozenset({"root", "step", "path", "duration_s"})


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


Effect = Emit | Verify | Settled


@dataclass(slots=True)
class RankRecord:
    """One writer of a save."""

    state: RankState
    begun_at: float
    conn: int | None
    lease_deadline: float | None = None
    files: tuple[FileEntry, ...] = ()
    reason: str | None = None


@dataclass(slots=True)
class SaveRecord:
    """One checkpoint step and its writers."""

    key: SaveKey
    world_size: int
    first_begin: float
    deadline: float | None
    state: SaveState = SaveState.OPEN
    ranks: dict[int, RankRecord] = field(default_factory=dict)
    reason: str | None = None
    path: str | None = None
    settled_at: float | None = None
    rescued: bool = False
    conns: set[int] = field(default_factory=set)
    """Connections that wrote this attempt (this daemon run): their begins never restart it."""

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


class Ledger:
    """Tracks every save the daemon knows and decides when one may be promoted.

    Args:
        lease: Seconds a rank whose connection closed mid-save has to reconnect and
            finish before the save fails.
        save_timeout: Seconds from a save's first ``begin`` until, if still incomplete,
            it fails; None disables the limit.
        history: Settled saves kept for ``status``/``wait``; the oldest are dropped first.
    """

    def __init__(self, *, lease: float, save_timeout: float | None, history: int = 4096) -> None:
        self._lease = lease
        self._save_timeout = save_timeout
        self._history = history
        self._saves: dict[SaveKey, SaveRecord] = {}
        self._settled: deque[tuple[SaveKey, SaveRecord]] = deque()
        self._by_conn: dict[int, set[tuple[SaveKey, int]]] = {}
        self._outbox: list[JournalRecord] = []
        self._replaying = False
        self._unsettled = 0
        # (when, key) of every lease and save deadline; stale entries are skipped, so
        # finding and expiring the next deadline never scans all saves.
        self._deadlines: list[tuple[float, SaveKey]] = []

    # -- queries ---------------------------------------------------------------------

    def get(self, key: SaveKey) -> SaveRecord | None:
        """The save for ``key``, if known."""
        return self._saves.get(key)

    def __iter__(self) -> Iterator[SaveRecord]:
        return iter(list(self._saves.values()))

    def __len__(self) -> int:
        return len(self._saves)

    @property
    def unsettled(self) -> int:
        """Saves neither promoted nor failed (what bounds the daemon's memory)."""
        return self._unsettled

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
        return when == save.deadline or any(r.lease_deadline == when for r in save.ranks.values())

    # -- inputs from ranks -------------------------------------------------------------

    def begin(
        self,
        key: SaveKey,
        rank: int,
        world_size: int,
        conn: int | None,
        now: float,
        *,
        resent: bool = False,
    ) -> list[Effect]:
        """A rank announces it is about to write the step.

        Idempotent: a repeated ``begin`` (e.g. after a reconnect) re-attaches the rank to
        ``conn`` and cancels its lease. A first ``begin`` (not ``resent``) for a failed
        step that no live connection still writes starts a new attempt (see
        :meth:`starts_new_attempt`).

        Raises:
            RequestError: rank out of range, world size mismatch, step promoted or failed.
        """
        if rank >= world_size:
            raise RequestError(
                ErrorCode.RANK_OUT_OF_RANGE, f"rank {rank} is not below world_size {world_size}"
            )
        effects: list[Effect] = []
        save = self._saves.get(key)
        if save is not None and self.starts_new_attempt(key, conn, resent=resent):
            effects.append(
                Emit(
                    "save.retried",
                    {"root": key.root, "step": key.step, "previous_reason": save.reason},
                    "warning",
                )
            )
            save = None  # the failed attempt stays in history until it is pruned
        if save is None:
            deadline = None if self._save_timeout is None else now + self._save_timeout
            save = SaveRecord(key=key, world_size=world_size, first_begin=now, deadline=deadline)
            self._saves[key] = save
            self._unsettled += 1
            if deadline is not None:
                self._arm(deadline, key)
        if save.world_size != world_size:
            raise RequestError(
                ErrorCode.WORLD_SIZE_MISMATCH,
                f"step {key.step} has world_size {save.world_size}, not {world_size}",
            )
        self._expired_first(save, now)
        self._refuse_settled(save)
        record = save.ranks.get(rank)
        if record is not None:
            return self._reattach(save, rank, record, conn)
        if save.state is not SaveState.OPEN:  # pragma: no cover - all ranks have begun then
            raise RequestError(ErrorCode.INVALID_STATE, f"step {key.step} is {save.state}")
        save.ranks[rank] = RankRecord(state=RankState.WRITING, begun_at=now, conn=conn)
        self._attach(conn, key, rank)
        if conn is not None:
            save.conns.add(conn)
        self._record(JBegin(key.root, key.step, rank, world_size, now))
        return [*effects, Emit("save.begun", {**_ids(key, rank), "world_size": world_size})]

    def starts_new_attempt(self, key: SaveKey, conn: int | None, *, resent: bool = False) -> bool:
        """Whether a ``begin`` for ``key`` from ``conn`` would start the step over.

        True for a failed step and a ``begin`` from a process that took no part in the
        failed attempt: not on one of its connections, and not re-sent after a
        reconnect. That is a job that crashed while saving step N, resumed from an
        earlier checkpoint and saves step N again. The server moves the old files aside
        first. A late ``begin`` from the failed attempt itself is refused instead.
        """
        save = self._saves.get(key)
        if save is None or save.state is not SaveState.FAILED:
            return False
        if self._replaying:  # only a new attempt was ever journaled after a failure
            return True
        return not resent and conn not in save.conns

    def done(
        self,
        key: SaveKey,
        rank: int,
        files: Sequence[FileEntry],
        conn: int | None,
        now: float,
    ) -> list[Effect]:
        """A rank's writes have all landed. Idempotent once accepted.

        Raises:
            RequestError: the rank never began, already failed, or the step failed.
        """
        save, record = self._rank(key, rank)
        if record.state is RankState.DONE:
            return []
        self._expired_first(save, now)
        if save.state is SaveState.FAILED:
            raise RequestError(ErrorCode.STEP_FAILED, f"step {key.step} failed: {save.reason}")
        self._refuse_when_rescued(save, rank)
        if record.state is RankState.FAILED:  # pragma: no cover - a failed rank fails the save
            raise RequestError(ErrorCode.INVALID_STATE, f"rank {rank} already failed")
        record.state = RankState.DONE
        record.files = tuple(files)
        if conn is not None:
            save.conns.add(conn)
        self._record(JDone(key.root, key.step, rank, list(files), now))
        record.lease_deadline = None
        self._detach(record.conn, key, rank)
        record.conn = conn
        effects: list[Effect] = [
            Emit(
                "save.rank_done",
                {**_ids(key, rank), "files": len(files), "bytes": sum(f.size for f in files)},
            )
        ]
        if not save.missing_ranks():
            save.state = SaveState.VERIFYING
            effects.append(Verify(key))
        return effects

    def fail(self, key: SaveKey, rank: int, reason: str, now: float) -> list[Effect]:
        """A rank's save failed: the step fails and is never promoted.

        Raises:
            RequestError: the rank never began, the step is promoted or being promoted,
                or the rank already reported success.
        """
        save, record = self._rank(key, rank)
        if save.state is SaveState.FAILED:
            return []
        if save.state in (SaveState.PROMOTED, SaveState.PROMOTING):
            raise RequestError(
                ErrorCode.ALREADY_PROMOTED, f"step {key.step} is {save.state}; too late to fail it"
            )
        if record.state is RankState.DONE:
            raise RequestError(ErrorCode.INVALID_STATE, f"rank {rank} already reported done")
        self._refuse_when_rescued(save, rank)
        return self._fail_rank(save, rank, record, f"rank {rank} failed: {reason}", now)

    def _refuse_when_rescued(self, save: SaveRecord, rank: int) -> None:
        # Only a rescue leaves a rank unfinished in a save past OPEN: the operator's
        # verdict stands, a late word from that rank changes nothing.
        if save.state is not SaveState.OPEN:
            raise RequestError(
                ErrorCode.INVALID_STATE,
                f"step {save.key.step} is {save.state} by operator rescue; rank {rank}'s "
                "report comes too late",
            )

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
            reason = (
                f"timed out after {now - save.first_begin:.1f}s; "
                f"ranks not done: {_ranges(save.missing_ranks())}"
            )
            return self._fail_save(save, reason, now)
        return []

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

    # -- inputs from the promoter ------------------------------------------------------

    def verified(self, key: SaveKey) -> list[Effect]:
        """Verification passed: the save is about to be renamed."""
        save = self._require(key, SaveState.VERIFYING)
        save.state = SaveState.PROMOTING
        self._record(JIntent(key.root, key.step))
        return [Emit("checkpoint.promoting", {"root": key.root, "step": key.step})]

    def promoted(self, key: SaveKey, path: str, now: float, **fields: Any) -> list[Effect]:
        """The rename is durable: the save is a checkpoint."""
        save = self._require(key, SaveState.PROMOTING)
        save.state = SaveState.PROMOTED
        save.path = path
        self._record(JPromoted(key.root, key.step, path, now))
        self._settle(save, now)
        extra = {k: v for k, v in fields.items() if k not in _PROMOTED_OWN}
        event = {
            "root": key.root,
            "step": key.step,
            "path": path,
            **extra,
            "duration_s": round(now - save.first_begin, 6),
        }
        return [Emit("checkpoint.promoted", event), Settled(key)]

    def rejected(self, key: SaveKey, reason: str, now: float) -> list[Effect]:
        """Verification or promotion failed: the save fails and is never promoted.

        A save already failed by a rank while it was being verified stays as it is.
        """
        save = self._saves.get(key)
        if save is None or save.state in _TERMINAL:
            return []
        return self._fail_save(save, reason, now)

    def rescue(self, key: SaveKey, now: float) -> list[Effect]:
        """An operator vouches for a step: verify it and, if sound, promote it.

        The one way out of ``FAILED``, and only on an explicit command: for a step
        whose trainer died after its writes landed. Ranks still writing on a live
        connection, or a promotion under way, refuse it.

        Raises:
            RequestError: the step is promoted, being promoted, or still being written.
        """
        save = self._saves.get(key)
        if save is None:
            save = SaveRecord(key=key, world_size=0, first_begin=now, deadline=None)
            self._saves[key] = save
            self._unsettled += 1
        elif save.state is SaveState.PROMOTED:
            raise RequestError(ErrorCode.ALREADY_PROMOTED, f"step {key.step} is already promoted")
        elif save.state in (SaveState.VERIFYING, SaveState.PROMOTING):
            raise RequestError(ErrorCode.INVALID_STATE, f"step {key.step} is {save.state} already")
        elif save.state is SaveState.OPEN:
            live = [
                r
                for r, rec in save.ranks.items()
                if rec.state is RankState.WRITING and rec.conn is not None
            ]
            if live:
                raise RequestError(
                    ErrorCode.INVALID_STATE,
                    f"step {key.step} is still being written by ranks {_ranges(sorted(live))}",
                )
        previous = save.state
        if previous is SaveState.FAILED:
            self._unsettled += 1
        save.state = SaveState.VERIFYING
        save.rescued = True
        save.reason = None
        save.settled_at = None
        for record in save.ranks.values():
            record.lease_deadline = None
        self._record(JRescue(key.root, key.step, now))
        event = {"root": key.root, "step": key.step, "previous": str(previous)}
        return [Emit("checkpoint.rescue", event, "warning"), Verify(key)]

    def forget(self, key: SaveKey) -> None:
        """Drop a settled save (its files were removed by ``gc``)."""
        save = self._saves.get(key)
        if save is not None and save.state in _TERMINAL:
            del self._saves[key]
            self._record(JForget(key.root, key.step))

    # -- journal -----------------------------------------------------------------------

    def drain_records(self) -> list[JournalRecord]:
        """The journal records of every change since the last call, oldest first."""
        records, self._outbox = self._outbox, []
        return records

    def pending_records(self) -> bool:
        """Whether changes wait in the outbox for :meth:`drain_records`."""
        return bool(self._outbox)

    def replay(self, record: JournalRecord, now: float) -> None:
        """Apply one journaled record (``now``: its time in ledger time). No effects.

        Raises:
            RequestError: the record does not fit the ledger (e.g. a duplicate kept by
                a compaction racing a batch); the caller skips it.
        """
        key = SaveKey(record.root, record.step)
        self._replaying = True
        try:
            match record:
                case JBegin(rank=rank, world_size=world_size):
                    self.begin(key, rank, world_size, None, now)
                case JDone(rank=rank, files=files):
                    self.done(key, rank, files, None, now)
                case JFail(rank=rank, reason=reason):
                    save, rank_record = self._rank(key, rank)
                    if save.state not in _TERMINAL:
                        self._fail_rank(save, rank, rank_record, reason, now)
                case JSaveFailed(reason=reason):
                    self.rejected(key, reason, now)
                case JIntent():
                    found = self._saves.get(key)
                    if found is not None and found.state is SaveState.VERIFYING:
                        self.verified(key)
                case JPromoted(path=path):
                    found = self._saves.get(key)
                    if found is not None and found.state is SaveState.PROMOTING:
                        self.promoted(key, path, now)
                case JRescue():
                    self.rescue(key, now)
                case JForget():
                    self.forget(key)
        finally:
            self._replaying = False

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

    def snapshot(self) -> list[JournalRecord]:
        """Records that rebuild the current state (for compacting the journal)."""
        out: list[JournalRecord] = []
        for save in sorted(self._saves.values(), key=lambda s: s.first_begin):
            root, step = save.key
            ranks = sorted(save.ranks.items())
            # Every begin, then every done, then the failure: the order they can happen in.
            out += [JBegin(root, step, r, save.world_size, rec.begun_at) for r, rec in ranks]
            out += [
                JDone(root, step, r, list(rec.files), rec.begun_at)
                for r, rec in ranks
                if rec.state is RankState.DONE
            ]
            out += [
                JFail(root, step, r, rec.reason, save.settled_at or 0.0)
                for r, rec in ranks
                if rec.state is RankState.FAILED and rec.reason is not None
            ]
            if save.rescued:  # after the ranks' records, whose failure it overrode
                out.append(JRescue(root, step, save.first_begin))
            failed_rank = any(r.state is RankState.FAILED for r in save.ranks.values())
            if save.state is SaveState.FAILED and (save.rescued or not failed_rank):
                out.append(JSaveFailed(root, step, save.reason or "", save.settled_at or 0.0))
            if save.state in (SaveState.PROMOTING, SaveState.PROMOTED):
                out.append(JIntent(root, step))
            if save.state is SaveState.PROMOTED and save.path is not None:
                out.append(JPromoted(root, step, save.path, save.settled_at or 0.0))
        return out

    def _record(self, record: JournalRecord) -> None:
        if not self._replaying:
            self._outbox.append(record)

    # -- internals ---------------------------------------------------------------------

    def _rank(self, key: SaveKey, rank: int) -> tuple[SaveRecord, RankRecord]:
        save = self._saves.get(key)
        record = None if save is None else save.ranks.get(rank)
        if save is None or record is None:
            raise RequestError(
                ErrorCode.NOT_BEGUN, f"rank {rank} has not begun step {key.step} of {key.root}"
            )
        return save, record

    def _require(self, key: SaveKey, state: SaveState) -> SaveRecord:
        save = self._saves.get(key)
        if save is None or save.state is not state:
            found = "unknown" if save is None else save.state
            raise RuntimeError(f"save {key} is {found}, expected {state}")
        return save

    def _refuse_settled(self, save: SaveRecord) -> None:
        if save.state is SaveState.PROMOTED:
            raise RequestError(
                ErrorCode.ALREADY_PROMOTED, f"step {save.key.step} is already promoted"
            )
        if save.state is SaveState.FAILED:
            raise RequestError(
                ErrorCode.STEP_FAILED,
                f"step {save.key.step} failed ({save.reason}); this attempt cannot resume "
                "(a new job's begin starts the step over)",
            )

    def _reattach(
        self, save: SaveRecord, rank: int, record: RankRecord, conn: int | None
    ) -> list[Effect]:
        if conn is not None:
            save.conns.add(conn)
        if record.conn == conn:
            return []
        self._detach(record.conn, save.key, rank)
        record.conn = conn
        self._attach(conn, save.key, rank)
        if record.lease_deadline is None:
            return []
        record.lease_deadline = None
        return [Emit("save.rank_reconnected", _ids(save.key, rank))]

    def _attach(self, conn: int | None, key: SaveKey, rank: int) -> None:
        if conn is not None:
            self._by_conn.setdefault(conn, set()).add((key, rank))

    def _detach(self, conn: int | None, key: SaveKey, rank: int) -> None:
        if conn is not None and conn in self._by_conn:
            self._by_conn[conn].discard((key, rank))

    def _fail_rank(
        self, save: SaveRecord, rank: int, record: RankRecord, reason: str, now: float
    ) -> list[Effect]:
        record.state = RankState.FAILED
        record.reason = reason
        record.lease_deadline = None
        self._record(JFail(save.key.root, save.key.step, rank, reason, now))
        effects: list[Effect] = [
            Emit("save.rank_failed", {**_ids(save.key, rank), "reason": reason}, "warning")
        ]
        return effects + self._fail_save(save, reason, now, journal=False)

    def _fail_save(
        self, save: SaveRecord, reason: str, now: float, *, journal: bool = True
    ) -> list[Effect]:
        if journal:  # a rank's failure already recorded the save's
            self._record(JSaveFailed(save.key.root, save.key.step, reason, now))
        save.state = SaveState.FAILED
        save.reason = reason
        for record in save.ranks.values():
            record.lease_deadline = None
        self._settle(save, now)
        event = {"root": save.key.root, "step": save.key.step, "reason": reason}
        return [Emit("checkpoint.failed", event, "error"), Settled(save.key)]

    def _settle(self, save: SaveRecord, now: float) -> None:
        self._unsettled -= 1
        save.settled_at = now
        for rank, record in save.ranks.items():
            # A settled save needs no connection: no lease can start for it any more.
            self._detach(record.conn, save.key, rank)
            record.conn = None
        self._settled.append((save.key, save))
        while len(self._settled) > self._history:
            key, old = self._settled.popleft()
            # Only this record: the key may have been forgotten and begun again since.
            if self._saves.get(key) is old:
                del self._saves[key]


def _ids(key: SaveKey, rank: int) -> dict[str, Any]:
    return {"root": key.root, "step": key.step, "rank": rank}


def _ranges(ranks: list[int]) -> str:
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

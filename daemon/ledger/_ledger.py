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

from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from orchestrator.protocol import ErrorCode, FileEntry, RankState, SaveState

from ..base._errors import RequestError
from . import _replay
from ._deadlines import Deadlines
from ._outcomes import Outcomes
from ._records import (
    JBegin,
    JDone,
    JForget,
    JIntent,
    JournalRecord,
    JPromoted,
)
from ._saves import (
    Effect,
    Emit,
    RankRecord,
    SaveKey,
    SaveRecord,
    SetAside,
    Settled,
    Verify,
)
from ._saves import ids as _ids
from ._spanning import SpanningLedger

__all__ = [
    "Effect",
    "Emit",
    "Ledger",
    "RankRecord",
    "SaveKey",
    "SaveRecord",
    "SetAside",
    "Settled",
    "Verify",
]

_TERMINAL = frozenset({SaveState.PROMOTED, SaveState.FAILED})
_CLOSED = frozenset({SaveState.VERIFYING, SaveState.PROMOTING})
_PROMOTED_OWN = frozenset({"root", "step", "path", "duration_s", "attempt"})


class Ledger(Deadlines, SpanningLedger, Outcomes):
    """Tracks every save the daemon knows and decides when one may be promoted.

    Args:
        lease: Seconds a rank whose connection closed mid-save has to reconnect and
            finish before the save fails.
        save_timeout: Seconds from a save's first ``begin`` until, if still incomplete,
            it fails; None disables the limit.
        history: Settled saves kept for ``status``/``wait``; the oldest are dropped first.
        node_timeout: Seconds the leader of a save that spans nodes waits, once its own
            ranks are done, for the other nodes' markers before the save fails.
    """

    def __init__(
        self,
        *,
        lease: float,
        save_timeout: float | None,
        history: int = 4096,
        node_timeout: float = 600.0,
    ) -> None:
        self._lease = lease
        self._node_timeout = node_timeout
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
        attempt: str | None = None,
        fresh: str = "",
        local_world_size: int | None = None,
        run: str | None = None,
        age_s: float = 0.0,
    ) -> list[Effect]:
        """A rank announces it is about to write the step.

        Idempotent: a repeated ``begin`` (e.g. after a reconnect) re-attaches the rank to
        ``conn`` and cancels its lease. A first ``begin`` of a step, or one for a failed
        step from a process that took no part in the failed attempt (see
        :meth:`starts_new_attempt`), starts a new attempt with the id ``fresh``. No writer
        joins a step that has left ``OPEN``: only a rank that is already done, re-sending
        its begin after a reconnect, is answered there.

        Args:
            key: The save.
            rank: The writer.
            world_size: Ranks writing the step.
            conn: The connection it arrived on (None in replay).
            now: Ledger time.
            resent: Re-sent by a client after a reconnect.
            attempt: The attempt the client says it belongs to, if it knows.
            fresh: The id a new attempt gets, if this begin starts one.
            local_world_size: The job's ranks on this rank's node (None: all of them).
            run: The run of the job the rank belongs to (None: unnamed). A begin of
                another run than the step's never joins its attempt: after a failure
                it starts the step over, while the other run's attempt is open it is
                refused (``run_conflict``).
            age_s: How long ago the attempt began, if this begin starts the ledger's
                record of an attempt that began before (one found on the root): its
                ``save_timeout`` counts from then.

        Raises:
            RequestError: rank out of range, world size mismatch, a stale attempt, the
                step closed to writers, promoted or failed, a node contradiction, or
                another run's attempt of the step still open.
        """
        if rank >= world_size:
            raise RequestError(
                ErrorCode.RANK_OUT_OF_RANGE, f"rank {rank} is not below world_size {world_size}"
            )
        effects: list[Effect] = []
        save = self._saves.get(key)
        if save is not None and attempt is not None and attempt != save.attempt:
            raise RequestError(
                ErrorCode.STALE_ATTEMPT,
                f"attempt {attempt} of step {key.step} is not its current attempt "
                f"{save.attempt or '(unnamed)'}; nothing was changed",
            )
        if save is not None and self.starts_new_attempt(
            key, conn, resent=resent, attempt=attempt, run=run
        ):
            effects.append(
                Emit(
                    "save.retried",
                    {
                        "root": key.root,
                        "step": key.step,
                        "attempt": fresh,
                        "previous_attempt": save.attempt,
                        "previous_reason": save.reason,
                    },
                    "warning",
                )
            )
            save = None  # the failed attempt stays in history until it is pruned
        if save is None:
            began = now - age_s
            deadline = None if self._save_timeout is None else began + self._save_timeout
            save = SaveRecord(
                key=key,
                world_size=world_size,
                first_begin=began,
                deadline=deadline,
                attempt=fresh,
                run=run or "",
            )
            self._saves[key] = save
            self._unsettled += 1
            if deadline is not None:
                self._arm(deadline, key)
        if save.world_size != world_size:
            raise RequestError(
                ErrorCode.WORLD_SIZE_MISMATCH,
                f"step {key.step} has world_size {save.world_size}, not {world_size}",
            )
        if not self._replaying:  # replay rebuilds what happened; expiry is rearm's job
            self._expired_first(save, now)
        record = save.ranks.get(rank)
        if save.state is not SaveState.OPEN:
            # Only a begin re-sent after a reconnect, or one naming this attempt, comes
            # from a writer the step already has; any other would be a new writer.
            own = resent or attempt == save.attempt
            if (
                record is not None
                and record.state is RankState.DONE
                and own
                and save.state is not SaveState.FAILED
            ):
                return self._reattach(save, rank, record, conn)  # a done rank, reconnected
            self._refuse_settled(save)
            raise RequestError(
                ErrorCode.STEP_CLOSED,
                f"step {key.step} is {save.state}: no writer may join it any more",
            )
        if run and save.run and run != save.run:
            raise RequestError(
                ErrorCode.RUN_CONFLICT,
                f"step {key.step} is being saved by run {save.run} (attempt {save.attempt}); "
                f"run {run} cannot join it. It starts the step over once that attempt "
                "fails (its ranks' leases expire) or is gc'ed",
            )
        self._check_local(save, rank, local_world_size)
        if record is not None:
            return self._reattach(save, rank, record, conn)
        save.ranks[rank] = RankRecord(state=RankState.WRITING, begun_at=now, conn=conn)
        self._attach(conn, key, rank)
        if conn is not None:
            save.conns.add(conn)
        lws = save.local_world_size
        self._record(JBegin(key.root, key.step, rank, world_size, now, save.attempt, lws, save.run))
        fields = {**_ids(key, rank), "world_size": world_size, "attempt": save.attempt}
        return [*effects, Emit("save.begun", fields)]

    def done(
        self,
        key: SaveKey,
        rank: int,
        files: Sequence[FileEntry],
        conn: int | None,
        now: float,
        *,
        attempt: str | None = None,
    ) -> list[Effect]:
        """A rank's writes have all landed. Idempotent once accepted.

        Raises:
            RequestError: the rank never began, already failed, the step failed, or
                ``attempt`` is not the step's current attempt.
        """
        begun = self._implied_begin(key, rank, conn, now, attempt)
        save, record = self._rank(key, rank, attempt)
        if record.state is RankState.DONE:
            return []
        if not self._replaying:
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
            *begun,
            Emit(
                "save.rank_done",
                {**_ids(key, rank), "files": len(files), "bytes": sum(f.size for f in files)},
            ),
        ]
        if save.spans:
            effects += self._after_local_done(save)
        elif save.all_done():
            save.state = SaveState.VERIFYING
            effects.append(Verify(key))
        return effects

    def fail(
        self, key: SaveKey, rank: int, reason: str, now: float, *, attempt: str | None = None
    ) -> list[Effect]:
        """A rank's save failed: the step fails and is never promoted.

        Raises:
            RequestError: the rank never began, the step is promoted or being promoted,
                the rank already reported success, or ``attempt`` is not the step's
                current attempt.
        """
        save, record = self._rank(key, rank, attempt)
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
        save.set_aside = None  # a rescued attempt's directory is the checkpoint now
        self._record(JPromoted(key.root, key.step, path, now))
        self._settle(save, now)
        extra = {k: v for k, v in fields.items() if k not in _PROMOTED_OWN}
        event = {
            "root": key.root,
            "step": key.step,
            "path": path,
            "attempt": save.attempt,
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

        See :func:`daemon.ledger._replay.replay`.

        Raises:
            RequestError: the record does not fit the ledger (e.g. a duplicate kept by
                a compaction racing a batch); the caller skips it.
        """
        self._replaying = True
        try:
            _replay.replay(self, record, now)
        finally:
            self._replaying = False

    def replay_failure(self, key: SaveKey, rank: int, reason: str, now: float) -> None:
        """Replay a rank's journaled failure (its ``reason`` as it was recorded)."""
        save, record = self._rank(key, rank)
        if save.state not in _TERMINAL:
            self._fail_rank(save, rank, record, reason, now)

    def snapshot(self) -> list[JournalRecord]:
        """Records that rebuild the current state (for compacting the journal)."""
        return _replay.snapshot(self._saves.values())

    def _record(self, record: JournalRecord) -> None:
        if not self._replaying:
            self._outbox.append(record)

    # -- internals ---------------------------------------------------------------------

    def _rank(
        self, key: SaveKey, rank: int, attempt: str | None = None
    ) -> tuple[SaveRecord, RankRecord]:
        save = self._saves.get(key)
        if save is not None and attempt is not None and attempt != save.attempt:
            raise RequestError(
                ErrorCode.STALE_ATTEMPT,
                f"attempt {attempt} of step {key.step} is not its current attempt "
                f"{save.attempt or '(unnamed)'}; its report changes nothing",
            )
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

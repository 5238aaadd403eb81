"""How a save ends: failing, settling, set aside, and the operator's rescue.

A mixin over :class:`daemon.ledger._ledger.Ledger`'s state, like
:class:`daemon.ledger._deadlines.Deadlines`: pure, no I/O and no clock. A failure is
journaled, settles the save, and is reported only once its attempt's files are out of
the way (:class:`SetAside`) or, for a save that spans nodes, written where the other
nodes learn it (:class:`NodeFailed`). ``rescue`` is the one way out of ``FAILED``.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from orchestrator.protocol import ErrorCode, RankState, SaveState, run_supersedes

from ..base._errors import RequestError
from ._records import JFail, JournalRecord, JRescue, JSaveFailed, JSetAside
from ._saves import (
    Effect,
    Emit,
    NodeFailed,
    RankRecord,
    SaveKey,
    SaveRecord,
    SetAside,
    Settled,
    Verify,
    ranges,
)
from ._saves import ids as _ids

__all__ = ["Outcomes"]


class Outcomes:
    """The failure, settling and rescue rules of the ledger (a mixin over its state)."""

    _saves: dict[SaveKey, SaveRecord]
    _settled: deque[tuple[SaveKey, SaveRecord]]
    _by_conn: dict[int, set[tuple[SaveKey, int]]]
    _replaying: bool
    _unsettled: int
    _history: int

    if TYPE_CHECKING:  # what the ledger provides (no stubs at runtime: no MRO shadowing)

        def _record(self, record: JournalRecord) -> None: ...

        def begin(
            self,
            key: SaveKey,
            rank: int,
            world_size: int,
            conn: int | None,
            now: float,
            *,
            attempt: str | None = None,
            run: str | None = None,
        ) -> list[Effect]: ...

    def rescue(
        self, key: SaveKey, now: float, *, attempt: str = "", world_size: int = 0
    ) -> list[Effect]:
        """An operator vouches for a step: verify it and, if sound, promote it.

        The one way out of ``FAILED``, and only on an explicit command: for a step
        whose trainer died after its writes landed. Ranks still writing on a live
        connection, or a promotion under way, refuse it.

        Args:
            key: The save.
            now: Ledger time.
            attempt: For a step the ledger does not know: the attempt its directory's
                marker names, if any.
            world_size: For a step the ledger does not know: its world size, when its
                node markers say (0: unknown).

        Raises:
            RequestError: the step is promoted, being promoted, or still being written.
        """
        save = self._saves.get(key)
        if save is None:
            save = SaveRecord(
                key=key, world_size=world_size, first_begin=now, deadline=None, attempt=attempt
            )
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
                    f"step {key.step} is still being written by ranks {ranges(sorted(live))}",
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
        save.gather_deadline = None
        save.learned = False  # the operator's verdict replaces what was learned
        save.fenced = save.fenced or world_size > 0 or save.spans
        if save.world_size == 0:
            save.world_size = world_size
        self._record(
            JRescue(key.root, key.step, now, save.attempt, save.world_size if save.fenced else 0)
        )
        event = {
            "root": key.root,
            "step": key.step,
            "attempt": save.attempt,
            "previous": str(previous),
        }
        return [Emit("checkpoint.rescue", event, "warning"), Verify(key)]

    def _implied_begin(
        self, key: SaveKey, rank: int, conn: int | None, now: float, attempt: str | None
    ) -> list[Effect]:
        """Begin ``rank`` for a ``done`` naming the open one-node attempt it never began here.

        A rank learns an attempt's id only from a ``begin`` of it that was answered: its
        ``done`` naming the attempt proves that begin, which a daemon that lost its state
        directory (and took the attempt over from the root) never saw.
        """
        save = self._saves.get(key)
        if (
            save is None
            or not attempt
            or attempt != save.attempt
            or rank in save.ranks
            or save.state is not SaveState.OPEN
            or save.spans
            or not 0 <= rank < save.world_size
        ):
            return []
        return self.begin(
            key, rank, save.world_size, conn, now, attempt=attempt, run=save.run or None
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
        self,
        save: SaveRecord,
        reason: str,
        now: float,
        *,
        journal: bool = True,
        learned: bool = False,
    ) -> list[Effect]:
        if journal:  # a rank's failure already recorded the save's
            self._record(JSaveFailed(save.key.root, save.key.step, reason, now))
        save.state = SaveState.FAILED
        save.reason = reason
        save.gather_deadline = None
        for record in save.ranks.values():
            record.lease_deadline = None
        self._settle(save, now)
        event = {
            "root": save.key.root,
            "step": save.key.step,
            "attempt": save.attempt,
            "reason": reason,
        }
        report = (Emit("checkpoint.failed", event, "error"), Settled(save.key))
        if self._replaying:
            return list(report)
        if save.spans and not save.rescued:
            # The other nodes learn it from the shared directory before it is reported.
            failed = NodeFailed(
                save.key, save.attempt, reason, save.leader, report, announce=not learned
            )
            return [failed]
        # Reported only once the failed attempt's files are out of the way.
        return [SetAside(save.key, save.attempt, report)]

    def set_aside(self, key: SaveKey, attempt: str, path: str, now: float) -> None:
        """The failed attempt ``attempt``'s directory was moved to ``path``."""
        save = self._saves.get(key)
        if save is None or save.attempt != attempt or save.state is not SaveState.FAILED:
            return  # replaced by a newer attempt meanwhile: the trash name still says whose
        save.set_aside = path
        self._record(JSetAside(key.root, key.step, attempt, path, now))

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

    def _refuse_settled(self, save: SaveRecord) -> None:
        if save.state is SaveState.PROMOTED:
            raise RequestError(
                ErrorCode.ALREADY_PROMOTED, f"step {save.key.step} is already promoted"
            )
        if save.state is SaveState.FAILED:
            raise RequestError(
                ErrorCode.STEP_FAILED,
                f"step {save.key.step} failed ({save.reason}); attempt "
                f"{save.attempt or '(unnamed)'} cannot resume (a new job's begin starts the "
                "step over)",
            )

    def superseded_by(self, key: SaveKey, run: str | None) -> SaveRecord | None:
        """The open attempt of ``key`` that a ``begin`` of ``run`` proves dead, if any.

        A later run of the same launch (``orchestrator.protocol.run_supersedes``: the
        same torchelastic run id or Slurm job, more restarts) begins only once every
        rank of the earlier runs is gone, so their open attempt will never finish. Only
        an attempt still ``OPEN`` (one verifying or promoting has all its files and is
        judged on them) and only one of another, earlier run of the same launch.
        """
        save = self._saves.get(key)
        if save is None or save.state is not SaveState.OPEN:
            return None
        return save if run_supersedes(run, save.run) else None

    def may_supersede(self, key: SaveKey) -> bool:
        """Whether this daemon decides that ``key``'s open attempt is superseded.

        On one node, always. For a save that spans nodes only the leader decides (the
        daemon serving global rank 0, as for every verdict): it fails the attempt,
        writes the verdict and sets the directory aside; the other nodes learn that
        from the shared directory.
        """
        save = self._saves.get(key)
        return save is not None and (not save.spans or save.leader)

    def supersede(self, key: SaveKey, run: str, now: float) -> list[Effect]:
        """A ``begin`` of ``run``, a later run of the same launch, takes the step over.

        The open attempt of the dead run fails at once with the reason ``superseded by
        run RUN`` and, as every failed attempt, is set aside before that is reported;
        the ``begin`` then starts the step over (:meth:`starts_new_attempt`). Nothing
        changes unless :meth:`superseded_by` names the attempt and this daemon
        :meth:`may_supersede` it.
        """
        save = self.superseded_by(key, run)
        if save is None or not self.may_supersede(key):
            return []
        event = {
            "root": key.root,
            "step": key.step,
            "attempt": save.attempt,
            "run": save.run,
            "by_run": run,
        }
        superseded = Emit("save.superseded", event, "warning")
        return [superseded, *self._fail_save(save, f"superseded by run {run}", now)]

    def starts_new_attempt(
        self,
        key: SaveKey,
        conn: int | None,
        *,
        resent: bool = False,
        attempt: str | None = None,
        run: str | None = None,
    ) -> bool:
        """Whether a ``begin`` for ``key`` from ``conn`` would start the step over.

        True for a failed step and a ``begin`` from a process that took no part in the
        failed attempt: not on one of its connections, not re-sent after a reconnect,
        and not naming an attempt. That is a job that crashed while saving step N,
        resumed from an earlier checkpoint and saves step N again; the failed attempt's
        directory was set aside when it failed. A late ``begin`` from the failed attempt
        itself is refused instead. A ``begin`` of another run (``run``, when both name
        one) always starts a failed step over.
        """
        save = self._saves.get(key)
        if save is None or save.state is not SaveState.FAILED:
            return False
        if self._replaying:  # only a new attempt was ever journaled after a failure
            return True
        if run and save.run and run != save.run:
            return True
        return not resent and attempt is None and conn not in save.conns

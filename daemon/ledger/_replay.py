"""Rebuilding the ledger from its journal, and the records that rebuild it.

:func:`replay` applies one journaled record to a ledger through the same inputs that
made it, with the ledger in replay mode (no effects, no new records, no expiry judged
on the way). :func:`snapshot` gives the records that rebuild a set of saves, for
compacting the journal; replaying them gives the same saves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from orchestrator.protocol import FileEntry, RankState, SaveState

from ._records import (
    JBegin,
    JDone,
    JFail,
    JForget,
    JIntent,
    JLearned,
    JNodeMarked,
    JournalRecord,
    JPromoted,
    JRemote,
    JRescue,
    JSaveFailed,
    JSetAside,
)
from ._saves import SaveKey, SaveRecord

__all__ = ["Replayable", "replay", "snapshot"]


class Replayable(Protocol):
    """The ledger's inputs that :func:`replay` drives (``daemon.ledger._ledger.Ledger``)."""

    def get(self, key: SaveKey) -> SaveRecord | None: ...

    def begin(
        self, key: SaveKey, rank: int, world_size: int, conn: int | None, now: float, *,
        fresh: str = "", local_world_size: int | None = None, run: str | None = None,
    ) -> Any: ...  # fmt: skip

    def set_aside(self, key: SaveKey, attempt: str, path: str, now: float) -> None: ...

    def done(
        self, key: SaveKey, rank: int, files: Sequence[FileEntry], conn: int | None, now: float
    ) -> Any: ...

    def replay_failure(self, key: SaveKey, rank: int, reason: str, now: float) -> None: ...

    def rejected(self, key: SaveKey, reason: str, now: float) -> Any: ...

    def verified(self, key: SaveKey) -> Any: ...

    def promoted(self, key: SaveKey, path: str, now: float) -> Any: ...

    def rescue(
        self, key: SaveKey, now: float, *, attempt: str = "", world_size: int = 0
    ) -> Any: ...

    def forget(self, key: SaveKey) -> None: ...

    def node_marked(self, key: SaveKey, now: float) -> Any: ...

    def remote_done(
        self, key: SaveKey, node: str, attempt: str, local_world_size: int,
        files: Mapping[int, Sequence[FileEntry]], now: float, *, flushed: bool = False,
    ) -> Any: ...  # fmt: skip

    def learned(
        self, key: SaveKey, attempt: str, *, promoted: bool, detail: str, now: float
    ) -> Any: ...


def replay(ledger: Replayable, record: JournalRecord, now: float) -> None:
    """Apply ``record`` to ``ledger`` (in replay mode; ``now`` is its ledger time).

    Raises:
        RequestError: the record does not fit the ledger.
    """
    key = SaveKey(record.root, record.step)
    match record:
        case JBegin(rank=rank, world_size=world_size, attempt=attempt):
            lws = record.local_world_size or None
            ledger.begin(
                key,
                rank,
                world_size,
                None,
                now,
                fresh=attempt,
                local_world_size=lws,
                run=record.run,
            )
        case JSetAside(attempt=attempt, path=path):
            ledger.set_aside(key, attempt, path, now)
        case JDone(rank=rank, files=files):
            ledger.done(key, rank, files, None, now)
        case JFail(rank=rank, reason=reason):
            ledger.replay_failure(key, rank, reason, now)
        case JSaveFailed(reason=reason):
            ledger.rejected(key, reason, now)
        case JIntent():
            found = ledger.get(key)
            if found is not None and found.state is SaveState.VERIFYING:
                ledger.verified(key)
        case JPromoted(path=path):
            found = ledger.get(key)
            if found is not None and found.state is SaveState.PROMOTING:
                ledger.promoted(key, path, now)
        case JRescue(attempt=attempt, world_size=world_size):
            ledger.rescue(key, now, attempt=attempt, world_size=world_size)
        case JForget():
            ledger.forget(key)
        case JNodeMarked():
            ledger.node_marked(key, now)
        case JRemote(
            node=node,
            attempt=attempt,
            local_world_size=lws,
            ranks=ranks,
            files=files,
            flushed=flushed,
        ):
            by_rank = dict(zip(ranks, files, strict=True))
            ledger.remote_done(key, node, attempt, lws, by_rank, now, flushed=flushed)
        case JLearned(attempt=attempt, promoted=promoted, detail=detail):
            ledger.learned(key, attempt, promoted=promoted, detail=detail, now=now)


def snapshot(saves: Iterable[SaveRecord]) -> list[JournalRecord]:
    """Records that rebuild ``saves``, oldest save first."""
    out: list[JournalRecord] = []
    for save in sorted(saves, key=lambda s: s.first_begin):
        root, step = save.key
        ranks = sorted((r, rec) for r, rec in save.ranks.items() if rec.node is None)
        lws = save.local_world_size
        # Every begin, then every done, then the failure: the order they can happen in.
        out += [
            JBegin(root, step, r, save.world_size, rec.begun_at, save.attempt, lws, save.run)
            for r, rec in ranks
        ]
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
        if save.marked:
            out.append(JNodeMarked(root, step, save.attempt, save.first_begin))
        spanning = save.world_size if save.fenced else 0
        if save.rescued and save.set_aside is not None:
            # Rescued from the trash: where its files lie is the promotion's source. A
            # rescue (which creates a save no journal knew), the failure, the set-aside.
            at = save.first_begin
            out.append(JRescue(root, step, at, save.attempt, spanning))
            out.append(JSaveFailed(root, step, "failed before its rescue", at))
            out.append(JSetAside(root, step, save.attempt, save.set_aside, at))
        if save.rescued:  # after the ranks' records, whose failure it overrode
            out.append(JRescue(root, step, save.first_begin, save.attempt, spanning))
        # A rescue takes the other nodes' markers after it, a leader before its outcome.
        out += _remote_records(save)
        failed_rank = any(r.state is RankState.FAILED for r in save.ranks.values())
        if save.learned:
            detail = (save.path if save.state is SaveState.PROMOTED else save.reason) or ""
            promoted = save.state is SaveState.PROMOTED
            at = save.settled_at or 0.0
            out.append(JLearned(root, step, save.attempt, promoted, detail, at))
            if save.state is SaveState.FAILED and save.set_aside is not None:
                out.append(JSetAside(root, step, save.attempt, save.set_aside, at))
            continue
        if save.state is SaveState.FAILED and (save.rescued or not failed_rank):
            out.append(JSaveFailed(root, step, save.reason or "", save.settled_at or 0.0))
        if save.state is SaveState.FAILED and save.set_aside is not None:
            at = save.settled_at or 0.0
            out.append(JSetAside(root, step, save.attempt, save.set_aside, at))
        if save.state in (SaveState.PROMOTING, SaveState.PROMOTED):
            out.append(JIntent(root, step))
        if save.state is SaveState.PROMOTED and save.path is not None:
            out.append(JPromoted(root, step, save.path, save.settled_at or 0.0))
    return out


def _remote_records(save: SaveRecord) -> list[JournalRecord]:
    """The other nodes' markers a leader (or a rescue) took."""
    root, step = save.key
    out: list[JournalRecord] = []
    nodes: dict[str, list[int]] = {}
    for rank, rec in sorted(save.ranks.items()):
        if rec.node is not None:
            nodes.setdefault(rec.node, []).append(rank)
    for node, ranks in nodes.items():
        files = [list(save.ranks[r].files) for r in ranks]
        flushed = all(save.ranks[r].flushed for r in ranks)
        out.append(
            JRemote(
                root, step, node, save.attempt, len(ranks), ranks, files, save.first_begin, flushed
            )
        )
    return out

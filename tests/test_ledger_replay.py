"""Replaying the journal (or a compaction snapshot) rebuilds the same ledger."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.base._errors import RequestError
from daemon.ledger._ledger import Ledger, SaveKey, Verify
from daemon.ledger._records import JournalRecord, frame, parse
from orchestrator.protocol import FileEntry, SaveState

ROOT = "/ckpt/run"
LEASE = 5.0

op = st.one_of(
    st.tuples(st.just("begin"), st.integers(0, 2), st.integers(0, 2), st.sampled_from([1, 2, 3])),
    st.tuples(st.just("done"), st.integers(0, 2), st.integers(0, 2)),
    st.tuples(st.just("fail"), st.integers(0, 2), st.integers(0, 2)),
    st.tuples(st.just("disconnect"), st.integers(1, 3)),
    st.tuples(st.just("advance"), st.sampled_from([0.5, 3.0, 7.0])),
    st.tuples(st.just("promote"), st.integers(0, 2), st.booleans()),
    st.tuples(st.just("rescue"), st.integers(0, 2)),
    st.tuples(st.just("forget"), st.integers(0, 2)),
    # Steps 5 and 6 span two nodes: ranks 0-1 here (rank 0: this node leads), 2-3 on "b".
    st.tuples(st.just("span_begin"), st.sampled_from([5, 6]), st.integers(0, 3)),
    st.tuples(st.just("span_done"), st.sampled_from([5, 6]), st.integers(0, 1)),
    st.tuples(st.just("marked"), st.sampled_from([5, 6])),
    st.tuples(st.just("remote"), st.sampled_from([5, 6]), st.booleans(), st.booleans()),
    st.tuples(st.just("learned"), st.sampled_from([5, 6]), st.booleans()),
    st.tuples(st.just("span_rescue"), st.sampled_from([5, 6])),
    st.tuples(st.just("set_aside"), st.sampled_from([0, 1, 5])),
)


def _fingerprint(ledger: Ledger) -> dict[SaveKey, Any]:
    """What must survive a restart: states, reasons, each rank's state and files."""
    return {
        save.key: (
            save.state,
            save.world_size,
            save.reason,
            save.path,
            sorted(
                (r, rec.state, rec.files, rec.reason, rec.node, rec.flushed)
                for r, rec in save.ranks.items()
            ),
            save.flushed_files(),
            save.local_world_size,
            save.marked,
            save.learned,
            save.fenced,
            save.set_aside,
        )
        for save in ledger
    }


def _run(ops: list[tuple[Any, ...]]) -> tuple[Ledger, list[JournalRecord]]:
    ledger = Ledger(lease=LEASE, save_timeout=20.0)
    records: list[JournalRecord] = []
    now = 0.0
    verifying: set[SaveKey] = set()
    for o in ops:
        try:
            match o:
                case ("begin", step, rank, world):
                    ledger.begin(SaveKey(ROOT, step), rank, world, rank + 1, now)
                case ("done", step, rank):
                    files = [FileEntry(f"r{rank}.bin", 10 * rank)]
                    effects = ledger.done(SaveKey(ROOT, step), rank, files, rank + 1, now)
                    verifying |= {e.key for e in effects if isinstance(e, Verify)}
                case ("fail", step, rank):
                    ledger.fail(SaveKey(ROOT, step), rank, f"boom {step}", now)
                case ("disconnect", conn):
                    ledger.disconnect(conn, now)
                case ("advance", dt):
                    now += dt
                    ledger.tick(now)
                case ("promote", step, ok):
                    key = SaveKey(ROOT, step)
                    save = ledger.get(key)
                    if key in verifying and save is not None:
                        verifying.discard(key)
                        if save.state is SaveState.VERIFYING and ok:
                            ledger.verified(key)
                            ledger.promoted(key, f"{ROOT}/step_{step}", now, bytes=1)
                        else:
                            ledger.rejected(key, "verification failed: short", now)
                case ("rescue", step):
                    ledger.rescue(SaveKey(ROOT, step), now)
                    verifying.add(SaveKey(ROOT, step))
                case ("forget", step):
                    ledger.forget(SaveKey(ROOT, step))
                case ("span_begin", step, rank):
                    key = SaveKey(ROOT, step)
                    ledger.begin(key, rank, 4, rank + 1, now, fresh=f"a{step}", local_world_size=2)
                case ("span_done", step, rank):
                    files = [FileEntry(f"r{rank}.bin", 10 * rank)]
                    ledger.done(SaveKey(ROOT, step), rank, files, rank + 1, now)
                case ("marked", step):
                    ledger.node_marked(SaveKey(ROOT, step), now)
                case ("remote", step, ok, flushed):
                    key = SaveKey(ROOT, step)
                    save = ledger.get(key)
                    attempt = save.attempt if save is not None else ""
                    if ok:
                        node = {2: [FileEntry("r2.bin", 2)], 3: [FileEntry("r3.bin", 3)]}
                        effects = ledger.remote_done(
                            key, "b", attempt, 2, node, now, flushed=flushed
                        )
                        verifying |= {e.key for e in effects if isinstance(e, Verify)}
                    else:
                        ledger.remote_failed(key, "b", attempt, "oom", now)
                case ("learned", step, promoted):
                    key = SaveKey(ROOT, step)
                    save = ledger.get(key)
                    attempt = save.attempt if save is not None else ""
                    detail = f"{ROOT}/step_{step}" if promoted else "node b: oom"
                    ledger.learned(key, attempt, promoted=promoted, detail=detail, now=now)
                case ("set_aside", step):
                    key = SaveKey(ROOT, step)
                    save = ledger.get(key)
                    attempt = save.attempt if save is not None else ""
                    ledger.set_aside(key, attempt, f"{ROOT}/.ckptd-trash/t{step}", now)
                case ("span_rescue", step):
                    ledger.rescue(SaveKey(ROOT, step), now, attempt=f"a{step}", world_size=4)
                    verifying.add(SaveKey(ROOT, step))
        except RequestError:
            pass
        records += ledger.drain_records()
    return ledger, records


def _replayed(records: list[JournalRecord]) -> Ledger:
    fresh = Ledger(lease=LEASE, save_timeout=20.0)
    for record in records:
        try:
            fresh.replay(record, getattr(record, "at", 0.0))
        except RequestError:
            pass
    assert fresh.drain_records() == []  # replay never re-journals
    return fresh


class TestReplay:
    """The journal, and a snapshot of it, carry everything a restart needs."""

    @settings(max_examples=400, deadline=None)
    @given(st.lists(op, max_size=40))
    def test_journal_replay_rebuilds_the_ledger(self, ops: list[tuple[Any, ...]]) -> None:
        ledger, records = _run(ops)
        # Through the real on-disk framing, as recovery reads it.
        data = b"CKPTDJ\x00\x01" + b"".join(frame(r) for r in records)
        assert _fingerprint(_replayed(parse(data).records)) == _fingerprint(ledger)

    @settings(max_examples=400, deadline=None)
    @given(st.lists(op, max_size=40))
    def test_snapshot_rebuilds_the_ledger(self, ops: list[tuple[Any, ...]]) -> None:
        ledger, _ = _run(ops)
        assert _fingerprint(_replayed(ledger.snapshot())) == _fingerprint(ledger)

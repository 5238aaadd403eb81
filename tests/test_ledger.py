"""Tests for daemon.ledger._ledger: the pure state machine that decides when a save may be promoted.

No I/O and no clock: every test passes the time in as a float and reads the effects the
ledger returns.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from daemon.base._errors import RequestError
from daemon.ledger._ledger import Effect, Emit, Ledger, SaveKey, SetAside, Settled, Verify
from daemon.ledger._records import JBegin
from orchestrator.protocol import ErrorCode, FileEntry, RankState, SaveState, run_supersedes

ROOT = "/ckpt/run-42"
KEY = SaveKey(ROOT, 7)
LEASE = 10.0
FILES = (FileEntry(path="model/__0_0.distcp", size=100), FileEntry(path="model/.metadata", size=5))


def make_ledger(
    *, lease: float = LEASE, save_timeout: float | None = None, history: int = 4096
) -> Ledger:
    return Ledger(lease=lease, save_timeout=save_timeout, history=history)


def flat(effects: Sequence[Effect]) -> list[Effect]:
    """The effects in the order they are carried out: a set-aside's report after it."""
    out: list[Effect] = []
    for e in effects:
        out += list(e.then) if isinstance(e, SetAside) else [e]
    return out


def names(effects: Sequence[Effect]) -> list[str]:
    """Each effect as a word: the event name of an Emit, else the effect's class name."""
    return [e.name if isinstance(e, Emit) else type(e).__name__ for e in flat(effects)]


def emitted(effects: Sequence[Effect], name: str) -> dict[str, Any]:
    """The fields of the one ``name`` event among ``effects``."""
    found = [e for e in flat(effects) if isinstance(e, Emit) and e.name == name]
    assert len(found) == 1, f"expected one {name}, got {names(effects)}"
    return found[0].fields


def state(ledger: Ledger, key: SaveKey = KEY) -> SaveState:
    save = ledger.get(key)
    assert save is not None, f"{key} is unknown"
    return save.state


def begin_all(
    ledger: Ledger, world_size: int, key: SaveKey = KEY, now: float = 0.0
) -> list[Effect]:
    """Every rank begins, each from its own connection (conn id = rank + 1)."""
    effects: list[Effect] = []
    for rank in range(world_size):
        effects += ledger.begin(key, rank, world_size, conn=rank + 1, now=now)
    return effects


def done_all(ledger: Ledger, world_size: int, key: SaveKey = KEY, now: float = 1.0) -> list[Effect]:
    effects: list[Effect] = []
    for rank in range(world_size):
        effects += ledger.done(key, rank, FILES, conn=rank + 1, now=now)
    return effects


def verifying(world_size: int = 2, **kwargs: Any) -> Ledger:
    """A ledger whose save KEY has every rank begun and done, so it is VERIFYING."""
    ledger = make_ledger(**kwargs)
    begin_all(ledger, world_size)
    assert Verify(KEY) in done_all(ledger, world_size)
    return ledger


def failed(world_size: int = 2) -> Ledger:
    """A ledger whose save KEY failed because rank 0 reported a failure."""
    ledger = make_ledger()
    begin_all(ledger, world_size)
    ledger.fail(KEY, 0, "disk full", now=1.0)
    assert state(ledger) is SaveState.FAILED
    return ledger


def promoted(world_size: int = 2) -> Ledger:
    ledger = verifying(world_size)
    ledger.verified(KEY)
    ledger.promoted(KEY, f"{ROOT}/step_7", now=2.0)
    assert state(ledger) is SaveState.PROMOTED
    return ledger


def refused(code: ErrorCode) -> pytest.RaisesExc[RequestError]:
    """``pytest.raises`` that matches only a RequestError carrying ``code``."""
    return pytest.raises(RequestError, check=lambda exc: exc.code is code)


class TestBegin:
    """``begin`` opens a save once, is idempotent, and refuses what cannot be saved."""

    def test_first_begin_opens_the_save_and_emits_save_begun(self) -> None:
        ledger = make_ledger()
        effects = ledger.begin(KEY, 0, 4, conn=1, now=5.0)
        assert effects == [
            Emit("save.begun", {"root": ROOT, "step": 7, "rank": 0, "world_size": 4, "attempt": ""})
        ]
        save = ledger.get(KEY)
        assert save is not None
        assert (save.state, save.world_size, save.first_begin) == (SaveState.OPEN, 4, 5.0)
        assert save.ranks[0].state is RankState.WRITING
        assert save.ranks[0].conn == 1

    def test_each_new_rank_emits_save_begun_but_first_begin_is_kept(self) -> None:
        ledger = make_ledger()
        ledger.begin(KEY, 0, 2, conn=1, now=5.0)
        effects = ledger.begin(KEY, 1, 2, conn=2, now=8.0)
        assert emitted(effects, "save.begun")["rank"] == 1
        save = ledger.get(KEY)
        assert save is not None
        assert save.first_begin == 5.0

    def test_repeat_from_the_same_connection_emits_nothing(self) -> None:
        ledger = make_ledger()
        ledger.begin(KEY, 0, 2, conn=1, now=0.0)
        assert ledger.begin(KEY, 0, 2, conn=1, now=1.0) == []
        assert state(ledger) is SaveState.OPEN

    def test_repeat_from_another_connection_moves_the_rank_silently(self) -> None:
        ledger = make_ledger()
        ledger.begin(KEY, 0, 2, conn=1, now=0.0)
        assert ledger.begin(KEY, 0, 2, conn=2, now=1.0) == []
        # The rank now belongs to conn 2: closing conn 1 leaves it alone.
        assert ledger.disconnect(1, now=2.0) == []
        assert names(ledger.disconnect(2, now=2.0)) == ["save.rank_disconnected"]

    def test_repeat_after_done_emits_nothing(self) -> None:
        ledger = make_ledger()
        ledger.begin(KEY, 0, 2, conn=1, now=0.0)
        ledger.done(KEY, 0, FILES, conn=1, now=1.0)
        assert ledger.begin(KEY, 0, 2, conn=3, now=2.0) == []
        save = ledger.get(KEY)
        assert save is not None
        assert save.ranks[0].state is RankState.DONE

    @pytest.mark.parametrize(("rank", "world_size"), [(1, 1), (4, 4), (5, 4), (2**31 - 1, 1)])
    def test_rank_not_below_world_size_is_refused(self, rank: int, world_size: int) -> None:
        ledger = make_ledger()
        with refused(ErrorCode.RANK_OUT_OF_RANGE) as info:
            ledger.begin(KEY, rank, world_size, conn=1, now=0.0)
        assert f"rank {rank}" in str(info.value)
        assert ledger.get(KEY) is None, "a refused first begin must not open a save"

    def test_another_world_size_is_refused(self) -> None:
        ledger = make_ledger()
        ledger.begin(KEY, 0, 4, conn=1, now=0.0)
        with refused(ErrorCode.WORLD_SIZE_MISMATCH) as info:
            ledger.begin(KEY, 1, 8, conn=2, now=0.0)
        assert "4" in str(info.value) and "8" in str(info.value)
        save = ledger.get(KEY)
        assert save is not None
        assert (save.world_size, sorted(save.ranks)) == (4, [0])

    def test_begin_of_a_promoted_step_is_refused(self) -> None:
        ledger = promoted()
        with refused(ErrorCode.ALREADY_PROMOTED):
            ledger.begin(KEY, 0, 2, conn=9, now=3.0)
        assert state(ledger) is SaveState.PROMOTED

    def test_begin_of_a_failed_step_is_refused(self) -> None:
        ledger = failed()
        with refused(ErrorCode.STEP_FAILED) as info:
            ledger.begin(KEY, 1, 2, conn=2, now=3.0)  # a connection of the failed attempt
        assert "disk full" in str(info.value)
        with refused(ErrorCode.STEP_FAILED):
            ledger.begin(KEY, 1, 2, conn=9, now=3.0, resent=True)  # re-sent after a reconnect
        assert state(ledger) is SaveState.FAILED

    def test_begin_from_a_new_process_starts_a_new_attempt(self) -> None:
        ledger = failed()
        effects = ledger.begin(KEY, 0, 4, conn=9, now=3.0)  # a resumed job, another world
        assert names(effects) == ["save.retried", "save.begun"]
        assert emitted(effects, "save.retried")["previous_reason"] == "rank 0 failed: disk full"
        save = ledger.get(KEY)
        assert save is not None and (save.state, save.world_size) == (SaveState.OPEN, 4)
        assert sorted(save.ranks) == [0]

    def test_steps_and_roots_are_independent(self) -> None:
        ledger = failed()
        other_step = SaveKey(ROOT, 8)
        other_root = SaveKey("/ckpt/run-43", 7)
        assert names(ledger.begin(other_step, 0, 3, conn=1, now=0.0)) == ["save.begun"]
        assert names(ledger.begin(other_root, 0, 5, conn=1, now=0.0)) == ["save.begun"]
        assert (state(ledger, other_step), state(ledger, other_root)) == (
            SaveState.OPEN,
            SaveState.OPEN,
        )
        assert len(ledger) == 3
        assert {s.key for s in ledger} == {KEY, other_step, other_root}


class TestAttempts:
    """Each attempt has an id; a stale one changes nothing; no writer joins past OPEN."""

    def test_first_begin_names_the_attempt_and_the_rest_join_it(self) -> None:
        ledger = make_ledger()
        ledger.begin(KEY, 0, 2, conn=1, now=0.0, fresh="a1")
        ledger.begin(KEY, 1, 2, conn=2, now=0.0, fresh="ignored")
        save = ledger.get(KEY)
        assert save is not None and save.attempt == "a1"
        assert [r.attempt for r in ledger.drain_records() if isinstance(r, JBegin)] == [
            "a1",
            "a1",
        ]

    def test_a_new_job_gets_a_new_attempt_and_the_old_one_is_stale(self) -> None:
        ledger = make_ledger()
        ledger.begin(KEY, 0, 1, conn=1, now=0.0, fresh="old")
        effects = ledger.fail(KEY, 0, "crash", now=1.0)
        assert [type(e).__name__ for e in effects] == ["Emit", "SetAside"]
        retried = ledger.begin(KEY, 0, 1, conn=2, now=2.0, fresh="new")
        assert emitted(retried, "save.retried")["previous_attempt"] == "old"
        with refused(ErrorCode.STALE_ATTEMPT):
            ledger.done(KEY, 0, FILES, conn=1, now=3.0, attempt="old")
        with refused(ErrorCode.STALE_ATTEMPT):
            ledger.fail(KEY, 0, "late", now=3.0, attempt="old")
        with refused(ErrorCode.STALE_ATTEMPT):
            ledger.begin(KEY, 0, 1, conn=1, now=3.0, resent=True, attempt="old")
        assert state(ledger) is SaveState.OPEN
        done = ledger.done(KEY, 0, FILES, conn=2, now=4.0, attempt="new")
        assert names(done) == ["save.rank_done", "Verify"]

    @pytest.mark.parametrize("stage", ["verifying", "promoting", "promoted"])
    def test_no_writer_joins_past_open(self, stage: str) -> None:
        ledger = make_ledger()
        ledger.begin(KEY, 0, 2, conn=1, now=0.0, fresh="a1")
        ledger.begin(KEY, 1, 2, conn=2, now=0.0)
        done_all(ledger, 2)
        if stage != "verifying":
            ledger.verified(KEY)
        if stage == "promoted":
            ledger.promoted(KEY, f"{ROOT}/step_7", now=2.0)
        code = ErrorCode.ALREADY_PROMOTED if stage == "promoted" else ErrorCode.STEP_CLOSED
        # Neither a new process nor the same connection beginning again may write.
        for conn in (9, 1):
            with refused(code):
                ledger.begin(KEY, 0, 2, conn=conn, now=3.0)
        # A done rank re-sending its begin after a reconnect is answered, changing nothing.
        assert ledger.begin(KEY, 0, 2, conn=9, now=3.0, resent=True) == []
        assert ledger.begin(KEY, 1, 2, conn=9, now=3.0, attempt="a1") == []
        assert state(ledger) is SaveState(stage)

    def test_set_aside_is_journaled_and_replayed(self) -> None:
        ledger = make_ledger()
        ledger.begin(KEY, 0, 1, conn=1, now=0.0, fresh="a1")
        ledger.fail(KEY, 0, "crash", now=1.0)
        ledger.set_aside(KEY, "a1", "/trash/x", now=1.5)
        ledger.set_aside(KEY, "other", "/trash/y", now=1.5)  # not this attempt: ignored
        records = ledger.drain_records()
        replayed = make_ledger()
        for record in records:
            replayed.replay(record, now=0.0)
        save = replayed.get(KEY)
        assert save is not None and (save.attempt, save.set_aside) == ("a1", "/trash/x")
        snap = make_ledger()
        for record in ledger.snapshot():
            snap.replay(record, now=0.0)
        again = snap.get(KEY)
        assert again is not None and (again.state, again.set_aside) == (
            SaveState.FAILED,
            "/trash/x",
        )


class TestDone:
    """``done`` counts a rank's success; the save verifies once ranks 0..W-1 all did."""

    def test_done_before_begin_is_refused(self) -> None:
        ledger = make_ledger()
        with refused(ErrorCode.NOT_BEGUN):
            ledger.done(KEY, 0, FILES, conn=1, now=0.0)
        ledger.begin(KEY, 0, 2, conn=1, now=0.0)
        with refused(ErrorCode.NOT_BEGUN):
            ledger.done(KEY, 1, FILES, conn=2, now=0.0)

    def test_done_records_files_and_emits_counts(self) -> None:
        ledger = make_ledger()
        ledger.begin(KEY, 0, 2, conn=1, now=0.0)
        effects = ledger.done(KEY, 0, FILES, conn=1, now=1.0)
        assert effects == [
            Emit("save.rank_done", {"root": ROOT, "step": 7, "rank": 0, "files": 2, "bytes": 105})
        ]
        save = ledger.get(KEY)
        assert save is not None
        assert save.ranks[0].state is RankState.DONE
        assert save.reported_files() == {0: FILES}
        assert save.missing_ranks() == [1]

    @pytest.mark.parametrize("world_size", [1, 2, 5])
    def test_verify_appears_with_the_last_done_and_not_before(self, world_size: int) -> None:
        ledger = make_ledger()
        begin_all(ledger, world_size)
        for rank in reversed(range(1, world_size)):
            effects = ledger.done(KEY, rank, FILES, conn=rank + 1, now=1.0)
            assert names(effects) == ["save.rank_done"]
            assert state(ledger) is SaveState.OPEN
        effects = ledger.done(KEY, 0, FILES, conn=1, now=1.0)
        assert names(effects) == ["save.rank_done", "Verify"]
        assert effects[-1] == Verify(KEY)
        assert state(ledger) is SaveState.VERIFYING

    def test_no_verify_while_a_rank_has_not_begun(self) -> None:
        ledger = make_ledger()
        ledger.begin(KEY, 0, 3, conn=1, now=0.0)
        ledger.begin(KEY, 1, 3, conn=2, now=0.0)
        assert Verify(KEY) not in ledger.done(KEY, 0, FILES, conn=1, now=1.0)
        assert Verify(KEY) not in ledger.done(KEY, 1, FILES, conn=2, now=1.0)
        # Rank 2 never began: its done is refused, and nothing verifies.
        with refused(ErrorCode.NOT_BEGUN):
            ledger.done(KEY, 2, FILES, conn=3, now=1.0)
        assert state(ledger) is SaveState.OPEN
        save = ledger.get(KEY)
        assert save is not None
        assert save.missing_ranks() == [2]
        # Once it begins, beginning alone verifies nothing; its done does.
        assert names(ledger.begin(KEY, 2, 3, conn=3, now=2.0)) == ["save.begun"]
        assert state(ledger) is SaveState.OPEN
        assert Verify(KEY) in ledger.done(KEY, 2, FILES, conn=3, now=3.0)

    def test_no_verify_while_a_begun_rank_is_still_writing(self) -> None:
        ledger = make_ledger()
        begin_all(ledger, 3)
        ledger.done(KEY, 0, FILES, conn=1, now=1.0)
        ledger.done(KEY, 2, FILES, conn=3, now=1.0)
        assert state(ledger) is SaveState.OPEN

    def test_repeat_done_is_idempotent(self) -> None:
        ledger = make_ledger()
        begin_all(ledger, 2)
        ledger.done(KEY, 0, FILES, conn=1, now=1.0)
        assert ledger.done(KEY, 0, (), conn=1, now=2.0) == []
        save = ledger.get(KEY)
        assert save is not None
        assert save.ranks[0].files == FILES, "a repeated done must not replace the file list"

    def test_repeat_done_after_verify_emits_no_second_verify(self) -> None:
        ledger = verifying(2)
        assert ledger.done(KEY, 0, FILES, conn=1, now=2.0) == []
        assert ledger.done(KEY, 1, FILES, conn=2, now=2.0) == []
        assert state(ledger) is SaveState.VERIFYING

    def test_done_after_the_step_failed_is_refused(self) -> None:
        ledger = failed(3)
        with refused(ErrorCode.STEP_FAILED) as info:
            ledger.done(KEY, 1, FILES, conn=2, now=2.0)
        assert "disk full" in str(info.value)
        assert state(ledger) is SaveState.FAILED

    def test_done_after_the_step_failed_by_lease_is_refused(self) -> None:
        ledger = make_ledger()
        begin_all(ledger, 2)
        ledger.disconnect(1, now=0.0)
        ledger.tick(now=LEASE)
        with refused(ErrorCode.STEP_FAILED):
            ledger.done(KEY, 0, FILES, conn=5, now=LEASE + 1)
        with refused(ErrorCode.STEP_FAILED):
            ledger.done(KEY, 1, FILES, conn=2, now=LEASE + 1)


class TestFail:
    """``fail`` fails the whole save at once, and only while it can still be stopped."""

    def test_fail_fails_the_save(self) -> None:
        ledger = make_ledger()
        begin_all(ledger, 3)
        effects = ledger.fail(KEY, 1, "CUDA error", now=4.0)
        assert names(effects) == ["save.rank_failed", "checkpoint.failed", "Settled"]
        assert flat(effects)[-1] == Settled(KEY)
        rank_failed = emitted(effects, "save.rank_failed")
        assert (rank_failed["rank"], rank_failed["reason"]) == (1, "rank 1 failed: CUDA error")
        assert emitted(effects, "checkpoint.failed") == {
            "root": ROOT,
            "step": 7,
            "attempt": "",
            "reason": "rank 1 failed: CUDA error",
        }
        assert [e.level for e in flat(effects) if isinstance(e, Emit)] == ["warning", "error"]
        # The failure is reported only once the attempt's directory is set aside.
        assert isinstance(effects[-1], SetAside) and effects[-1].key == KEY
        save = ledger.get(KEY)
        assert save is not None
        assert (save.state, save.reason, save.settled_at) == (
            SaveState.FAILED,
            "rank 1 failed: CUDA error",
            4.0,
        )
        assert save.ranks[1].state is RankState.FAILED

    def test_a_failed_save_never_verifies_even_if_every_other_rank_is_done(self) -> None:
        ledger = make_ledger()
        begin_all(ledger, 3)
        ledger.done(KEY, 0, FILES, conn=1, now=1.0)
        ledger.fail(KEY, 2, "oom", now=2.0)
        with refused(ErrorCode.STEP_FAILED):
            ledger.done(KEY, 1, FILES, conn=2, now=3.0)
        with refused(ErrorCode.STEP_FAILED):
            ledger.done(KEY, 2, FILES, conn=3, now=3.0)
        assert ledger.done(KEY, 0, FILES, conn=1, now=3.0) == []
        assert state(ledger) is SaveState.FAILED
        assert ledger.next_deadline() is None

    def test_fail_before_begin_is_refused(self) -> None:
        ledger = make_ledger()
        with refused(ErrorCode.NOT_BEGUN):
            ledger.fail(KEY, 0, "x", now=0.0)
        ledger.begin(KEY, 0, 2, conn=1, now=0.0)
        with refused(ErrorCode.NOT_BEGUN):
            ledger.fail(KEY, 1, "x", now=0.0)
        assert state(ledger) is SaveState.OPEN

    def test_fail_after_the_ranks_done_is_refused(self) -> None:
        ledger = make_ledger()
        begin_all(ledger, 2)
        ledger.done(KEY, 0, FILES, conn=1, now=1.0)
        with refused(ErrorCode.INVALID_STATE):
            ledger.fail(KEY, 0, "late", now=2.0)
        assert state(ledger) is SaveState.OPEN

    def test_fail_while_verifying_is_refused_as_the_rank_is_done(self) -> None:
        ledger = verifying(2)
        with refused(ErrorCode.INVALID_STATE):
            ledger.fail(KEY, 1, "late", now=2.0)
        assert state(ledger) is SaveState.VERIFYING

    def test_fail_of_a_promoting_step_is_refused(self) -> None:
        ledger = verifying(2)
        ledger.verified(KEY)
        with refused(ErrorCode.ALREADY_PROMOTED):
            ledger.fail(KEY, 0, "late", now=2.0)
        assert state(ledger) is SaveState.PROMOTING

    def test_fail_of_a_promoted_step_is_refused(self) -> None:
        ledger = promoted(2)
        with refused(ErrorCode.ALREADY_PROMOTED):
            ledger.fail(KEY, 0, "late", now=3.0)
        assert state(ledger) is SaveState.PROMOTED

    def test_second_fail_is_a_no_op(self) -> None:
        ledger = failed(3)
        assert ledger.fail(KEY, 0, "again", now=2.0) == []
        assert ledger.fail(KEY, 2, "another", now=2.0) == []
        save = ledger.get(KEY)
        assert save is not None
        assert save.reason == "rank 0 failed: disk full", "the first reason stands"
        assert save.settled_at == 1.0


class TestDisconnectAndLease:
    """A rank whose connection closes mid-save has a lease to come back before it fails."""

    def test_disconnect_while_writing_starts_a_lease(self) -> None:
        ledger = make_ledger()
        begin_all(ledger, 2, now=0.0)
        effects = ledger.disconnect(2, now=3.0)
        assert effects == [
            Emit(
                "save.rank_disconnected",
                {"root": ROOT, "step": 7, "rank": 1, "lease_s": LEASE},
            )
        ]
        save = ledger.get(KEY)
        assert save is not None
        assert save.ranks[1].conn is None
        assert save.ranks[1].lease_deadline == 3.0 + LEASE
        assert ledger.next_deadline() == 3.0 + LEASE

    def test_tick_before_the_deadline_does_nothing(self) -> None:
        ledger = make_ledger()
        begin_all(ledger, 2, now=0.0)
        ledger.disconnect(2, now=3.0)
        assert ledger.tick(now=3.0) == []
        assert ledger.tick(now=3.0 + LEASE - 1e-6) == []
        assert state(ledger) is SaveState.OPEN

    @pytest.mark.parametrize("late", [0.0, 0.5, 1000.0])
    def test_tick_at_or_after_the_deadline_fails_the_save(self, late: float) -> None:
        ledger = make_ledger()
        begin_all(ledger, 2, now=0.0)
        ledger.disconnect(2, now=3.0)
        effects = ledger.tick(now=3.0 + LEASE + late)
        assert names(effects) == ["save.rank_failed", "checkpoint.failed", "Settled"]
        reason = emitted(effects, "checkpoint.failed")["reason"]
        assert "rank 1" in reason and "lease" in reason and "10s" in reason
        assert state(ledger) is SaveState.FAILED
        assert ledger.next_deadline() is None
        assert ledger.tick(now=3.0 + LEASE + late + 1) == []

    def test_reconnect_before_expiry_cancels_the_lease_and_the_save_promotes(self) -> None:
        ledger = make_ledger()
        begin_all(ledger, 2, now=0.0)
        ledger.disconnect(2, now=3.0)
        effects = ledger.begin(KEY, 1, 2, conn=7, now=3.0 + LEASE - 1)
        assert effects == [Emit("save.rank_reconnected", {"root": ROOT, "step": 7, "rank": 1})]
        save = ledger.get(KEY)
        assert save is not None
        assert (save.ranks[1].conn, save.ranks[1].lease_deadline) == (7, None)
        assert ledger.next_deadline() is None
        assert ledger.tick(now=3.0 + LEASE + 100) == []
        ledger.done(KEY, 0, FILES, conn=1, now=20.0)
        assert Verify(KEY) in ledger.done(KEY, 1, FILES, conn=7, now=20.0)
        ledger.verified(KEY)
        ledger.promoted(KEY, f"{ROOT}/step_7", now=21.0)
        assert state(ledger) is SaveState.PROMOTED

    def test_reconnected_rank_gets_a_new_lease_when_its_new_connection_closes(self) -> None:
        ledger = make_ledger()
        begin_all(ledger, 2, now=0.0)
        ledger.disconnect(2, now=1.0)
        ledger.begin(KEY, 1, 2, conn=7, now=2.0)
        assert ledger.disconnect(2, now=3.0) == [], "the old connection no longer holds it"
        assert names(ledger.disconnect(7, now=4.0)) == ["save.rank_disconnected"]
        assert ledger.next_deadline() == 4.0 + LEASE

    def test_done_from_a_new_connection_ends_the_lease(self) -> None:
        ledger = make_ledger()
        begin_all(ledger, 2, now=0.0)
        ledger.disconnect(2, now=1.0)
        ledger.done(KEY, 1, FILES, conn=8, now=2.0)
        assert ledger.next_deadline() is None
        assert ledger.tick(now=1.0 + LEASE) == []
        assert state(ledger) is SaveState.OPEN

    def test_disconnect_after_done_starts_no_lease(self) -> None:
        ledger = make_ledger()
        begin_all(ledger, 2, now=0.0)
        ledger.done(KEY, 1, FILES, conn=2, now=1.0)
        assert ledger.disconnect(2, now=2.0) == []
        assert ledger.next_deadline() is None
        assert ledger.tick(now=1000.0) == []
        assert state(ledger) is SaveState.OPEN

    def test_disconnect_of_an_unknown_connection_does_nothing(self) -> None:
        ledger = make_ledger()
        begin_all(ledger, 2, now=0.0)
        assert ledger.disconnect(99, now=1.0) == []
        assert ledger.disconnect(1, now=1.0) != []
        assert ledger.disconnect(1, now=2.0) == [], "a connection closes only once"

    def test_disconnect_of_a_settled_save_starts_no_lease(self) -> None:
        ledger = failed(3)
        assert ledger.disconnect(2, now=2.0) == []
        assert ledger.disconnect(3, now=2.0) == []
        assert ledger.next_deadline() is None

    def test_one_connection_holding_ranks_of_several_saves_leases_each(self) -> None:
        ledger = make_ledger()
        other = SaveKey(ROOT, 8)
        ledger.begin(KEY, 0, 2, conn=1, now=0.0)
        ledger.begin(KEY, 1, 2, conn=1, now=0.0)
        ledger.begin(other, 0, 1, conn=1, now=0.0)
        effects = ledger.disconnect(1, now=5.0)
        assert [(e.fields["step"], e.fields["rank"]) for e in effects if isinstance(e, Emit)] == [
            (7, 0),
            (7, 1),
            (8, 0),
        ]
        failures = ledger.tick(now=5.0 + LEASE)
        assert names(failures).count("checkpoint.failed") == 2
        assert names(failures).count("Settled") == 2
        assert state(ledger, KEY) is state(ledger, other) is SaveState.FAILED

    def test_earliest_lease_fails_the_save_first(self) -> None:
        ledger = make_ledger()
        begin_all(ledger, 3, now=0.0)
        ledger.disconnect(3, now=1.0)
        ledger.disconnect(2, now=2.0)
        assert ledger.next_deadline() == 1.0 + LEASE
        effects = ledger.tick(now=1.0 + LEASE)
        assert emitted(effects, "save.rank_failed")["rank"] == 2
        assert names(effects).count("Settled") == 1

    @pytest.mark.parametrize("late_input", ["begin", "done"])
    def test_an_expired_lease_is_not_revived_by_a_late_input(self, late_input: str) -> None:
        ledger = make_ledger()
        begin_all(ledger, 2, now=0.0)
        ledger.disconnect(2, now=0.0)
        ledger.done(KEY, 0, FILES, conn=1, now=1.0)
        # The rank comes back after its lease ran out, before the server's next tick.
        late = LEASE + 5.0
        with refused(ErrorCode.STEP_FAILED):
            if late_input == "begin":
                ledger.begin(KEY, 1, 2, conn=9, now=late)
            else:
                ledger.done(KEY, 1, FILES, conn=9, now=late)
        assert state(ledger) is SaveState.FAILED


class TestSaveTimeout:
    """An incomplete save fails ``save_timeout`` seconds after its first begin."""

    def test_incomplete_save_fails_at_the_deadline_listing_missing_ranks(self) -> None:
        ledger = make_ledger(save_timeout=30.0)
        ledger.begin(KEY, 0, 8, conn=1, now=100.0)
        for rank in (1, 2, 3, 6):
            ledger.begin(KEY, rank, 8, conn=rank + 1, now=101.0)
        for rank in (0, 1, 6):
            ledger.done(KEY, rank, FILES, conn=rank + 1, now=102.0)
        assert ledger.next_deadline() == 130.0
        assert ledger.tick(now=129.999) == []
        effects = ledger.tick(now=130.0)
        assert names(effects) == ["checkpoint.failed", "Settled"]
        reason = emitted(effects, "checkpoint.failed")["reason"]
        assert reason == "timed out after 30.0s; ranks not done: 2-5,7"
        assert state(ledger) is SaveState.FAILED
        assert ledger.next_deadline() is None

    @pytest.mark.parametrize(
        ("done", "world_size", "missing"),
        [
            ((), 1, "0"),
            ((), 4, "0-3"),
            ((0, 2), 4, "1,3"),
            ((1, 2, 3), 6, "0,4-5"),
            ((0, 1, 2, 4, 5, 6, 8), 10, "3,7,9"),
        ],
    )
    def test_missing_ranks_are_listed_as_compact_ranges(
        self, done: tuple[int, ...], world_size: int, missing: str
    ) -> None:
        ledger = make_ledger(save_timeout=5.0)
        begin_all(ledger, world_size, now=0.0)
        for rank in done:
            ledger.done(KEY, rank, FILES, conn=rank + 1, now=1.0)
        effects = ledger.tick(now=7.5)
        assert emitted(effects, "checkpoint.failed")["reason"] == (
            f"timed out after 7.5s; ranks not done: {missing}"
        )

    def test_deadline_counts_from_the_first_begin(self) -> None:
        ledger = make_ledger(save_timeout=30.0)
        ledger.begin(KEY, 0, 2, conn=1, now=0.0)
        ledger.begin(KEY, 1, 2, conn=2, now=25.0)
        assert ledger.next_deadline() == 30.0
        assert names(ledger.tick(now=30.0)) == ["checkpoint.failed", "Settled"]

    def test_a_complete_save_never_times_out(self) -> None:
        ledger = verifying(2, save_timeout=30.0)
        assert ledger.next_deadline() is None
        assert ledger.tick(now=1e9) == []
        assert state(ledger) is SaveState.VERIFYING

    def test_none_disables_the_timeout(self) -> None:
        ledger = make_ledger(save_timeout=None)
        ledger.begin(KEY, 0, 2, conn=1, now=0.0)
        assert ledger.next_deadline() is None
        assert ledger.tick(now=1e12) == []
        assert state(ledger) is SaveState.OPEN

    def test_next_deadline_is_the_earliest_of_leases_and_timeouts(self) -> None:
        ledger = make_ledger(save_timeout=30.0)
        other = SaveKey(ROOT, 8)
        ledger.begin(KEY, 0, 2, conn=1, now=0.0)
        ledger.begin(other, 0, 2, conn=2, now=10.0)
        assert ledger.next_deadline() == 30.0
        ledger.disconnect(2, now=12.0)
        assert ledger.next_deadline() == 12.0 + LEASE
        assert names(ledger.tick(now=12.0 + LEASE)) == [
            "save.rank_failed",
            "checkpoint.failed",
            "Settled",
        ]
        assert ledger.next_deadline() == 30.0

    def test_a_lease_expiring_with_the_timeout_fails_the_save_once(self) -> None:
        ledger = make_ledger(save_timeout=LEASE)
        begin_all(ledger, 2, now=0.0)
        ledger.disconnect(1, now=0.0)
        effects = ledger.tick(now=LEASE)
        assert names(effects) == ["save.rank_failed", "checkpoint.failed", "Settled"]
        assert "lease" in emitted(effects, "checkpoint.failed")["reason"]

    def test_a_done_after_the_timeout_does_not_complete_the_save(self) -> None:
        ledger = make_ledger(save_timeout=30.0)
        ledger.begin(KEY, 0, 1, conn=1, now=0.0)
        with refused(ErrorCode.STEP_FAILED):
            ledger.done(KEY, 0, FILES, conn=1, now=31.0)
        assert state(ledger) is SaveState.FAILED


class TestPromotionPath:
    """The promoter's verdicts move a verifying save to PROMOTED or FAILED."""

    def test_verified_moves_verifying_to_promoting(self) -> None:
        ledger = verifying(2)
        assert ledger.verified(KEY) == [Emit("checkpoint.promoting", {"root": ROOT, "step": 7})]
        assert state(ledger) is SaveState.PROMOTING

    def test_promoted_settles_with_its_event_fields(self) -> None:
        ledger = make_ledger()
        ledger.begin(KEY, 0, 2, conn=1, now=100.0)
        ledger.begin(KEY, 1, 2, conn=2, now=101.0)
        done_all(ledger, 2, now=110.0)
        ledger.verified(KEY)
        path = f"{ROOT}/step_7"
        effects = ledger.promoted(KEY, path, now=112.25, bytes=210, files=4, latest=True)
        assert effects == [
            Emit(
                "checkpoint.promoted",
                {
                    "root": ROOT,
                    "step": 7,
                    "path": path,
                    "attempt": "",
                    "bytes": 210,
                    "files": 4,
                    "latest": True,
                    "duration_s": 12.25,
                },
            ),
            Settled(KEY),
        ]
        save = ledger.get(KEY)
        assert save is not None
        assert (save.state, save.path, save.settled_at) == (SaveState.PROMOTED, path, 112.25)

    def test_duration_is_rounded_to_microseconds(self) -> None:
        ledger = make_ledger()
        begin_all(ledger, 1, now=0.1)
        done_all(ledger, 1, now=0.2)
        ledger.verified(KEY)
        effects = ledger.promoted(KEY, f"{ROOT}/step_7", now=0.3)
        assert emitted(effects, "checkpoint.promoted")["duration_s"] == 0.2

    def test_rejected_while_verifying_fails_the_save(self) -> None:
        ledger = verifying(2)
        effects = ledger.rejected(KEY, "verification failed: missing .metadata", now=3.0)
        assert names(effects) == ["checkpoint.failed", "Settled"]
        assert emitted(effects, "checkpoint.failed")["reason"] == (
            "verification failed: missing .metadata"
        )
        assert state(ledger) is SaveState.FAILED

    def test_rejected_while_promoting_fails_the_save(self) -> None:
        ledger = verifying(2)
        ledger.verified(KEY)
        effects = ledger.rejected(KEY, "promotion failed: EXDEV", now=3.0)
        assert names(effects) == ["checkpoint.failed", "Settled"]
        assert state(ledger) is SaveState.FAILED
        with refused(ErrorCode.STEP_FAILED):
            ledger.begin(KEY, 0, 2, conn=1, now=4.0)

    def test_rejected_on_a_failed_save_is_a_no_op(self) -> None:
        ledger = failed(2)
        assert ledger.rejected(KEY, "verification failed", now=5.0) == []
        save = ledger.get(KEY)
        assert save is not None
        assert (save.state, save.reason) == (SaveState.FAILED, "rank 0 failed: disk full")

    def test_rejected_on_a_promoted_or_unknown_save_is_a_no_op(self) -> None:
        ledger = promoted(2)
        assert ledger.rejected(KEY, "late", now=5.0) == []
        assert state(ledger) is SaveState.PROMOTED
        assert ledger.rejected(SaveKey(ROOT, 99), "nothing", now=5.0) == []
        assert ledger.get(SaveKey(ROOT, 99)) is None

    def test_verdicts_out_of_order_are_programming_errors(self) -> None:
        ledger = make_ledger()
        begin_all(ledger, 2)
        with pytest.raises(RuntimeError, match="expected verifying"):
            ledger.verified(KEY)
        with pytest.raises(RuntimeError, match="expected promoting"):
            ledger.promoted(KEY, "/x", now=1.0)
        with pytest.raises(RuntimeError, match="unknown"):
            ledger.verified(SaveKey(ROOT, 99))
        assert state(ledger) is SaveState.OPEN


class TestHistory:
    """Settled saves beyond ``history`` are dropped, oldest settled first."""

    def test_oldest_settled_saves_are_dropped(self) -> None:
        ledger = make_ledger(history=2)
        keys = [SaveKey(ROOT, step) for step in range(4)]
        for t, key in enumerate(keys):
            ledger.begin(key, 0, 1, conn=1, now=float(t))
            ledger.fail(key, 0, "x", now=float(t))
        assert [s.key for s in ledger] == keys[2:]
        assert ledger.get(keys[0]) is None and ledger.get(keys[1]) is None

    def test_order_is_by_settling_not_by_beginning(self) -> None:
        ledger = make_ledger(history=2)
        a, b, c = (SaveKey(ROOT, step) for step in (1, 2, 3))
        for key in (a, b, c):
            ledger.begin(key, 0, 1, conn=1, now=0.0)
        ledger.fail(c, 0, "x", now=1.0)
        ledger.done(a, 0, FILES, conn=1, now=2.0)
        ledger.verified(a)
        ledger.promoted(a, f"{ROOT}/step_1", now=3.0)
        assert {s.key for s in ledger} == {a, b, c}, "b is still open: nothing dropped yet"
        ledger.done(b, 0, FILES, conn=1, now=4.0)
        ledger.rejected(b, "verification failed", now=4.0)
        assert {s.key for s in ledger} == {a, b}, "c settled first, so it goes first"

    def test_unsettled_saves_are_never_dropped(self) -> None:
        ledger = make_ledger(history=1)
        open_keys = [SaveKey(ROOT, step) for step in range(5)]
        for key in open_keys:
            ledger.begin(key, 0, 2, conn=1, now=0.0)
        for step in range(100, 110):
            key = SaveKey(ROOT, step)
            ledger.begin(key, 0, 1, conn=2, now=1.0)
            ledger.fail(key, 0, "x", now=1.0)
        assert {s.key for s in ledger} == {*open_keys, SaveKey(ROOT, 109)}
        assert all(state(ledger, key) is SaveState.OPEN for key in open_keys)

    def test_zero_history_keeps_no_settled_save(self) -> None:
        ledger = make_ledger(history=0)
        ledger.begin(KEY, 0, 1, conn=1, now=0.0)
        effects = ledger.fail(KEY, 0, "x", now=1.0)
        assert Settled(KEY) in flat(effects)
        assert len(ledger) == 0

    def test_forget_drops_only_settled_saves(self) -> None:
        ledger = failed(2)
        other = SaveKey(ROOT, 8)
        ledger.begin(other, 0, 1, conn=1, now=0.0)
        ledger.forget(other)
        ledger.forget(SaveKey(ROOT, 99))
        assert state(ledger, other) is SaveState.OPEN
        ledger.forget(KEY)
        assert ledger.get(KEY) is None

    def test_a_step_saved_again_after_forget_is_not_evicted_while_open(self) -> None:
        ledger = make_ledger(history=1)
        ledger.begin(KEY, 0, 1, conn=1, now=0.0)
        ledger.fail(KEY, 0, "disk full", now=1.0)
        ledger.forget(KEY)  # `ckptd gc ROOT --yes`, as the STEP_FAILED message advises
        assert names(ledger.begin(KEY, 0, 1, conn=1, now=2.0)) == ["save.begun"]
        other = SaveKey(ROOT, 8)
        ledger.begin(other, 0, 1, conn=2, now=3.0)
        ledger.fail(other, 0, "x", now=4.0)  # evicts the forgotten record, not the retry
        assert state(ledger) is SaveState.OPEN
        assert names(ledger.done(KEY, 0, FILES, conn=1, now=5.0)) == ["save.rank_done", "Verify"]

    def test_a_step_settled_again_after_forget_is_kept_as_the_newest(self) -> None:
        ledger = make_ledger(history=1)
        for t in (0.0, 10.0):
            ledger.begin(KEY, 0, 1, conn=1, now=t)
            ledger.fail(KEY, 0, "disk full", now=t + 1)
            if t == 0.0:
                ledger.forget(KEY)
        save = ledger.get(KEY)
        assert save is not None
        assert (save.state, save.first_begin) == (SaveState.FAILED, 10.0)
        other = SaveKey(ROOT, 8)
        ledger.begin(other, 0, 1, conn=2, now=20.0)
        ledger.fail(other, 0, "x", now=21.0)
        assert [s.key for s in ledger] == [other]


# -- random interleavings ------------------------------------------------------------------

KEYS = (SaveKey(ROOT, 0), SaveKey(ROOT, 1), SaveKey(ROOT, 2), SaveKey("/ckpt/other", 0))
MAX_WORLD = 5


Expected = list[tuple[str, SaveKey, int | None]]
"""Effects a call should return, as ``(event name or effect class, key, rank)``."""


@dataclass
class _Rank:
    state: RankState
    conn: int | None
    lease: float | None = None


@dataclass
class _Save:
    """The test's own account of one save, built only from inputs and observed effects."""

    world_size: int
    first_begin: float
    deadline: float | None
    state: SaveState = SaveState.OPEN
    ranks: dict[int, _Rank] = field(default_factory=dict)
    reason: str | None = None
    verifies: int = 0
    settles: int = 0
    conns: set[int] = field(default_factory=set)
    run: str = ""


RUNS = [None, None, None, "torchelastic:j:0", "torchelastic:j:1", "torchelastic:j:2", "slurm:j:1"]
"""Runs a begin names: mostly none; a launch restarted twice; an unrelated launch."""


class LedgerMachine(RuleBasedStateMachine):
    """Random begin/done/fail/disconnect/tick and promoter verdicts against a model."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.lease = LEASE
        self.timeout: float | None = None
        self.history = 4096
        self.ledger = make_ledger()
        self.world: dict[SaveKey, int] = {}
        self.saves: dict[SaveKey, _Save] = {}
        self.settled: deque[tuple[SaveKey, _Save]] = deque()
        self.to_verify: list[SaveKey] = []
        self.to_promote: list[SaveKey] = []

    @initialize(
        lease=st.sampled_from([0.5, 3.0, 10.0]),
        timeout=st.sampled_from([None, 5.0, 30.0]),
        history=st.sampled_from([1, 2, 4096]),
        worlds=st.lists(st.integers(1, MAX_WORLD), min_size=len(KEYS), max_size=len(KEYS)),
    )
    def setup(self, lease: float, timeout: float | None, history: int, worlds: list[int]) -> None:
        self.lease, self.timeout, self.history = lease, timeout, history
        self.ledger = make_ledger(lease=lease, save_timeout=timeout, history=history)
        self.world = dict(zip(KEYS, worlds, strict=True))

    # -- rules: ranks --------------------------------------------------------------------

    @rule(data=st.data(), conn=st.integers(1, 4))
    def begin(self, data: st.DataObject, conn: int) -> None:
        key = self._key(data)
        world = self.world[key]
        world_size = data.draw(st.sampled_from([world] * 6 + [1, MAX_WORLD]), label="world_size")
        rank = data.draw(st.integers(0, world_size), label="rank")
        run = data.draw(st.sampled_from(RUNS), label="run")
        self._begin(key, rank, world_size, conn, run)

    @rule(data=st.data(), conn=st.integers(1, 4))
    def report(self, data: st.DataObject, conn: int) -> None:
        """One rank reports: mostly ``done``, sometimes ``fail``."""
        key = self._key(data)
        rank = data.draw(self._rank_of(key), label="rank")
        if data.draw(st.sampled_from(["done"] * 5 + ["fail"]), label="report") == "done":
            self._done(key, rank, data.draw(st.sampled_from([(), FILES]), label="files"), conn)
        else:
            expected, error = self._expect_fail(key, rank)
            self._call(lambda: self.ledger.fail(key, rank, "boom", now=self.now), expected, error)

    @rule(data=st.data(), conn=st.integers(1, 4))
    def whole_world(self, data: st.DataObject, conn: int) -> None:
        """Every rank of the key's world begins, or every rank still writing is done.

        One input at a time, each checked; other rules still interleave between the two
        halves, but saves reach verification often enough to test what follows.
        """
        key = self._key(data)
        save = self.saves.get(key)
        world = self.world[key] if save is None else save.world_size
        if save is None or data.draw(st.booleans(), label="begin all"):
            for rank in range(world):
                self._begin(key, rank, world, conn)
        else:
            for rank, rec in sorted(save.ranks.items()):
                if rec.state is RankState.WRITING:
                    self._done(key, rank, FILES, conn)

    @rule(conn=st.integers(1, 5))
    def disconnect(self, conn: int) -> None:
        expected: Expected = []
        for key, save in sorted(self.saves.items()):
            for rank, rec in sorted(save.ranks.items()):
                if rec.conn != conn:
                    continue
                rec.conn = None
                if save.state is SaveState.OPEN and rec.state is RankState.WRITING:
                    rec.lease = self.now + self.lease
                    expected.append(("save.rank_disconnected", key, rank))
        self._call(lambda: self.ledger.disconnect(conn, now=self.now), expected, None)

    # -- rules: time ---------------------------------------------------------------------

    @rule(dt=st.sampled_from([0.0, 0.25, 1.0, 2.5, 4.0, 11.0, 40.0]))
    def tick(self, dt: float) -> None:
        """Time passes and the server's timekeeper runs."""
        self.now += dt
        expected: Expected = []
        for key in list(self.saves):
            expected += self._expire(key)
        self._call(lambda: self.ledger.tick(self.now), expected, None)

    @rule(dt=st.sampled_from([0.25, 1.0, 4.0, 11.0, 40.0]))
    def late(self, dt: float) -> None:
        """Time passes with no tick yet: the next input may find a deadline passed."""
        self.now += dt

    # -- rules: the promoter -------------------------------------------------------------

    @precondition(lambda self: bool(self.to_verify or self.to_promote))
    @rule(data=st.data())
    def promoter(self, data: st.DataObject) -> None:
        """The promoter's next verdict on one save: verified, then promoted, or rejected."""
        key = data.draw(st.sampled_from(self.to_verify + self.to_promote), label="save")
        ok = data.draw(st.sampled_from([True, True, True, False]), label="ok")
        if key in self.to_verify:
            self.to_verify.remove(key)
            if ok:
                self.saves[key].state = SaveState.PROMOTING
                self.to_promote.append(key)
                expected = [("checkpoint.promoting", key, None)]
                self._call(lambda: self.ledger.verified(key), expected, None)
                return
            reason = "verification failed"
        else:
            self.to_promote.remove(key)
            if ok:
                self.saves[key].state = SaveState.PROMOTED
                self._settle(key)
                expected = [("checkpoint.promoted", key, None), ("Settled", key, None)]
                path = f"{key.root}/step_{key.step}"
                self._call(lambda: self.ledger.promoted(key, path, self.now), expected, None)
                return
            reason = "promotion failed"
        failed = self._fail_save(key, reason)
        self._call(lambda: self.ledger.rejected(key, reason, now=self.now), failed, None)

    @rule(key=st.sampled_from(KEYS))
    def gc(self, key: SaveKey) -> None:
        """``ckptd gc --yes`` forgets a settled save; the step may then be saved again."""
        save = self.saves.get(key)
        if save is not None and save.state in (SaveState.FAILED, SaveState.PROMOTED):
            del self.saves[key]
        self.ledger.forget(key)
        self.ledger_agrees_with_the_rules()

    @rule(key=st.sampled_from(KEYS))
    def late_rejection(self, key: SaveKey) -> None:
        save = self.saves.get(key)
        if save is None or save.state in (SaveState.FAILED, SaveState.PROMOTED):
            self._call(lambda: self.ledger.rejected(key, "late", now=self.now), [], None)

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def ledger_agrees_with_the_rules(self, *, evict: bool = False) -> None:
        """After every input: the ledger's saves match the model's, and the promises hold.

        Only a save whose ranks 0..W-1 all began and are all done (none failed) is past
        OPEN; a settled save never changes again (its state and reason match the model's,
        which never moves it); at most one Verify and exactly one Settled per terminal save;
        no lease or deadline outlives an open save.
        """
        if evict:
            self._evict()
        assert {s.key for s in self.ledger} == set(self.saves)
        for key, model in self.saves.items():
            save = self.ledger.get(key)
            assert save is not None
            assert save.state is model.state, (key, save.state, model.state)
            assert save.world_size == model.world_size
            assert {r: rec.state for r, rec in save.ranks.items()} == {
                r: rec.state for r, rec in model.ranks.items()
            }
            assert save.all_done() == (not save.missing_ranks())
            if save.state in (SaveState.VERIFYING, SaveState.PROMOTING, SaveState.PROMOTED):
                assert sorted(model.ranks) == list(range(model.world_size)), "a rank never began"
                assert all(rec.state is RankState.DONE for rec in model.ranks.values())
                assert save.missing_ranks() == []
            assert model.verifies <= 1, f"{key} got {model.verifies} Verify effects"
            terminal = model.state in (SaveState.PROMOTED, SaveState.FAILED)
            assert model.settles == (1 if terminal else 0), (key, model.state, model.settles)
            if model.state is SaveState.FAILED:
                assert save.reason == model.reason
            if model.state is not SaveState.OPEN:
                assert all(rec.lease_deadline is None for rec in save.ranks.values())
        assert self.ledger.next_deadline() == self._next_deadline()

    # -- the model -----------------------------------------------------------------------

    def _key(self, data: st.DataObject) -> SaveKey:
        """Mostly a key whose save is open, where inputs change things; sometimes any."""
        open_keys = sorted(k for k, s in self.saves.items() if s.state is SaveState.OPEN)
        keys = st.sampled_from(KEYS)
        return data.draw(st.sampled_from(open_keys) | keys if open_keys else keys, label="key")

    def _begin(
        self, key: SaveKey, rank: int, world_size: int, conn: int, run: str | None = None
    ) -> None:
        if run is not None:  # as the server does: a later run first supersedes a dead one
            superseded = self._expect_supersede(key, run)
            self._call(lambda: self.ledger.supersede(key, run, self.now), superseded, None)
        expected, error = self._expect_begin(key, rank, world_size, conn, run)
        self._call(
            lambda: self.ledger.begin(key, rank, world_size, conn=conn, now=self.now, run=run),
            expected,
            error,
        )

    def _expect_supersede(self, key: SaveKey, run: str) -> Expected:
        """Only an open save of an earlier run of the same launch is superseded."""
        save = self.saves.get(key)
        if save is None or save.state is not SaveState.OPEN:
            return []
        if not run_supersedes(run, save.run):
            return []
        return [("save.superseded", key, None), *self._fail_save(key, f"superseded by run {run}")]

    def _done(self, key: SaveKey, rank: int, files: Sequence[FileEntry], conn: int) -> None:
        expected, error = self._expect_done(key, rank, files, conn)
        self._call(
            lambda: self.ledger.done(key, rank, files, conn=conn, now=self.now), expected, error
        )

    def _rank_of(self, key: SaveKey) -> st.SearchStrategy[int]:
        """Mostly a rank that began and is writing; sometimes any rank at all."""
        save = self.saves.get(key)
        writing = (
            []
            if save is None
            else [r for r, x in save.ranks.items() if x.state is RankState.WRITING]
        )
        anyone = st.integers(0, self.world[key])
        return st.sampled_from(sorted(writing)) | anyone if writing else anyone

    def _expect_begin(
        self, key: SaveKey, rank: int, world_size: int, conn: int, run: str | None = None
    ) -> tuple[Expected, ErrorCode | None]:
        if rank >= world_size:
            return [], ErrorCode.RANK_OUT_OF_RANGE
        save = self.saves.get(key)
        retried: Expected = []
        other_run = bool(run and save is not None and save.run and run != save.run)
        if (
            save is not None
            and save.state is SaveState.FAILED
            and (other_run or conn not in save.conns)
        ):
            # A process that took no part in the failed attempt (or another run's)
            # starts the step over.
            retried = [("save.retried", key, None)]
            save = None
        if save is None:
            deadline = None if self.timeout is None else self.now + self.timeout
            save = self.saves[key] = _Save(world_size, self.now, deadline, run=run or "")
        if save.world_size != world_size:
            return [], ErrorCode.WORLD_SIZE_MISMATCH
        if expired := self._expire(key):
            return expired, ErrorCode.STEP_FAILED
        rec = save.ranks.get(rank)
        if save.state is not SaveState.OPEN:
            # No writer joins a step past OPEN (only a re-sent begin of a done rank may
            # reattach, which these inputs never are).
            if save.state is SaveState.PROMOTED:
                return [], ErrorCode.ALREADY_PROMOTED
            if save.state is SaveState.FAILED:
                return [], ErrorCode.STEP_FAILED
            return [], ErrorCode.STEP_CLOSED
        if run and save.run and run != save.run:
            return [], ErrorCode.RUN_CONFLICT  # an unrelated (or earlier) run never joins
        if rec is None:
            assert save.state is SaveState.OPEN, "every rank has begun once the save is past OPEN"
            save.ranks[rank] = _Rank(RankState.WRITING, conn)
            save.conns.add(conn)
            return [*retried, ("save.begun", key, rank)], None
        save.conns.add(conn)
        if rec.conn == conn:
            return [], None
        rec.conn = conn
        if rec.lease is None:
            return [], None
        rec.lease = None
        return [("save.rank_reconnected", key, rank)], None

    def _expect_done(
        self, key: SaveKey, rank: int, files: Sequence[FileEntry], conn: int
    ) -> tuple[Expected, ErrorCode | None]:
        save = self.saves.get(key)
        rec = None if save is None else save.ranks.get(rank)
        if save is None or rec is None:
            return [], ErrorCode.NOT_BEGUN
        if rec.state is RankState.DONE:
            return [], None
        if expired := self._expire(key):
            return expired, ErrorCode.STEP_FAILED
        if save.state is SaveState.FAILED:
            return [], ErrorCode.STEP_FAILED
        rec.state, rec.conn, rec.lease = RankState.DONE, conn, None
        save.conns.add(conn)
        expected: Expected = [("save.rank_done", key, rank)]
        done = [r for r, x in save.ranks.items() if x.state is RankState.DONE]
        if sorted(done) == list(range(save.world_size)):
            save.state = SaveState.VERIFYING
            expected.append(("Verify", key, None))
            self.to_verify.append(key)
        return expected, None

    def _expect_fail(self, key: SaveKey, rank: int) -> tuple[Expected, ErrorCode | None]:
        save = self.saves.get(key)
        rec = None if save is None else save.ranks.get(rank)
        if save is None or rec is None:
            return [], ErrorCode.NOT_BEGUN
        if save.state is SaveState.FAILED:
            return [], None
        if save.state in (SaveState.PROMOTING, SaveState.PROMOTED):
            return [], ErrorCode.ALREADY_PROMOTED
        if rec.state is RankState.DONE:
            return [], ErrorCode.INVALID_STATE
        rec.state = RankState.FAILED
        return [("save.rank_failed", key, rank), *self._fail_save(key, f"rank {rank}")], None

    def _expire(self, key: SaveKey) -> Expected:
        """An open save whose lease (the lowest rank's first) or deadline has passed fails."""
        save = self.saves[key]
        if save.state is not SaveState.OPEN:
            return []
        for rank, rec in sorted(save.ranks.items()):
            if _due(rec.lease, self.now):
                rec.state = RankState.FAILED
                return [("save.rank_failed", key, rank), *self._fail_save(key, "lease")]
        if _due(save.deadline, self.now):
            return self._fail_save(key, "timed out")
        return []

    def _fail_save(self, key: SaveKey, why: str) -> Expected:
        save = self.saves[key]
        assert save.state not in (SaveState.PROMOTED, SaveState.FAILED)
        save.state = SaveState.FAILED
        save.reason = why  # a prefix, completed from the effect by _call
        for rec in save.ranks.values():
            rec.lease = None
        self._settle(key)
        return [("checkpoint.failed", key, None), ("Settled", key, None)]

    def _settle(self, key: SaveKey) -> None:
        # Evicted only once the call's effects are counted (see _evict): a save that
        # settles and is evicted within one tick must still be seen to settle once.
        self.settled.append((key, self.saves[key]))

    def _evict(self) -> None:
        while len(self.settled) > self.history:
            key, old = self.settled.popleft()
            assert old.state in (SaveState.PROMOTED, SaveState.FAILED)
            assert old.settles == 1
            # Gone from the ledger, unless it was forgotten and the step begun again since;
            # the key may start a new save later, with fresh counts.
            if self.saves.get(key) is old:
                del self.saves[key]

    def _next_deadline(self) -> float | None:
        times = [
            t
            for save in self.saves.values()
            if save.state is SaveState.OPEN
            for t in (save.deadline, *(rec.lease for rec in save.ranks.values()))
            if t is not None
        ]
        return min(times, default=None)

    def _call(
        self,
        call: Callable[[], list[Effect]],
        expected: Sequence[tuple[str, SaveKey, int | None]],
        error: ErrorCode | None,
    ) -> None:
        """Run one ledger input; check its outcome against the model's prediction."""
        try:
            effects = call()
        except RequestError as exc:
            assert exc.code is error, f"expected {error}, got {exc.code}: {exc}"
            # A refusal may carry what it changed (a save found expired on the way).
            effects = exc.effects
        else:
            assert error is None, f"expected {error}, got effects {names(effects)}"
        # A failure is reported only after its attempt's directory is set aside.
        assert not any(isinstance(e, Emit) and e.name == "checkpoint.failed" for e in effects)
        effects = flat(effects)
        got: Expected = []
        for effect in effects:
            if isinstance(effect, Emit):
                key = SaveKey(effect.fields["root"], effect.fields["step"])
                got.append((effect.name, key, effect.fields.get("rank")))
            else:
                got.append((type(effect).__name__, effect.key, None))
        assert sorted(got) == sorted(expected), f"got {got}, expected {expected}"
        for effect in effects:
            if isinstance(effect, Verify):
                self.saves[effect.key].verifies += 1
            elif isinstance(effect, Settled):
                self.saves[effect.key].settles += 1
            elif isinstance(effect, Emit) and effect.name == "checkpoint.failed":
                model = self.saves[SaveKey(effect.fields["root"], effect.fields["step"])]
                assert model.reason is not None
                assert model.reason in effect.fields["reason"], (model.reason, effect.fields)
                model.reason = effect.fields["reason"]
        self.ledger_agrees_with_the_rules(evict=True)


def _due(deadline: float | None, now: float) -> bool:
    return deadline is not None and deadline <= now


LedgerMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class TestRandomInterleavings(LedgerMachine.TestCase):  # type: ignore[misc,valid-type]
    """Random interleavings keep every promise of the ledger (see LedgerMachine)."""


class TestDoneNamingTheAttempt:
    """A done naming the open attempt proves its rank's begin, which a lost state forgot."""

    def test_accepted_as_begun_and_done(self) -> None:
        ledger = make_ledger()
        ledger.begin(KEY, 0, 2, conn=1, now=0.0, fresh="a1")
        effects = ledger.done(KEY, 1, [FileEntry("r1.bin", 5)], conn=2, now=1.0, attempt="a1")
        assert names(effects)[:2] == ["save.begun", "save.rank_done"]
        ledger.done(KEY, 0, [FileEntry("r0.bin", 5)], conn=1, now=2.0)
        assert state(ledger) is SaveState.VERIFYING

    def test_without_the_attempt_not_begun(self) -> None:
        ledger = make_ledger()
        ledger.begin(KEY, 0, 2, conn=1, now=0.0, fresh="a1")
        for attempt in (None, "other"):
            with pytest.raises(RequestError) as err:
                ledger.done(KEY, 1, [], conn=2, now=1.0, attempt=attempt)
            assert err.value.code in (ErrorCode.NOT_BEGUN, ErrorCode.STALE_ATTEMPT)

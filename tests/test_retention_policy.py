"""The retention policy, a pure function, under hypothesis: what stays, idempotence, convergence."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.retention.policy import KeepBest, Policy, StepFacts, best_step, judge, retired

NOW = 10_000.0


@st.composite
def roots(draw: st.DrawFn) -> list[StepFacts]:
    steps = draw(st.lists(st.integers(0, 60), unique=True, max_size=25))
    out = []
    for step in steps:
        scored = draw(st.booleans())
        out.append(
            StepFacts(
                step=step,
                complete=draw(st.integers(0, 5)) > 0,
                promoted_at=draw(st.floats(NOW - 200, NOW)),
                metrics={"loss": draw(st.floats(0, 5))} if scored else {},
                pinned=draw(st.integers(0, 9)) == 0,
                held_until=draw(st.none() | st.floats(NOW - 50, NOW + 50)),
            )
        )
    return out


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    best = None
    if draw(st.booleans()):
        best = KeepBest(
            k=draw(st.integers(1, 4)),
            metric="loss",
            mode=draw(st.sampled_from(["min", "max"])),
            grace_s=draw(st.sampled_from([0.0, 100.0])),
            every_steps=draw(st.none() | st.integers(1, 6)),
            unscored=draw(st.sampled_from(["grace", "worst"])),
        )
        if best.unscored == "worst":
            best = replace(best, grace_s=0.0)
    return Policy(
        keep_last=draw(st.none() | st.integers(0, 4)),
        keep_every_steps=draw(st.none() | st.integers(1, 12)),
        keep_best=best,
    )


def narrower(policy: Policy, draw: Callable[[st.SearchStrategy[Any]], Any]) -> Policy:
    """A policy that keeps no more than ``policy`` on any set of steps."""
    last = policy.keep_last
    if last is not None:
        last = draw(st.integers(0, last))
    every = policy.keep_every_steps
    if every is not None and draw(st.booleans()):
        every = every * draw(st.integers(1, 3)) if draw(st.booleans()) else None
    best = policy.keep_best
    if best is not None:
        best = None if draw(st.booleans()) else replace(best, k=draw(st.integers(1, best.k)))
    return Policy(keep_last=last, keep_every_steps=every, keep_best=best)


def pointers_of(
    steps: list[StepFacts], draw: Callable[[st.SearchStrategy[Any]], Any]
) -> dict[str, int | None]:
    names = [s.step for s in steps]
    pick = st.none() | (st.sampled_from(names) if names else st.none())
    return {"latest": draw(pick), "best": draw(pick)}


def apply(
    steps: list[StepFacts], policy: Policy, pointers: dict[str, int | None]
) -> list[StepFacts]:
    gone = {v.step for v in retired(judge(policy, steps, pointers=pointers, now=NOW))}
    return [s for s in steps if s.step not in gone]


class TestNeverRetired:
    """Whatever the policy: the newest complete, pointer targets, pinned, held, incomplete stay."""

    @settings(max_examples=400)
    @given(steps=roots(), policy=policies(), data=st.data())
    def test_protected(self, steps: list[StepFacts], policy: Policy, data: st.DataObject) -> None:
        pointers = pointers_of(steps, data.draw)
        verdicts = judge(policy, steps, pointers=pointers, now=NOW)
        gone = {v.step for v in retired(verdicts)}
        complete = [s.step for s in steps if s.complete]
        if complete:
            assert max(complete) not in gone
        for target in pointers.values():
            assert target not in gone
        for s in steps:
            if s.pinned or not s.complete or (s.held_until is not None and s.held_until > NOW):
                assert s.step not in gone
        assert [v.step for v in verdicts] == sorted(s.step for s in steps)
        for v in verdicts:
            assert bool(v.kept) == (v.retire is None)

    @given(steps=roots(), policy=policies(), data=st.data())
    def test_union_of_rules(
        self, steps: list[StepFacts], policy: Policy, data: st.DataObject
    ) -> None:
        """Each rule keeps what it says: last K complete, multiples of N, the k best."""
        pointers = pointers_of(steps, data.draw)
        kept = {v.step for v in judge(policy, steps, pointers=pointers, now=NOW) if v.kept}
        complete = sorted(s.step for s in steps if s.complete)
        if policy.keep_last:
            assert set(complete[-policy.keep_last :]) <= kept
        if policy.keep_every_steps:
            assert {n for n in complete if n % policy.keep_every_steps == 0} <= kept
        best = policy.keep_best
        if best is not None:
            every = best.every_steps or 1
            competing = [s for s in steps if s.complete and s.step % every == 0]
            scored = [s for s in competing if "loss" in s.metrics]
            sign = 1 if best.mode == "min" else -1
            ranked = sorted(scored, key=lambda s: (sign * s.metrics["loss"], -s.step))
            if ranked:
                assert best_step(policy, steps) == ranked[0].step
            else:
                assert best_step(policy, steps) is None
            if best.unscored == "worst":  # the unscored fill what is left, newest first
                unscored = [s for s in competing if "loss" not in s.metrics]
                ranked += sorted(unscored, key=lambda s: -s.step)
            assert {s.step for s in ranked[: best.k]} <= kept

    @given(steps=roots(), policy=policies(), data=st.data())
    def test_counts_complete_checkpoints_only(
        self, steps: list[StepFacts], policy: Policy, data: st.DataObject
    ) -> None:
        """Adding incomplete step_N entries changes nothing for the complete ones."""
        complete = [s for s in steps if s.complete]
        pointers = pointers_of(complete, data.draw)
        alone = judge(policy, complete, pointers=pointers, now=NOW)
        mixed = judge(policy, steps, pointers=pointers, now=NOW)
        assert [v for v in mixed if v.step in {s.step for s in complete}] == alone


class TestIdempotence:
    """Judging what is left after a pass retires nothing more."""

    @settings(max_examples=300)
    @given(steps=roots(), policy=policies(), data=st.data())
    def test_second_pass_retires_nothing(
        self, steps: list[StepFacts], policy: Policy, data: st.DataObject
    ) -> None:
        pointers = pointers_of(steps, data.draw)
        left = apply(steps, policy, pointers)
        assert retired(judge(policy, left, pointers=pointers, now=NOW)) == []
        assert best_step(policy, left) == best_step(policy, steps)


class TestConvergence:
    """After a restart with a policy that keeps less, one pass reaches that policy's result."""

    @settings(max_examples=300)
    @given(steps=roots(), policy=policies(), data=st.data())
    def test_shrunk_policy(
        self, steps: list[StepFacts], policy: Policy, data: st.DataObject
    ) -> None:
        pointers = pointers_of(steps, data.draw)
        smaller = narrower(policy, data.draw)
        before = apply(steps, policy, pointers)
        after = apply(before, smaller, pointers)
        direct = apply(steps, smaller, pointers)
        assert [s.step for s in after] == [s.step for s in direct]
        assert retired(judge(smaller, after, pointers=pointers, now=NOW)) == []


class TestKeepBestOptions:
    """``every_steps`` limits who competes; ``unscored = "worst"`` fills free places."""

    def test_parsed_and_described(self) -> None:
        from daemon.config._retention import parse_retention

        table = {"keep_best": {"k": 2, "unscored": "worst", "every_steps": 10}}
        best = parse_retention(table, "/r", "latest").policy.keep_best
        assert best == KeepBest(
            k=2, metric="", mode="max", grace_s=0.0, every_steps=10, unscored="worst"
        )
        assert best.describe() == "keep_best=2:-:max,every=10,unscored=worst"

    def test_unscored_fill_free_places_newest_first(self) -> None:
        best = KeepBest(k=3, metric="loss", mode="min", grace_s=0.0, unscored="worst")
        steps = [
            StepFacts(1, True, metrics={"loss": 0.2}),
            StepFacts(2, True),
            StepFacts(3, True),
            StepFacts(4, True),
            StepFacts(5, True),
        ]
        verdicts = judge(Policy(keep_best=best), steps, pointers={}, now=NOW)
        assert [v.step for v in verdicts if v.kept] == [1, 4, 5]
        assert best_step(Policy(keep_best=best), steps) == 1

    def test_only_multiples_compete(self) -> None:
        best = KeepBest(k=1, metric="r", mode="max", grace_s=100.0, every_steps=2)
        steps = [
            StepFacts(n, True, promoted_at=NOW, metrics={"r": float(n % 3)})
            for n in (1, 2, 3, 4, 5, 6)
        ]
        verdicts = {v.step: v for v in judge(Policy(keep_best=best), steps, pointers={}, now=NOW)}
        # 5 scores best (2.0) but does not compete; of 2, 4, 6 step 2 does (2.0).
        assert {n for n, v in verdicts.items() if v.kept} == {2, 6}
        assert "does not compete" in (verdicts[5].retire or "")
        assert best_step(Policy(keep_best=best), steps) == 2

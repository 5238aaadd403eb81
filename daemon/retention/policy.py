"""The retention policy as a pure function: which complete checkpoints a root keeps.

No I/O and no clock: :func:`judge` is given every ``step_N`` of a root with what is
known of it (complete or not, when it was promoted, its metrics, pin and hold), the
steps the root's pointers name, and the time; it says, for each step, every reason it
is kept, or, when nothing keeps it, which rules let it go.

A step is kept if any rule keeps it (a union):

- ``keep_last = K``: the K newest complete checkpoints (``last-K``);
- ``keep_every_steps = N``: complete checkpoints whose step is a multiple of N
  (``every-N``);
- ``keep_best = {k, metric, mode}``: the k complete checkpoints with the lowest
  (``min``) or highest (``max``) value of ``metric`` (``best-k``); ties go to the newer
  step. A complete checkpoint without a finite value of ``metric`` does not compete: it
  is kept (``unscored``) for ``grace_s`` seconds after its promotion, so an evaluation
  job can score it first, and after that only the other rules can keep it. Two options
  (NeMo-RL's ``keep_top_k`` needs both): ``every_steps = N`` lets only multiples of N
  compete, and ``unscored = "worst"`` ranks a step without the metric after every
  scored one (newer first) instead of granting it a grace period, so it can take a
  place among the k that no scored step fills.

Whatever the policy, these are never retired: the newest complete checkpoint
(``newest``), a pointer's target (the pointer's name, ``latest`` or ``best``), a pinned
step (``pinned``), a held step (``held``) and anything that is not a complete, promoted
checkpoint (``incomplete``). Counts (K, k) are over complete checkpoints only.

Two properties the daemon relies on (and ``tests/test_retention_policy.py`` checks):
judging the steps that are left after retiring what :func:`judge` let go retires
nothing more (idempotence), and after a restart with a policy that keeps less, one
pass reaches what that policy alone would keep (convergence).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from ..config._retention import DEFAULT_GRACE_S, KeepBest, Policy

__all__ = [
    "DEFAULT_GRACE_S",
    "KeepBest",
    "Policy",
    "StepFacts",
    "Verdict",
    "best_step",
    "judge",
    "retired",
]


@dataclass(frozen=True, slots=True)
class StepFacts:
    """What is known of one ``step_N`` directory of a root."""

    step: int
    complete: bool
    """A checkpoint this daemon promoted (its manifest is there and names this step)."""
    promoted_at: float = 0.0
    """When it was promoted (seconds, the same clock as ``now``)."""
    metrics: Mapping[str, float] = field(default_factory=dict)
    pinned: bool = False
    held_until: float | None = None
    """Until when a reader holds it (same clock as ``now``)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the policy says of one step."""

    step: int
    kept: tuple[str, ...]
    """Every reason it is kept; empty when nothing keeps it."""
    retire: str | None
    """When nothing keeps it: the rules that let it go (for people and events)."""


def _score(facts: StepFacts, metric: str) -> float | None:
    value = facts.metrics.get(metric)
    if value is None or isinstance(value, bool) or not math.isfinite(value):
        return None
    return float(value)


def _competes(best: KeepBest, s: StepFacts) -> bool:
    return best.every_steps is None or s.step % best.every_steps == 0


def _competitors(best: KeepBest, complete: Iterable[StepFacts]) -> list[StepFacts]:
    """The complete steps ``keep_best`` ranks (multiples of ``every_steps``, if set)."""
    return [s for s in complete if _competes(best, s)]


def _ranking(best: KeepBest, complete: Iterable[StepFacts]) -> list[int]:
    """Ranked competitors, best first (ties: the newer step first).

    Scored steps only, unless ``unscored = "worst"``: then the unscored ones follow
    every scored one, newest first.
    """
    competitors = _competitors(best, complete)
    scored = [(s, v) for s in competitors if (v := _score(s, best.metric)) is not None]
    sign = 1.0 if best.mode == "min" else -1.0
    scored.sort(key=lambda sv: (sign * sv[1], -sv[0].step))
    ranking = [s.step for s, _ in scored]
    if best.unscored == "worst":
        unscored = [s.step for s in competitors if _score(s, best.metric) is None]
        ranking += sorted(unscored, reverse=True)
    return ranking


def best_step(policy: Policy, steps: Iterable[StepFacts]) -> int | None:
    """The step the ``best`` pointer should name: the best scored competitor."""
    best = policy.keep_best
    if best is None:
        return None
    # Only a scored step is best; an unscored one ranks only to fill a place.
    ranking = _ranking(replace(best, unscored="grace"), [s for s in steps if s.complete])
    return ranking[0] if ranking else None


def judge(
    policy: Policy,
    steps: Iterable[StepFacts],
    *,
    pointers: Mapping[str, int | None],
    now: float,
) -> list[Verdict]:
    """Every step's verdict under ``policy``, by step.

    Args:
        policy: The root's rules.
        steps: Every ``step_N`` of the root (one entry per step).
        pointers: The step each pointer names, by the pointer's name (None: none).
        now: The time, on the clock of ``promoted_at`` and ``held_until``.
    """
    facts = sorted(steps, key=lambda s: s.step)
    complete = [s for s in facts if s.complete]
    newest = complete[-1].step if complete else None
    last: set[int] = set()
    if policy.keep_last is not None and policy.keep_last > 0:
        last = {s.step for s in complete[-policy.keep_last :]}
    ranked: dict[int, int] = {}
    best = policy.keep_best
    if best is not None:
        ranked = {step: i for i, step in enumerate(_ranking(best, complete))}
    targets: dict[int, list[str]] = {}
    for name, target in sorted(pointers.items()):
        if target is not None:
            targets.setdefault(target, []).append(name)
    verdicts: list[Verdict] = []
    for s in facts:
        kept: list[str] = []
        if not s.complete:
            kept.append("incomplete")
        if s.step == newest:
            kept.append("newest")
        kept += targets.get(s.step, [])
        if s.pinned:
            kept.append("pinned")
        if s.held_until is not None and s.held_until > now:
            kept.append("held")
        if s.complete:
            if s.step in last:
                kept.append(f"last-{policy.keep_last}")
            every = policy.keep_every_steps
            if every is not None and s.step % every == 0:
                kept.append(f"every-{every}")
            if best is not None:
                rank = ranked.get(s.step)
                if rank is not None and rank < best.k:
                    kept.append(f"best-{best.k}")
                elif rank is None and _competes(best, s) and now - s.promoted_at < best.grace_s:
                    kept.append("unscored")
        retire = None if kept else _why_not(policy, s, len(last), ranked)
        verdicts.append(Verdict(s.step, tuple(kept), retire))
    return verdicts


def retired(verdicts: Iterable[Verdict]) -> list[Verdict]:
    """The verdicts that let their step go."""
    return [v for v in verdicts if not v.kept]


def _why_not(policy: Policy, s: StepFacts, last: int, ranked: Mapping[int, int]) -> str:
    """Which rules let complete step ``s`` go, and why, for people."""
    reasons = []
    if policy.keep_last is not None:
        reasons.append(f"keep_last={policy.keep_last}: {last} newer complete checkpoints kept")
    if policy.keep_every_steps is not None:
        reasons.append(
            f"keep_every_steps={policy.keep_every_steps}: step {s.step} is not a multiple"
        )
    best = policy.keep_best
    if best is not None:
        rank = ranked.get(s.step)
        if not _competes(best, s):
            reasons.append(f"{best.describe()}: step {s.step} does not compete")
        elif rank is None:
            reasons.append(
                f"{best.describe()}: no {best.metric} within {best.grace_s:g}s of its promotion"
            )
        else:
            reasons.append(f"{best.describe()}: ranked {rank + 1}")
    return "; ".join(reasons) or "no keep rule"

"""Attempt faults: a step saved again after its first attempt died, froze or was lost.

Invariant 4a (docs/guarantees.md): a promoted ``step_N`` holds exactly the files of one
attempt, every file that attempt wrote into ``tmp_step_N`` (before or after its
``begin``) and none of an earlier, failed or dead attempt's, whether the journal survived
or not. Each scenario runs a real daemon and real 2-rank gloo jobs
(``tests/faults/_attempt_worker.py``: ``orchestrator.async_save`` and the real client),
kills, stops and continues them with real signals, and compares what ends up in
``step_N`` and in the root's trash with what each attempt's ranks said they wrote (file
names and SHA-256). Every job's tensors depend on the job, so two attempts write
different bytes under the same names and ``dcp.load`` tells whose a checkpoint holds.

- :func:`killed_and_resaved`: the job is SIGKILLed while step N's upload is held, the
  step fails by lease, a new job resumes from the newest checkpoint and saves N again,
  writing NeMo-RL's ``training_info.json`` into ``tmp_step_N`` before its ``begin``.
- :func:`journal_lost`: the daemon is SIGKILLed mid-step and restarted on an empty state
  directory (a Slurm prolog clearing it on requeue); the requeued job saves N again.
- :func:`~tests.faults.frozen.frozen_rank`: a rank is SIGSTOPped mid-upload past
  ``save_timeout``; a new job saves N and is promoted; then the frozen rank is continued.
- :func:`~tests.faults.frozen.woken_during_retry`: the same, the frozen rank continued
  while the new attempt is still being written.
- :func:`refused_save`: a job saves a promoted step again; its refused save must write
  nothing.
- :func:`~tests.faults.race.rescue_race`: many trials of ``ckptd promote`` of a failed,
  complete step racing a new job's ``begin`` of the same step (seeded timing shifts).

What every scenario checks is in :mod:`tests.faults._attempt_common`.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from tests.faults._attempt_common import (
    PRE_BEGIN,
    Checks,
    check_promoted_attempt,
    ended_cleanly,
    held_mid_upload,
    in_trash,
    is_step,
    job,
    serving,
    tree,
    wait_settled,
    written,
)
from tests.faults.frozen import frozen_rank, woken_during_retry
from tests.faults.harness import FaultDaemon, Outcome, Result, release, run_scenarios
from tests.faults.race import ASIDE, MIXED, RACE, VANISHED, rescue_race

__all__ = [
    "SCENARIOS",
    "journal_lost",
    "killed_and_resaved",
    "refused_save",
    "run_attempt_faults",
]


def _promoted_before(daemon: FaultDaemon, root: Path, step: int, checks: Checks) -> None:
    """The step the next job will resume from is promoted."""
    reply = wait_settled(daemon, root, step)
    checks.expect(reply["state"] == "promoted", f"step {step} before the fault: {reply}")


def killed_and_resaved(workdir: Path) -> Outcome:
    """A job SIGKILLed mid-save; a new job resumes and saves the same step again."""
    out = Outcome(
        "job SIGKILLed mid-save, resumed, the same step saved again",
        "step 2 fails (lease); the new job resumes from step_1 and saves step 2: promoted "
        "once, holding exactly the new attempt's files (its shards, .metadata and its "
        "pre-begin training_info.json), manifest naming the new attempt, verify passes, "
        "dcp.load gives the new job's tensors; the dead attempt's files are in the trash",
    )
    checks = Checks(out)
    gate = workdir / "gate"
    os.mkfifo(gate)
    with serving(workdir, "--lease", "1") as (daemon, root):
        args = ["--steps", "1,2", "--pre-begin", PRE_BEGIN, "--hold-rank", "1"]
        args += ["--hold-step", "2", "--hold-gate", str(gate)]
        with job(daemon, root, 1, *args) as first:
            held_mid_upload(first, 2)
            _promoted_before(daemon, root, 1, checks)
            for rank in (0, 1):
                first.signal(rank, signal.SIGKILL)
            failed = daemon.wait_event("checkpoint.failed", timeout=60, match=is_step(2))
        dead = written(first.drain(), step=2, job=1)
        settled = wait_settled(daemon, root, 2)
        dead_attempt = str(failed.get("attempt"))
        checks.expect("lease" in failed["reason"], f"step 2 failed for {failed['reason']!r}")
        checks.expect(settled["state"] == "failed", f"wait on step 2 after the kill: {settled}")
        checks.expect(PRE_BEGIN in dead and len(dead) == 2, f"the dead job wrote {sorted(dead)}")
        with job(daemon, root, 2, "--steps", "2", "--resume", "--pre-begin", PRE_BEGIN) as again:
            codes = again.wait(180)
        checks.expect(codes == [0, 0], f"the new job exited {codes}: {again.output()}")
        log = again.drain()
        checks.resumed(log, step=1, job=1)
        fresh = written(log, step=2, job=2)
        promoted = wait_settled(daemon, root, 2)
        checks.expect(promoted["state"] == "promoted", f"step 2 after the new job: {promoted}")
        attempt = check_promoted_attempt(
            checks, daemon, root, 2, job=2, files=fresh, others={dead_attempt: dead}
        )
        checks.expect(attempt != dead_attempt, "the dead attempt's id was promoted")
        trashed = in_trash(root, 2, dead_attempt)
        checks.expect(
            trashed == dead, f"trash holds {sorted(trashed)} of the dead attempt's {sorted(dead)}"
        )
        set_aside = daemon.of("save.set_aside")
        checks.expect(
            any(e.get("attempt") == dead_attempt for e in set_aside),
            f"no save.set_aside for the dead attempt: {set_aside}",
        )
        out.observed = (
            f"step 2 failed ({failed['reason']}); resumed from step_1; step_2 promoted "
            f"once with the new attempt's {len(fresh)} files; the dead attempt's "
            f"{len(trashed)} files in .ckptd-trash"
        )
    ended_cleanly(checks, daemon, [1, 2])
    return out


def journal_lost(workdir: Path) -> Outcome:
    """The daemon killed mid-step and restarted on an empty state directory."""
    out = Outcome(
        "daemon SIGKILLed mid-step, restarted on an empty state directory, step saved again",
        "the restarted daemon reports tmp_step_2 orphaned; the requeued job's begin sets "
        "it aside first (save.set_aside naming the dead attempt, by the new one); step_2 "
        "holds no file of the dead attempt, only the new attempt's, verify passes, "
        "dcp.load gives the new job's tensors",
    )
    checks = Checks(out)
    gate = workdir / "gate"
    os.mkfifo(gate)
    root = workdir / "run"
    root.mkdir()
    state = workdir / "state"
    first_daemon = FaultDaemon(workdir / "d.sock", [root], state_dir=state).start()
    try:
        args = ["--steps", "1,2", "--pre-begin", PRE_BEGIN, "--hold-rank", "1"]
        args += ["--hold-step", "2", "--hold-gate", str(gate)]
        with job(first_daemon, root, 1, *args) as first:
            held_mid_upload(first, 2)
            _promoted_before(first_daemon, root, 1, checks)
            begun = first_daemon.wait_event("save.begun", timeout=30, match=is_step(2))
            first_daemon.reap(signal.SIGKILL)  # the node goes down mid-step...
        dead = written(first.drain(), step=2, job=1)  # ...and the job with it
    finally:
        first_daemon.reap()
    dead_attempt = str(begun["attempt"])
    # The Slurm prolog clears the job's state directory when the requeued job starts.
    shutil.rmtree(state)
    state.mkdir()
    daemon = FaultDaemon(workdir / "d.sock", [root], state_dir=state)
    try:
        _requeued(daemon.start(), root, checks, dead_attempt, dead, out)
    finally:
        daemon.reap()
    ended_cleanly(checks, daemon, [2])
    return out


def _requeued(
    daemon: FaultDaemon,
    root: Path,
    checks: Checks,
    dead_attempt: str,
    dead: dict[str, str],
    out: Outcome,
) -> None:
    """The requeued job saves step 2 again on a daemon that never heard of it."""
    orphaned = daemon.of("save.orphaned")
    checks.expect(any(e.get("step") == 2 for e in orphaned), f"tmp_step_2 not orphaned: {orphaned}")
    with job(daemon, root, 2, "--steps", "2", "--resume", "--pre-begin", PRE_BEGIN) as again:
        codes = again.wait(180)
    checks.expect(codes == [0, 0], f"the requeued job exited {codes}: {again.output()}")
    log = again.drain()
    checks.resumed(log, step=1, job=1)
    fresh = written(log, step=2, job=2)
    promoted = wait_settled(daemon, root, 2)
    checks.expect(promoted["state"] == "promoted", f"step 2 after the requeued job: {promoted}")
    aside = [e for e in daemon.of("save.set_aside") if e.get("step") == 2]
    by = {e.get("by_attempt") for e in aside if e.get("attempt") == dead_attempt}
    trashed = in_trash(root, 2, dead_attempt)
    # Documented limit (guarantees 4a): a pre-begin file written into a directory that
    # still carries the dead attempt's marker goes aside with the dead attempt's files.
    early_aside = trashed.get(PRE_BEGIN) == fresh.get(PRE_BEGIN)
    kept = {k: v for k, v in fresh.items() if not (k == PRE_BEGIN and early_aside)}
    attempt = check_promoted_attempt(
        checks, daemon, root, 2, job=2, files=kept, others={dead_attempt: dead}
    )
    checks.expect(
        by == {attempt}, f"save.set_aside of {dead_attempt} by {by}, not by {attempt}: {aside}"
    )
    # Written by path over the dead job's own file of that name, in its directory.
    expected = {**dead, PRE_BEGIN: fresh[PRE_BEGIN]} if early_aside else dead
    checks.expect(
        trashed == expected, f"trash holds {sorted(trashed)}, expected {sorted(expected)}"
    )
    out.evidence["pre_begin_set_aside"] = early_aside
    where = (
        "written over the dead attempt's in its marked directory and set aside with it "
        "(the documented limit)"
    )
    out.observed = (
        f"tmp_step_2 orphaned, set aside by the new attempt; step_2 promoted with "
        f"{len(kept)} files, none of the dead attempt's; the requeued job's {PRE_BEGIN}: "
        + (where if early_aside else "in step_2")
    )


def refused_save(workdir: Path) -> Outcome:
    """A save whose ``begin`` is refused writes nothing (the client stops it)."""
    out = Outcome(
        "a job saves a promoted step again; its begin is refused",
        "the begin gets already_promoted and the save stops before a byte is written "
        "(guarantees 4a: the client's planner raises in DCP's planning step); step_1 "
        "unchanged; no tmp_step_1 appears",
    )
    checks = Checks(out)
    (gate,) = _fifos(workdir, "gate")
    with serving(workdir) as (daemon, root):
        args = ("--steps", "1,1", "--pause-before", "1", "--gate", str(gate))
        with job(daemon, root, 1, *args) as again:
            again.wait_line("held", rank=0, at="step1", timeout=120)
            release(gate)
            promoted = wait_settled(daemon, root, 1)
            before = tree(root / "step_1")
            again.wait_line("held", rank=0, at="step1", timeout=120)
            release(gate)  # the same step once more, as a job restarted from step 0 would
            codes = again.wait(180)
        log = again.drain()
        begins = [(x["rank"], x["acked"], x["code"]) for x in log if x.get("event") == "begun"]
        checks.expect(promoted["state"] == "promoted", f"step 1: {promoted}")
        checks.expect(
            sorted(begins[2:]) == [(0, False, "already_promoted"), (1, False, "already_promoted")],
            f"begins: {begins}",
        )
        checks.expect(tree(root / "step_1") == before, "step_1 changed")
        checks.expect(codes == [0, 0], f"the job exited {codes}: {again.output()}")
        stray = sorted(tree(root / "tmp_step_1")) if (root / "tmp_step_1").exists() else []
        checks.finding(not stray, f"the refused save wrote tmp_step_1/{stray}")
    ended_cleanly(checks, daemon, [1])
    out.observed = (
        f"begins refused ({', '.join(sorted({str(b[2]) for b in begins if b[2]}))}); "
        f"step_1 unchanged; the refused save wrote {stray or 'nothing'}"
    )
    return out


def _fifos(workdir: Path, *names: str) -> list[Path]:
    paths = [workdir / n for n in names]
    for path in paths:
        os.mkfifo(path)
    return paths


SCENARIOS: dict[str, Callable[[Path], Outcome]] = {
    "killed_and_resaved": killed_and_resaved,
    "journal_lost": journal_lost,
    "frozen_rank": frozen_rank,
    "woken_during_retry": woken_during_retry,
    "refused_save": refused_save,
}
"""The attempt scenarios run once per round (the rescue race has its own trial count)."""


def run_attempt_faults(
    workdir: Path,
    rounds: int = 1,
    race_trials: int = 50,
    *,
    seed: int = 0,
    progress: Callable[[str], None] = lambda _m: None,
) -> Result:
    """Run every attempt scenario, and a rescue race of ``race_trials``, ``rounds`` times.

    Each round's race draws from its own seed (``seed + round``).
    """
    result = run_scenarios("attempts", SCENARIOS, workdir, rounds, progress)
    for round_ in range(rounds):
        race = partial(rescue_race, trials=race_trials, seed=seed + round_, progress=progress)
        where = workdir / f"race-{round_}"
        where.mkdir()
        ran = run_scenarios("attempts", {"rescue_race": race}, where, 1, progress)
        for outcome in ran.outcomes:
            result.add(outcome)
        result.seconds += ran.seconds
    trials = [t for o in result.outcomes for t in o.evidence.get("trials", [])]
    winners = Counter(t["winner"] for t in trials)
    early = Counter(t["pre_begin"] for t in trials if t["pre_begin"] != "none")
    result.figures.update(
        {
            f"scenario runs ({len(SCENARIOS)} scenarios)": sum(
                o.name != RACE for o in result.outcomes
            ),
            "rescue race trials": len(trials),
            "won by the rescue": winners["rescue"],
            "won by the new attempt": winners["new attempt"],
            "new begins refused": dict(Counter(c for t in trials for c in _codes(t["begins"]))),
            "rescues refused": dict(
                Counter(t["rescue"] for t in trials if t["winner"] != "rescue")
            ),
            f"new job's {PRE_BEGIN} written before its begin": dict(early),
            "race trials showing the rescue finding (Findings)": sum(
                t["pre_begin"] in (MIXED, ASIDE, VANISHED) for t in trials
            ),
            "of which promoted checkpoints failing verify": sum(
                "fails verify" in f
                for o in result.outcomes
                if o.name == RACE
                for f in o.evidence.get("findings", [])
            ),
            "runs showing a standing finding (Findings)": dict(
                Counter(o.name for o in result.outcomes if o.evidence.get("findings"))
            ),
        }
    )
    return result


def _codes(begins: Any) -> list[str]:
    return [] if begins == "acknowledged" else list(begins)

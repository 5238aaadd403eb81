"""Frozen ranks: a rank SIGSTOPped mid-upload past ``save_timeout``, continued later.

ckptd cannot fence a writer it no longer hears from (docs/guarantees.md, 4a, Limits).
What it promises: the frozen attempt fails and its directory is set aside while the rank
is stopped; its late reports are refused once it wakes; a new attempt's promoted step is
never changed by it. What it does not promise: where the woken rank's writes by path
land. Both scenarios check the first and report the second.

- :func:`frozen_rank`: the rank is continued after the new attempt was promoted.
- :func:`woken_during_retry`: the rank is continued while the new attempt is still being
  written (its rank 1 held before its shards).
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

from daemon import verify_checkpoint
from tests.faults._attempt_common import (
    Checks,
    check_promoted_attempt,
    conns_of,
    digests,
    ended_cleanly,
    held_mid_upload,
    in_trash,
    is_step,
    job,
    serving,
    tree,
    wait_settled,
    whose_tensors,
    written,
)
from tests.faults.harness import FaultDaemon, Outcome, Ranks, release

__all__ = ["frozen_rank", "woken_during_retry"]

# What a late report of a replaced attempt may be answered with: refused, whichever
# check the daemon reaches first (a client naming its attempt gets stale_attempt).
_LATE_REFUSALS = frozenset(
    {"stale_attempt", "step_failed", "already_promoted", "invalid_state", "not_begun"}
)

_HOLD = ("--steps", "1", "--hold-rank", "1", "--hold-step", "1", "--hold-gate")


def _config(workdir: Path, save_timeout: int) -> Path:
    config = workdir / "ckptd.toml"
    config.write_text(f"save_timeout = {save_timeout}\n")
    return config


def _fifos(workdir: Path, *names: str) -> list[Path]:
    paths = [workdir / n for n in names]
    for path in paths:
        os.mkfifo(path)
    return paths


def _stopped_past_timeout(
    daemon: FaultDaemon, root: Path, frozen: Ranks, gate: Path, checks: Checks
) -> tuple[str, dict[str, str], str]:
    """Stop rank 1 mid-upload until step 1 times out and is set aside.

    Returns:
        The frozen attempt's id, the files its ranks wrote, the failure's reason.
    """
    held_mid_upload(frozen, 1)
    frozen.freeze(1)
    release(gate)  # taken up only once the rank runs again
    failed = daemon.wait_event("checkpoint.failed", timeout=60, match=is_step(1))
    settled = wait_settled(daemon, root, 1)
    dead = written(frozen.drain(), step=1, job=1)
    dead_attempt = str(failed.get("attempt"))
    checks.expect("timed out" in failed["reason"], f"step 1 failed: {failed['reason']}")
    checks.expect(settled["state"] == "failed", f"wait on step 1: {settled}")
    trashed = in_trash(root, 1, dead_attempt)
    checks.expect(trashed == dead, f"trash {sorted(trashed)}, stopped job {sorted(dead)}")
    return dead_attempt, dead, str(failed["reason"]).split(";")[0]


def _late_refusals(daemon: FaultDaemon, frozen: Ranks, mark: int) -> Counter[str]:
    """Refusals the daemon sent on the frozen job's connections since event ``mark``."""
    mine = conns_of(daemon, [p.pid for p in frozen.procs])
    late = [e for e in daemon.drain()[mark:] if e["event"] == "request.rejected"]
    return Counter(str(e["code"]) for e in late if e.get("conn") in mine)


def _reports(log: list[dict[str, Any]]) -> int:
    """How many of step 1's uploads ended on the frozen job's ranks (each one reports)."""
    return sum(1 for x in log if x.get("event") == "upload" and x["step"] == 1)


def frozen_rank(workdir: Path) -> Outcome:
    """A rank SIGSTOPped past ``save_timeout``; a new attempt promotes; then SIGCONT."""
    out = Outcome(
        "rank SIGSTOPped mid-upload past save_timeout, the step saved again, then SIGCONT",
        "step 1 fails (timed out) while the rank is stopped and its directory is set "
        "aside; a new job's attempt is promoted with exactly its files; after SIGCONT the "
        "stopped job's late reports are refused and step_1 is unchanged (names, sizes, "
        "SHA-256); guarantees 4a's limit: a woken writer writes by path, where it lands "
        "is reported",
    )
    checks = Checks(out)
    gate, start = _fifos(workdir, "gate", "start")
    config = _config(workdir, 4)
    with serving(workdir, "--lease", "1", "--config", str(config)) as (daemon, root):
        # The next job starts now and waits before its save: its start-up overlaps the wait.
        ready = ("--steps", "1", "--pause-before", "1", "--gate", str(start))
        with (
            job(daemon, root, 1, *_HOLD, str(gate)) as frozen,
            job(daemon, root, 2, *ready) as again,
        ):
            dead_attempt, dead, reason = _stopped_past_timeout(daemon, root, frozen, gate, checks)
            again.wait_line("held", rank=0, at="step1", timeout=120)
            release(start)
            codes = again.wait(180)
            checks.expect(codes == [0, 0], f"the new job exited {codes}: {again.output()}")
            fresh = written(again.drain(), step=1, job=2)
            promoted = wait_settled(daemon, root, 1)
            checks.expect(promoted["state"] == "promoted", f"step 1: {promoted}")
            attempt = check_promoted_attempt(
                checks, daemon, root, 1, job=2, files=fresh, others={dead_attempt: dead}
            )
            before = tree(root / "step_1")
            around = {p for p in tree(root) if not p.startswith("step_1/")}
            mark = len(daemon.drain())
            frozen.signal(1, signal.SIGCONT)
            codes = frozen.wait(180)
        log = frozen.drain()
        after = tree(root / "step_1")
        checks.expect(after == before, f"step_1 changed after SIGCONT: {_diff(before, after)}")
        refused = _late_refusals(daemon, frozen, mark)
        reported = _reports(log)
        checks.expect(
            sum(refused.values()) >= reported and set(refused) <= _LATE_REFUSALS,
            f"late reports of the stopped job: {reported} uploads ended, refusals {dict(refused)}",
        )
        accepted = [
            e
            for e in daemon.drain()[mark:]
            if e["event"] in ("save.rank_done", "save.rank_failed", "save.begun")
        ]
        checks.expect(not accepted, f"a late report of the stopped job changed state: {accepted}")
        checks.expect(codes == [0, 0], f"the stopped job exited {codes}: {frozen.output()}")
        state = daemon.request("status", root=str(root))["saves"]
        now = [(s["state"], s.get("attempt")) for s in state if s["step"] == 1]
        checks.expect(now == [("promoted", attempt)], f"step 1 after SIGCONT: {now}")
        landed = _late_writes(log, root, around)
        out.evidence["late_writes"] = landed
        out.observed = (
            f"step 1 {reason}; new attempt promoted; after SIGCONT: late "
            f"reports refused {dict(refused)}; step_1 unchanged ({len(after)} files); the "
            f"woken rank's writes: {landed}"
        )
    ended_cleanly(checks, daemon, [1])
    return out


def woken_during_retry(workdir: Path) -> Outcome:
    """A rank SIGSTOPped past ``save_timeout``, continued while the new attempt is open."""
    out = Outcome(
        "rank SIGSTOPped mid-upload past save_timeout, SIGCONT while the step is saved again",
        "step 1 fails (timed out) while the rank is stopped and its directory is set "
        "aside; a new job begins a new attempt and holds its rank 1 before its shards; "
        "after SIGCONT the stopped job's late reports are refused and change nothing of "
        "the new attempt, which is then promoted once, verified, as its own attempt; "
        "guarantees 4a's limit: the woken rank's writes by path land in the new "
        "attempt's tmp_step_1, where they are reported",
    )
    checks = Checks(out)
    gate, start, second = _fifos(workdir, "gate", "start", "second")
    config = _config(workdir, 5)
    with serving(workdir, "--lease", "1", "--config", str(config)) as (daemon, root):
        ready = ("--pause-before", "1", "--gate", str(start))
        with (
            job(daemon, root, 1, *_HOLD, str(gate)) as frozen,
            job(daemon, root, 2, *_HOLD, str(second), *ready) as again,
        ):
            dead_attempt, dead, reason = _stopped_past_timeout(daemon, root, frozen, gate, checks)
            again.wait_line("held", rank=0, at="step1", timeout=120)
            release(start)
            held_mid_upload(again, 1)  # the new attempt is open, its rank 1 not yet written
            begun = [e for e in daemon.of("save.begun") if e.get("attempt") != dead_attempt]
            attempt = str(begun[0]["attempt"]) if begun else ""
            checks.expect(len(begun) == 2, f"the new job's begins: {begun}")
            mark = len(daemon.drain())
            frozen.signal(1, signal.SIGCONT)
            codes = frozen.wait(180)
            log = frozen.drain()
            refused = _late_refusals(daemon, frozen, mark)
            reported = _reports(log)
            early = [
                e
                for e in daemon.drain()[mark:]
                if e["event"] in ("save.rank_done", "checkpoint.promoted", "checkpoint.failed")
            ]
            release(second)
            codes += again.wait(180)
        checks.expect(codes == [0] * 4, f"jobs exited {codes}: {frozen.output()} {again.output()}")
        checks.finding(
            sum(refused.values()) >= reported and set(refused) <= _LATE_REFUSALS and not early,
            f"the stopped job's late reports were taken by the new attempt {attempt}: "
            f"{reported} uploads ended, refusals {dict(refused)}, then {early}",
        )
        fresh = written(again.drain(), step=1, job=2)
        late = written(log, step=1, job=1)
        mixed = sorted(k for k, v in digests(root / "step_1").items() if late.get(k) == v)
        # Were the late reports refused, the new attempt's own writes would replace the
        # woken rank's same-named files: a mix here follows from the finding above.
        checks.finding(not mixed, f"step_1 holds the stopped job's {mixed}")
        if not mixed:
            check_promoted_attempt(
                checks, daemon, root, 1, job=2, files=fresh, others={dead_attempt: dead}
            )
        else:
            promoted = wait_settled(daemon, root, 1)
            checks.expect(promoted.get("attempt") == attempt, f"step 1: {promoted}")
            problems = verify_checkpoint(str(root / "step_1"))
            checks.expect(problems == [], f"step_1 fails verify: {problems[:3]}")
        owners = whose_tensors(root / "step_1", 1, (1, 2))
    ended_cleanly(checks, daemon, [1])
    extra = {k: v for k, v in late.items() if dead.get(k) != v}
    into = sorted(
        {
            os.path.relpath(x["dir"], root)
            for x in log
            if x.get("event") == "wrote" and set(x["files"]) & set(extra)
        }
    )
    out.evidence["late_writes"] = extra
    out.observed = (
        f"step 1 {reason}; after SIGCONT the woken rank wrote {sorted(extra)} by path into "
        f"{into}; late reports refused {dict(refused)}"
        + (f", accepted: {[e['event'] for e in early]}" if early else "")
        + f"; step_1 holds the stopped job's {mixed or 'nothing'}; dcp.load of step_1 "
        f"gives ranks 0 and 1 the tensors of jobs {owners} (2: the new job)"
    )
    return out


def _diff(before: dict[str, Any], after: dict[str, Any]) -> str:
    changed = sorted(k for k in before.keys() & after.keys() if before[k] != after[k])
    added, gone = sorted(after.keys() - before.keys()), sorted(before.keys() - after.keys())
    return f"added {added}, removed {gone}, changed {changed}"


def _late_writes(log: list[dict[str, Any]], root: Path, around: set[str]) -> str:
    """Where a woken rank's writes went: what it said, and what appeared in the root."""
    failed = [x for x in log if x.get("event") == "write_failed"]
    wrote = [x for x in log if x.get("event") == "wrote" and x["rank"] == 1]
    new = sorted(p for p in tree(root) if not p.startswith("step_1/") and p not in around)
    parts = [
        f"{x['stage']} by path into {os.path.relpath(x['dir'], root)} failed: {x['error'][:80]}"
        for x in failed
    ]
    parts += [f"wrote {sorted(x['files'])} into {os.path.relpath(x['dir'], root)}" for x in wrote]
    parts.append(f"new files in the root: {new or 'none'}")
    return "; ".join(parts)

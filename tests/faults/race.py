"""A rescue racing a re-save: ``ckptd promote`` and a new job's ``begin`` of one step.

A failed step whose files are complete (a DCP directory with ``.metadata``) may be
rescued by an operator (``ckptd promote``) at the instant a new job saves the same step
again. Exactly one of the two must take the step: the rescue promotes the failed
attempt's files and the new ``begin`` is refused, or the new attempt takes the step and
the rescue is refused; never a mix, never twice. Many trials, each shifting the two
requests against each other by a seeded random offset.
"""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.conftest import LineClient
from tests.faults._attempt_common import (
    PRE_BEGIN,
    Checks,
    check_promoted_attempt,
    digests,
    ended_cleanly,
    in_trash,
    is_step,
    job,
    serving,
    wait_settled,
    written,
)
from tests.faults.harness import FaultDaemon, Outcome, Ranks, release

__all__ = ["ASIDE", "IN_STEP", "LOST", "MIXED", "RACE", "STRAY", "VANISHED", "rescue_race"]

RACE = "ckptd promote of a failed, complete step racing a new job's begin"
"""The rescue race's scenario name."""

# Where the new job's pre-begin file ended up, in a trial that wrote one.
IN_STEP = "in the new attempt's step_N"
MIXED = "promoted with the rescued attempt (Findings)"
ASIDE = "set aside with the rescued attempt's directory (Findings)"
STRAY = "left in a new tmp_step_N beside the rescued step_N"
VANISHED = "not written: tmp_step_N went away under the write (Findings)"
LOST = "lost"

# What a rescue may answer here; "internal" is a standing finding (a scan of files that
# change under it), anything else a violation.
_RESCUE_ANSWERS = frozenset(
    {"promoted", "unverifiable", "invalid_state", "already_promoted", "internal"}
)


def rescue_race(
    workdir: Path,
    trials: int = 20,
    seed: int = 0,
    progress: Callable[[str], None] = lambda _m: None,
) -> Outcome:
    """``ckptd promote`` of a failed, complete step racing a new job's ``begin``; many trials.

    Two long-lived real 2-rank jobs share one daemon and root. For trial k (step k) the
    first job saves step k completely and then reports ``fail`` (a trainer failing after
    its writes landed): the step is failed, and its files, a DCP directory with
    ``.metadata``, are set aside. Then a rescue (``promote``, from a thread of the
    harness) and the second job's save of step k are released together, the rescue
    shifted by a seeded random offset (within 5 ms of the release in half the trials,
    within 30 ms in the others); in a seeded half of the trials the second job first
    writes its ``training_info.json`` into ``tmp_step_k``, as NeMo-RL does.
    """
    out = Outcome(
        RACE,
        "each trial ends one way: the rescue promotes the failed attempt's files and the "
        "new begin is refused, or the new attempt takes the step and the rescue is "
        "refused; never both, never neither; step_N promoted once, its manifest naming "
        "the winner, every file the winner's, verify passes, dcp.load gives the "
        "winner's tensors; the loser's files are not in step_N",
    )
    _Race(workdir, trials, random.Random(seed), out, progress).run()
    return out


class _Race:
    """One rescue-race campaign: two jobs, one daemon, ``trials`` steps."""

    def __init__(
        self,
        workdir: Path,
        trials: int,
        rng: random.Random,
        out: Outcome,
        progress: Callable[[str], None],
    ) -> None:
        self.workdir, self.trials, self.rng, self.out = workdir, trials, rng, out
        self.progress = progress
        self.checks = Checks(out)
        self.winners: Counter[str] = Counter()
        self.begin_codes: Counter[str] = Counter()
        self.rescue_codes: Counter[str] = Counter()
        self.early: Counter[str] = Counter()
        self.log: list[dict[str, Any]] = []

    def run(self) -> None:
        gates = [self.workdir / "gate1", self.workdir / "gate2"]
        for gate in gates:
            os.mkfifo(gate)
        steps = range(1, self.trials + 1)
        early = {s for s in steps if self.rng.random() < 0.5}
        listed = ",".join(map(str, steps))
        first = ["--steps", listed, "--pause-before", "all", "--gate", str(gates[0])]
        second = ["--steps", listed, "--pause-before", "all", "--gate", str(gates[1])]
        second += ["--skip-refused", "--pre-begin", PRE_BEGIN]
        second += ["--pre-begin-steps", ",".join(map(str, sorted(early))) or "0"]
        with serving(self.workdir) as (daemon, root):
            with (
                job(daemon, root, 1, *first, "--fail-steps", "all") as failing,
                job(daemon, root, 2, *second) as retrying,
            ):
                for step in steps:
                    self.trial(daemon, root, (failing, retrying), gates, step, step in early)
                    if step % 50 == 0:
                        self.progress(
                            f"attempts: rescue race: {step}/{self.trials} trials, "
                            f"{len(self.out.violations)} violations"
                        )
                codes = [*failing.wait(180), *retrying.wait(180)]
            self.checks.expect(codes == [0] * 4, f"jobs exited {codes}: {retrying.output()}")
        ended_cleanly(self.checks, daemon, steps, internal=self.rescue_codes["internal"])
        self.out.evidence["trials"] = self.log
        self.out.evidence["pre_begin"] = dict(self.early)
        self.out.observed = (
            f"{self.trials} trials won by {dict(self.winners)}; new begins refused with "
            f"{dict(self.begin_codes)}; rescues refused with {dict(self.rescue_codes)}; "
            f"the new job's {PRE_BEGIN}: {dict(self.early)}"
        )

    def trial(
        self,
        daemon: FaultDaemon,
        root: Path,
        jobs: tuple[Ranks, Ranks],
        gates: list[Path],
        step: int,
        early: bool,
    ) -> None:
        """Fail step ``step`` with complete files, then release the rescue and the re-save."""
        failing, retrying = jobs
        failing.wait_line("held", rank=0, at=f"step{step}", timeout=120)
        release(gates[0])
        failed = daemon.wait_event("checkpoint.failed", timeout=120, match=is_step(step))
        old = str(failed["attempt"])
        settled = wait_settled(daemon, root, step)
        self.checks.expect(settled["state"] == "failed", f"step {step} before the race: {settled}")
        dead = written(failing.drain(), step=step, job=1)
        self.checks.expect(
            in_trash(root, step, old) == dead and ".metadata" in dead,
            f"step {step}: the failed attempt's complete files are not all in the trash",
        )
        retrying.wait_line("held", rank=0, at=f"step{step}", timeout=120)
        # The trial's input: > 0, the rescue goes later. Half the trials stay close to
        # the release, where the two requests reach the daemon within a few ms.
        spread = 0.005 if self.rng.random() < 0.5 else 0.03
        offset = self.rng.uniform(-spread, spread)
        rescue = _Rescue(daemon, root, step)
        start = threading.Barrier(2)
        rescue.start(start, max(0.0, offset))
        start.wait()
        time.sleep(max(0.0, -offset))  # the trial's seeded input, not a wait for anything
        release(gates[1])
        reply = rescue.result()
        begins = [retrying.wait_line("begun", rank=r, step=step, timeout=120) for r in (0, 1)]
        ending = "upload" if all(b["acked"] for b in begins) else "skipped"
        for r in (0, 1):
            retrying.wait_line(ending, rank=r, step=step, timeout=120)
        final = wait_settled(daemon, root, step)
        self.checks.expect(final["state"] == "promoted", f"step {step} settled as {final}")
        log = retrying.drain()
        fresh = written(log, step=step, job=2)
        vanished = any(
            x.get("event") == "write_failed" and x["step"] == step and x["stage"] == "pre_begin"
            for x in log
        )
        self.judge(daemon, root, step, (old, dead), fresh, reply, begins, vanished=vanished)
        self.log[-1].update(offset_ms=round(offset * 1000, 1))

    def judge(
        self,
        daemon: FaultDaemon,
        root: Path,
        step: int,
        failed: tuple[str, dict[str, str]],
        fresh: dict[str, str],
        reply: dict[str, Any],
        begins: list[dict[str, Any]],
        *,
        vanished: bool,
    ) -> None:
        """Exactly one of the two took the step, and ``step_N`` is wholly the winner's.

        ``vanished``: the new job's pre-begin write failed, its directory gone under it.
        """
        checks, (old, dead) = self.checks, failed
        rescued = bool(reply.get("ok")) and reply.get("state") == "promoted"
        began = all(b["acked"] for b in begins)
        refused = sorted({str(b["code"]) for b in begins if not b["acked"]})
        checks.expect(
            rescued != began, f"step {step}: rescue {reply}, begins {begins}: not one outcome"
        )
        rescue = str(reply.get("state") if reply.get("ok") else reply["error"]["code"])
        if not rescued:
            self.rescue_codes[rescue] += 1
        checks.expect(rescue in _RESCUE_ANSWERS, f"step {step}: the rescue answered {reply}")
        checks.finding(rescue != "internal", f"step {step}: the rescue answered {reply}")
        self.begin_codes.update(refused)
        where = VANISHED if vanished else self._early_file(root, step, fresh, old, rescued=rescued)
        if where != "none":
            self.early[where] += 1
        checks.finding(
            where not in (MIXED, ASIDE, VANISHED), f"step {step}: the new job's {PRE_BEGIN} {where}"
        )
        early = {k: v for k, v in fresh.items() if k == PRE_BEGIN}
        if rescued:
            self.winners["rescue"] += 1
            files = {**dead, **(early if where == MIXED else {})}
            others = {"the refused job": {k: v for k, v in fresh.items() if k not in files}}
            mixed = frozenset(early) if where == MIXED else frozenset()
            attempt = check_promoted_attempt(
                checks, daemon, root, step, job=1, files=files, others=others, found=mixed
            )
            checks.expect(attempt == old, f"step {step}: rescued, but the manifest names {attempt}")
        else:
            self.winners["new attempt"] += 1
            kept = {k: v for k, v in fresh.items() if not (k == PRE_BEGIN and where == ASIDE)}
            check_promoted_attempt(
                checks, daemon, root, step, job=2, files=kept, others={old: dead}
            )
            aside = in_trash(root, step, old)
            theirs = {k: v for k, v in aside.items() if early.get(k) != v}
            checks.expect(theirs == dead, f"step {step}: the failed attempt's files left the trash")
        checks.expect(where != LOST, f"step {step}: the new job's {PRE_BEGIN} is nowhere")
        checks.expect(
            not (root / f"tmp_step_{step}").exists(), f"step {step}: tmp_step_{step} left behind"
        )
        self.log.append(
            {
                "step": step,
                "winner": "rescue" if rescued else "new attempt",
                "rescue": rescue,
                "rescue_message": None if reply.get("ok") else reply["error"]["message"][:200],
                "begins": refused or "acknowledged",
                "pre_begin": where,
            }
        )

    def _early_file(
        self, root: Path, step: int, fresh: dict[str, str], old: str, *, rescued: bool
    ) -> str:
        """Where the new job's pre-begin file ended up ("none" if it wrote none)."""
        mine = fresh.get(PRE_BEGIN)
        if mine is None:
            return "none"
        if digests(root / f"step_{step}").get(PRE_BEGIN) == mine:
            return MIXED if rescued else IN_STEP
        if in_trash(root, step, old).get(PRE_BEGIN) == mine:
            return ASIDE
        stray = root / f"tmp_step_{step}"
        if digests(stray).get(PRE_BEGIN) == mine:
            shutil.rmtree(stray)  # a refused trainer's leftover, which gc would remove
            return STRAY
        return LOST


class _Rescue:
    """A ``promote`` request sent from a thread the moment a barrier releases it."""

    def __init__(self, daemon: FaultDaemon, root: Path, step: int) -> None:
        self._client = LineClient(daemon.socket_path, timeout=120)
        self._root, self._step = root, step
        self._reply: dict[str, Any] = {}
        self._thread: threading.Thread | None = None

    def start(self, barrier: threading.Barrier, delay: float) -> None:
        """Send the rescue ``delay`` seconds after ``barrier`` releases."""

        def go() -> None:
            barrier.wait()
            time.sleep(delay)  # the trial's seeded input, not a wait for anything
            self._reply = self._client.request(
                "promote", root=str(self._root), step=self._step, timeout=60
            )

        self._thread = threading.Thread(target=go, daemon=True)
        self._thread.start()

    def result(self) -> dict[str, Any]:
        """The rescue's reply."""
        assert self._thread is not None
        self._thread.join(120)
        self._client.close()
        assert not self._thread.is_alive(), "the rescue got no reply"
        return self._reply

"""Kill campaign: SIGKILL the daemon under a streaming 2-rank DCP job, restart, check.

The daemon is killed at random instants while a real job streams saves through it,
restarted on the same journal, and the invariants are checked after every trial.

One real job (``tests/faults/_worker.py --stream``) saves step after step for the whole
campaign; starting a torch job per trial would cost seconds each. Each trial ends one
daemon run, in one of three ways drawn from a seeded RNG:

- ``random``: SIGKILL at a uniformly random instant after ``daemon.ready``;
- ``startup``: SIGKILL at a random instant after exec, often before ``daemon.ready``,
  i.e. during journal replay, compaction and resumed promotions;
- ``crash``: the run was started with ``CKPTD_CRASH_AT=<point>:<n>`` and dies by itself
  (``os._exit(137)``) the n-th time promotion reaches that point, the narrow windows a
  random instant rarely hits.

After each trial, with no daemon running, the root must be at rest in a valid state
(:func:`tests.faults.harness.check_root_at_rest`). After each restart that reaches
``daemon.ready`` without a crash point pending, every change the ranks saw acknowledged
must be in the daemon's state. At the end every step both ranks completed must be
promoted exactly once, load with ``dcp.load`` to exactly the saved tensors, and a final
restart must find nothing left to do.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from daemon.base._faults import POINTS
from tests._dcp_worker import state_for
from tests.conftest import LineClient
from tests.faults.harness import FaultDaemon, Ranks, Result, check_root_at_rest, step_dirs
from tests.faults.harness import stateless as harness_stateless

__all__ = ["run_kill_campaign"]

_WORLD = 2
_NUMEL = 256
_SETTLE_S = 120.0
"""Seconds the end of the campaign waits for each step completed by every rank to settle."""
_RESEND_S = 15.0
"""Seconds a stateless run gives the ranks to reconnect and re-send their saves."""


class _Campaign:
    """State carried across the daemon runs of one kill campaign."""

    def __init__(
        self,
        workdir: Path,
        rng: random.Random,
        progress: Callable[[str], None],
        *,
        stateless: bool = False,
    ):
        self.workdir = workdir
        self.stateless = stateless
        self.root = workdir / "run"
        self.root.mkdir()
        self.rng = rng
        self.progress = progress
        self.result = Result("kill")
        self.runs = 0
        self.daemon: FaultDaemon | None = None
        self.verified: set[int] = set()
        self.loaded: set[int] = set()
        self.promoted_by: dict[int, int] = {}
        self.failed: dict[int, str] = {}
        self.kinds: Counter[str] = Counter()
        self.points: Counter[str] = Counter()
        self.mid_promotion = 0
        self.before_ready = 0
        self.resumed = 0
        self.acked: set[tuple[int, int, str]] = set()
        self.settled: set[int] = set()
        self.reported: set[str] = set()

    # -- daemon runs -----------------------------------------------------------------

    def launch(self, env: dict[str, str]) -> FaultDaemon:
        self.runs += 1
        state = self.workdir / "state"
        if self.stateless and state.exists():
            # A requeue's prolog, or a pod's emptyDir: the next run knows only the root.
            shutil.rmtree(state)
        daemon = FaultDaemon(
            self.workdir / "d.sock", [self.root], state_dir=self.workdir / "state", env=env
        )
        self.daemon = daemon.launch()
        return daemon

    def end_run(self, daemon: FaultDaemon, *, killed: bool = False) -> None:
        """Reap a dead (or to-be-killed) run and account for what it did.

        ``killed``: this run ended by the harness's SIGKILL at a random instant (for the
        figures: how many such kills landed mid-promotion or before readiness).
        """
        code = daemon.reap(signal.SIGKILL)
        if code not in (-signal.SIGKILL, 137, 0):
            self.violate(f"daemon run {self.runs} exited with {code}: {daemon.stdout[-5:]}")
        if daemon.stdout:
            self.violate(f"daemon run {self.runs} printed non-JSON: {daemon.stdout[-5:]}")
        events = daemon.drain()
        promoting: set[int] = set()
        for event in events:
            name, step = event["event"], int(event.get("step", -1))
            if name == "checkpoint.promoting":
                promoting.add(step)
            elif name == "checkpoint.promoted":
                promoting.discard(step)
                self.resumed += bool(event.get("resumed"))
                if step in self.promoted_by:
                    self.violate(
                        f"step {step} promoted twice (runs {self.promoted_by[step]}, {self.runs})"
                    )
                self.promoted_by[step] = self.runs
            elif name == "checkpoint.failed":
                promoting.discard(step)
                self.failed[step] = event["reason"]
            elif name == "daemon.internal_error":
                self.violate(f"internal error: {event}")
        if killed:
            self.mid_promotion += bool(promoting)
            self.before_ready += not any(e["event"] == "daemon.ready" for e in events)

    def violate(self, message: str) -> None:
        self.result.violations.append(message)

    # -- checks ------------------------------------------------------------------------

    def check_acknowledged(self, daemon: FaultDaemon, ranks: Ranks) -> None:
        """Every begin and done the ranks saw acknowledged is in the daemon's state.

        Stateless runs start on an empty state directory: there the daemon learns the
        saves in flight again from the root and from the ranks, which re-send them once
        they have reconnected, so the check waits (bounded) for that to happen.
        """
        log = ranks.drain()
        self.acked.update(
            (line["step"], line["rank"], "begin")
            for line in log
            if line.get("event") == "begun" and line["acked"]
        )
        self.acked.update(
            (line["step"], line["rank"], line["op"])
            for line in log
            if line.get("event") == "acked" and line["code"] is None
        )
        deadline = time.monotonic() + (_RESEND_S if self.stateless else 0)
        while True:
            lost = self._lost(daemon)
            if not lost or time.monotonic() >= deadline:
                break
            with contextlib.suppress(AssertionError):  # a re-sent begin, or time passes
                daemon.wait_event("save.begun", timeout=0.2)
        # A loss is reported once, however many later checks still see it.
        self.result.violations.extend(m for m in lost if m not in self.reported)
        self.reported.update(lost)

    def _lost(self, daemon: FaultDaemon) -> list[str]:
        saves = {s["step"]: s for s in daemon.request("status", root=str(self.root))["saves"]}
        on_disk = step_dirs(self.root, "step_")
        lost = []
        for step, rank, op in sorted(self.acked):
            save = saves.get(step)
            if save is None:
                if step not in on_disk | self.settled | self.failed.keys():
                    lost.append(f"acknowledged {op} of step {step} rank {rank} lost")
                continue
            if save["state"] in ("promoted", "failed"):
                self.settled.add(step)
                continue  # failures are checked at the end, with their reasons
            states = {r["rank"]: r["state"] for r in save["ranks"]}
            want = ("done",) if op == "done" else ("writing", "done")
            if states.get(rank) not in want:
                lost.append(
                    f"acknowledged {op} of step {step} rank {rank} lost: "
                    f"save is {save['state']}, rank is {states.get(rank)}"
                )
        return lost

    def check_loads(self) -> None:
        """``dcp.load`` of each new ``step_N`` gives back exactly what each rank saved."""
        for step in sorted(self.verified - self.loaded):
            for rank in range(_WORLD):
                expected = state_for(rank, step, _NUMEL)
                loaded = {k: torch.empty_like(v) for k, v in expected.items()}
                try:
                    dcp_load(loaded, checkpoint_id=str(self.root / f"step_{step}"), no_dist=True)
                except Exception as exc:  # any load error is the finding itself
                    self.violate(f"step_{step} does not load: {exc!r}"[:500])
                    break
                bad = [k for k, v in expected.items() if not torch.equal(loaded[k], v)]
                if bad:
                    self.violate(f"step_{step} rank {rank} loads different tensors: {bad}")
            self.loaded.add(step)

    # -- one trial ---------------------------------------------------------------------

    def next_env(self) -> tuple[str, dict[str, str]]:
        draw = self.rng.random()
        if draw < 0.45:
            return "random", {}
        if draw < 0.55:
            return "startup", {}
        point = self.rng.choice(POINTS)
        return f"crash:{point}", {"CKPTD_CRASH_AT": f"{point}:{self.rng.randint(1, 3)}"}

    def trial(self, kind: str, daemon: FaultDaemon, max_delay: float) -> None:
        """End the current run as ``kind`` says, then check the root at rest."""
        assert daemon.proc is not None
        if kind.startswith("crash:"):
            try:
                code = daemon.proc.wait(120)
            except subprocess.TimeoutExpired:  # the stream stalled: count it, end the run
                self.kinds["crash point not reached"] += 1
            else:
                if code != 137:
                    self.violate(f"run {self.runs} with {kind} exited {code}")
                self.points[kind.removeprefix("crash:")] += 1
        else:
            # The random instant is the input of this trial, not a wait for anything.
            time.sleep(self.rng.uniform(0, 0.4 if kind == "startup" else max_delay))
        self.kinds[kind.partition(":")[0]] += 1
        self.end_run(daemon, killed=not kind.startswith("crash:"))
        for problem in check_root_at_rest(self.root, self.verified):
            self.violate(f"after trial {self.result.trials + 1} ({kind}): {problem}")
        self.result.trials += 1


def run_kill_campaign(
    workdir: Path,
    trials: int,
    *,
    seed: int = 0,
    max_delay: float = 1.0,
    train_s: float = 0.05,
    progress: Callable[[str], None] = lambda _m: None,
    stateless: bool | None = None,
) -> Result:
    """Kill and restart the daemon ``trials`` times under a streaming 2-rank DCP job.

    Args:
        workdir: An empty directory with a short path (the socket lives there).
        trials: Daemon runs to end by SIGKILL or crash point.
        seed: Seeds every random choice (kind of trial, instant, crash point).
        max_delay: Longest random instant after ``daemon.ready``, in seconds.
        train_s: Time each rank "trains" between two saves.
        progress: Called with a line of progress now and then.
        stateless: Start every daemon run on an empty state directory (a Slurm
            prolog's, a pod's emptyDir): only the root and the ranks carry the facts.
            None: as :func:`tests.faults.harness.set_stateless` says.
    """
    stateless = harness_stateless() if stateless is None else stateless
    started = time.monotonic()
    c = _Campaign(workdir, random.Random(seed), progress, stateless=stateless)
    stop = workdir / "stop"
    kind, env = "random", dict[str, str]()
    daemon = c.launch(env)
    assert daemon.ready(60)
    job = ["--stream", str(stop), "--numel", str(_NUMEL), "--train-s", str(train_s)]
    # Every launcher names its run (torchrun, Slurm): the root tells its attempts apart.
    run = {"TORCHELASTIC_RUN_ID": f"kill-{seed}", "TORCHELASTIC_RESTART_COUNT": "0"}
    ranks = Ranks(daemon.socket_path, c.root, _WORLD, *job, rank_env=lambda _r: run)
    try:
        daemon.wait_event("checkpoint.promoted", timeout=180)  # the stream flows
        for _ in range(trials):
            c.trial(kind, daemon, max_delay)
            if any(p.poll() is not None for p in ranks.procs):
                c.violate(f"a rank exited during the campaign: {ranks.output()}")
                break
            kind, env = c.next_env()
            daemon = c.launch(env)
            if kind == "startup":
                continue  # the next trial kills it during startup
            if not daemon.ready(60):
                if not env:
                    c.violate(f"run {c.runs} exited before ready: {daemon.stdout[-5:]}")
                continue  # died at its crash point during recovery
            if not env:
                c.check_acknowledged(daemon, ranks)
            c.check_loads()
            if c.result.trials % 25 == 0:
                c.progress(
                    f"kill: {c.result.trials}/{trials} trials, "
                    f"{len(c.verified)} steps promoted, {len(c.result.violations)} violations"
                )
        _finish(c, daemon, ranks, stop, kind)
    finally:
        ranks.kill()
        if c.daemon is not None:
            c.daemon.reap()
    c.result.seconds = time.monotonic() - started
    return c.result


def _finish(c: _Campaign, daemon: FaultDaemon, ranks: Ranks, stop: Path, kind: str) -> None:
    """Stop the job with a healthy daemon, then check that nothing completed was lost."""
    if kind != "random":  # the last run may still carry a crash point: replace it
        c.end_run(daemon)
        daemon = c.launch({})
        assert daemon.ready(60), daemon.stdout
    stop.touch()
    codes = ranks.wait(600)
    if codes != [0] * _WORLD:
        c.violate(f"ranks exited with {codes}: {ranks.output()}")
    log = ranks.drain()
    uploads: dict[int, list[bool]] = {}
    for line in log:
        if line.get("event") == "upload":
            uploads.setdefault(line["step"], []).append(line["ok"])
    completed = sorted(s for s, oks in uploads.items() if len(oks) == _WORLD and all(oks))
    unacked_begin = {x["step"] for x in log if x.get("event") == "begun" and not x["acked"]}
    c.check_acknowledged(daemon, ranks)
    with LineClient(daemon.socket_path, timeout=180) as client:
        for step in completed:
            reply = client.request("wait", root=str(c.root), step=step, timeout=_SETTLE_S)
            if reply.get("state") == "failed":
                c.failed.setdefault(step, str(reply.get("reason")))
            elif reply.get("state") != "promoted":
                c.violate(f"step {step} completed by every rank but not settled: {reply}")
    c.end_run(daemon)  # SIGKILL once more: the final state must survive it too
    restarted = c.launch({})
    assert restarted.ready(60), restarted.stdout
    recovered = restarted.wait_event("daemon.recovered", timeout=60)
    if recovered["resumed"] or recovered["in_flight"]:
        c.violate(f"a settled job left work for a restart: {recovered}")
    assert restarted.stop() == 0
    c.end_run(restarted)
    for problem in check_root_at_rest(c.root, c.verified):
        c.violate(f"at the end: {problem}")
    c.check_loads()
    promoted = step_dirs(c.root, "step_")
    leftovers = step_dirs(c.root, "tmp_step_") - set(c.failed)
    for step in c.failed:
        if step in promoted:
            c.violate(f"step {step} both failed ({c.failed[step]}) and promoted")
    for step in completed:
        if step not in promoted and step not in c.failed:
            c.violate(f"step {step} completed by every rank is neither promoted nor failed")
    if leftovers:
        c.violate(f"tmp dirs left behind without a failure: {sorted(leftovers)[:10]}")
    if promoted and (c.root / "latest").is_symlink():
        if str((c.root / "latest").readlink()) != f"step_{max(promoted)}":
            c.violate(f"latest is not the newest promoted step {max(promoted)}")
    elif promoted:
        c.violate("no latest pointer although steps were promoted")
    c.result.figures.update(_figures(c, log, completed, promoted, unacked_begin))


def _figures(
    c: _Campaign,
    log: list[dict[str, Any]],
    completed: list[int],
    promoted: set[int],
    unacked_begin: set[int],
) -> dict[str, Any]:
    acked = Counter(
        x["event"] if x["event"] == "begun" else x["op"]
        for x in log
        if (x.get("event") == "begun" and x["acked"])
        or (x.get("event") == "acked" and x["code"] is None)
    )
    return {
        "trials": c.result.trials,
        "daemon runs": c.runs,
        "random SIGKILLs": c.kinds["random"],
        "SIGKILLs at startup": c.kinds["startup"],
        "SIGKILLs before daemon.ready (during recovery)": c.before_ready,
        "SIGKILLs mid-promotion (after checkpoint.promoting)": c.mid_promotion,
        "crash-point exits": sum(c.points.values()),
        "crash-point exits by point": dict(sorted(c.points.items())),
        "crash point not reached": c.kinds["crash point not reached"],
        "steps completed by both ranks": len(completed),
        "steps promoted": len(promoted),
        "promotions resumed after a restart": c.resumed,
        "rank begins acknowledged (checked after each restart)": acked["begun"],
        "rank dones acknowledged (checked after each restart)": acked["done"],
        "steps with a begin not acknowledged (daemon down)": len(unacked_begin),
        "steps failed": len(c.failed),
        "failure reasons": sorted(set(c.failed.values()))[:5],
    }

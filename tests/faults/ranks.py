"""Rank faults: real rank processes that die, stop, fail or reconnect mid-save.

Each scenario runs a real daemon and real rank processes and returns an
:class:`~tests.faults.harness.Outcome` saying what docs/guarantees.md promises and what
happened. A rank SIGKILLed mid-upload is also ``tests/test_dcp.py::TestRankDeath``; the
long run repeats it here so its figures come from the same command as the others.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from daemon.store._attempts import TRASH
from tests.conftest import REPO
from tests.faults.harness import FaultDaemon, Outcome, Ranks, Result, release, run_scenarios

__all__ = ["SCENARIOS", "run_rank_faults"]


@contextlib.contextmanager
def _daemon(workdir: Path, *flags: str) -> Iterator[tuple[FaultDaemon, Path]]:
    root = workdir / "run"
    root.mkdir()
    daemon = FaultDaemon(workdir / "d.sock", [root], *flags, state_dir=workdir / "state")
    try:
        yield daemon.start(), root
    finally:
        daemon.reap()


@contextlib.contextmanager
def _job(daemon: FaultDaemon, root: Path, *args: str) -> Iterator[Ranks]:
    ranks = Ranks(daemon.socket_path, root, 2, *args)
    try:
        yield ranks
    finally:
        ranks.kill()


def _settled(daemon: FaultDaemon, root: Path, step: int, timeout: float) -> dict[str, Any]:
    return daemon.request(
        "wait", io_timeout=timeout + 30, root=str(root), step=step, timeout=timeout
    )


def _expect(outcome: Outcome, ok: bool, message: str) -> None:
    if not ok:
        outcome.violations.append(message)


def sigkill_mid_upload(workdir: Path) -> Outcome:
    """A rank SIGKILLed while its upload is held: the step fails, the next one promotes."""
    out = Outcome(
        "rank SIGKILLed mid-upload",
        "step fails (lease expired, or the surviving rank's upload failed); never promoted; "
        "its directory kept, set aside into the root's trash; a new job's next step promotes",
    )
    gate = workdir / "gate"
    os.mkfifo(gate)
    with _daemon(workdir, "--lease", "1") as (daemon, root):
        args = ("--steps", "1", "--fault", "hold", "--fault-rank", "1", "--fault-step", "1")
        with _job(daemon, root, *args, "--gate", str(gate)) as ranks:
            ranks.wait_line("held", rank=1)
            ranks.signal(1, signal.SIGKILL)
            failed = daemon.wait_event("checkpoint.failed", timeout=120)
        reason = failed["reason"]
        _expect(out, "lease" in reason or "rank 0 failed" in reason, f"reason: {reason}")
        _expect(out, not (root / "step_1").exists(), "step_1 promoted")
        # A failed attempt's directory is kept where it was set aside (guarantees 4a).
        aside = [p for p in (root / TRASH).glob("tmp_step_1.attempt-*") if p.is_dir()]
        attempt = failed.get("attempt")
        _expect(out, not (root / "tmp_step_1").exists(), "tmp_step_1 not set aside")
        _expect(
            out,
            len(aside) == 1 and f".attempt-{attempt}-" in aside[0].name,
            f"set aside: {aside}, failed attempt {attempt}",
        )
        with _job(daemon, root, "--steps", "2") as again:
            _expect(out, again.wait() == [0, 0], f"second job failed: {again.output()}")
        state = _settled(daemon, root, 2, 60)["state"]
        _expect(out, state == "promoted", f"step 2 is {state}")
        out.observed = f"checkpoint.failed: {reason}; step 2: {state}"
    return out


def sigstop_past_lease(workdir: Path) -> Outcome:
    """A rank SIGSTOPped past its lease keeps its connection: nothing fails; it promotes."""
    out = Outcome(
        "rank SIGSTOPped past its lease, then SIGCONT",
        "a stopped rank keeps its connection, so no lease starts: the step stays open "
        "(pending, nothing promoted) while it is stopped, and promotes once it continues",
    )
    gate = workdir / "gate"
    os.mkfifo(gate)
    with _daemon(workdir, "--lease", "1") as (daemon, root):
        args = ("--steps", "1,2", "--fault", "hold", "--fault-rank", "1", "--fault-step", "1")
        with _job(daemon, root, *args, "--gate", str(gate)) as ranks:
            ranks.wait_line("held", rank=1)
            ranks.freeze(1)
            release(gate)  # taken up only once the rank runs again
            # The daemon's own clock measures three leases; the reply is the outcome.
            during = _settled(daemon, root, 1, 3.0)
            saves = daemon.request("status", root=str(root))["saves"]
            rank1 = [r for s in saves if s["step"] == 1 for r in s["ranks"] if r["rank"] == 1]
            ranks.signal(1, signal.SIGCONT)
            codes = ranks.wait(120)
        _expect(out, during["state"] == "pending", f"while stopped: {during}")
        _expect(out, bool(rank1) and rank1[0]["connected"], f"stopped rank: {rank1}")
        _expect(out, not daemon.of("checkpoint.failed"), f"{daemon.of('checkpoint.failed')}")
        _expect(out, codes == [0, 0], f"ranks exited {codes}: {ranks.output()}")
        states = [_settled(daemon, root, s, 60)["state"] for s in (1, 2)]
        _expect(out, states == ["promoted", "promoted"], f"steps 1, 2: {states}")
        out.observed = f"while stopped 3 s (lease 1 s): {during['state']}; after SIGCONT: {states}"
    return out


def sigstop_past_save_timeout(workdir: Path) -> Outcome:
    """A rank stopped past ``save_timeout`` fails the step; a later step promotes."""
    out = Outcome(
        "rank SIGSTOPped past save_timeout",
        "checkpoint.failed 'timed out after ...; ranks not done: ...'; never promoted; its "
        "directory set aside; after SIGCONT a late done is refused (step_failed), a late "
        "fail changes nothing (idempotent), the step stays failed; the next step promotes",
    )
    gate, pause = workdir / "gate", workdir / "pause"
    os.mkfifo(gate)
    os.mkfifo(pause)
    config = workdir / "ckptd.toml"
    config.write_text("save_timeout = 4\n")
    with _daemon(workdir, "--lease", "1", "--config", str(config)) as (daemon, root):
        # Step 2 is begun only after the release, so its own timeout starts then.
        args = ["--steps", "1,2", "--fault", "hold", "--fault-rank", "1", "--fault-step", "1"]
        args += ["--gate", str(gate), "--pause-before", "2", "--pause-gate", str(pause)]
        with _job(daemon, root, *args) as ranks:
            ranks.wait_line("held", rank=1)
            ranks.freeze(1)
            failed = daemon.wait_event("checkpoint.failed", timeout=60)
            ranks.signal(1, signal.SIGCONT)
            release(gate)
            ranks.wait_line("held", rank=0, at="step2")
            release(pause)
            codes = ranks.wait(120)
        late = [x for x in ranks.drain() if x.get("event") == "acked" and x["step"] == 1]
        replies = sorted({f"{x['op']}: {x['code'] or 'ok'}" for x in late})
        _expect(out, "timed out" in failed["reason"], f"reason: {failed['reason']}")
        _expect(out, not (root / "step_1").exists(), "step_1 promoted")
        _expect(out, bool(failed.get("attempt")), f"checkpoint.failed names no attempt: {failed}")
        # The woken rank writes by path into a tmp_step_1 that was set aside: its upload
        # fails, and its fail (documented as idempotent once the step failed) is answered ok.
        _expect(
            out,
            all(x["code"] == ("step_failed" if x["op"] == "done" else None) for x in late),
            f"late replies: {late}",
        )
        after = _settled(daemon, root, 1, 10)
        _expect(
            out,
            after["state"] == "failed" and after["reason"] == failed["reason"],
            f"step 1 after the late reports: {after}",
        )
        _expect(out, codes == [0, 0], f"ranks exited {codes}: {ranks.output()}")
        state = _settled(daemon, root, 2, 60)["state"]
        _expect(out, state == "promoted", f"step 2 is {state}")
        out.observed = (
            f"checkpoint.failed: {failed['reason']}; late replies: {', '.join(replies)}; "
            f"step 1 still failed; step 2: {state}"
        )
    return out


def writer_exception(workdir: Path) -> Outcome:
    """A storage writer that raises fails the step with the reason; the next step promotes."""
    out = Outcome(
        "exception in one rank's storage writer (EIO)",
        "every rank's upload fails, the client sends fail: checkpoint.failed 'rank R failed: "
        "...EIO...'; never promoted; the next step promotes",
    )
    with _daemon(workdir) as (daemon, root):
        args = ("--steps", "1,2", "--fault", "raise", "--fault-rank", "1", "--fault-step", "1")
        with _job(daemon, root, *args) as ranks:
            codes = ranks.wait(120)
        failed = daemon.wait_event("checkpoint.failed", timeout=60)
        _expect(out, "injected EIO" in failed["reason"], f"reason: {failed['reason']}")
        _expect(out, failed["step"] == 1 and not (root / "step_1").exists(), "step 1 promoted")
        _expect(out, codes == [0, 0], f"ranks exited {codes}: {ranks.output()}")
        state = _settled(daemon, root, 2, 60)["state"]
        _expect(out, state == "promoted", f"step 2 is {state}")
        out.observed = f"checkpoint.failed: {failed['reason'][:160]}; step 2: {state}"
    return out


# A rank process that uses the real client (no torch): begins, then writes and reports
# done when the harness says so on stdin.
_PLAIN_RANK = r"""
import json, os, sys
from orchestrator import CheckpointClient, FileEntry
root, step, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
client = CheckpointClient(begin_timeout=10.0)
begun = client.begin(root, step, rank, 2)
print(json.dumps({"event": "begun", "acked": begun.acknowledged}), flush=True)
sys.stdin.readline()
os.makedirs(begun.path, exist_ok=True)
with open(os.path.join(begun.path, f"rank{rank}.bin"), "wb") as fh:
    fh.write(bytes([rank]) * 4096)
client.done(root, step, rank, [FileEntry(f"rank{rank}.bin", 4096)])
print(json.dumps({"event": "flushed", "ok": client.flush(30.0)}), flush=True)
client.close()
"""


def _plain_rank(daemon: FaultDaemon, root: Path, rank: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "CKPTD_SOCKET": str(daemon.socket_path), "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", _PLAIN_RANK, str(root), "1", str(rank)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        cwd=REPO,
    )


def _line(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> dict[str, Any]:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no line from rank within {timeout}s"
    line: dict[str, Any] = json.loads(proc.stdout.readline())
    return line


def reconnect_within_lease(workdir: Path) -> Outcome:
    """A rank process replaced within its lease re-begins the step, which then promotes."""
    out = Outcome(
        "rank's connection dropped, a new process for the rank back within the lease",
        "save.rank_disconnected, then save.rank_reconnected when it begins again; the "
        "step promotes; nothing fails",
    )
    procs: list[subprocess.Popen[bytes]] = []
    with _daemon(workdir, "--lease", "30") as (daemon, root):
        try:
            procs += [_plain_rank(daemon, root, 0), _plain_rank(daemon, root, 1)]
            acked = [_line(p)["acked"] for p in procs]
            procs[1].kill()
            procs[1].wait(30)
            dropped = daemon.wait_event("save.rank_disconnected", timeout=30)
            procs.append(_plain_rank(daemon, root, 1))
            acked.append(_line(procs[2])["acked"])
            back = daemon.wait_event("save.rank_reconnected", timeout=30)
            for proc in (procs[0], procs[2]):
                assert proc.stdin is not None
                proc.stdin.write(b"go\n")
                proc.stdin.flush()
            flushed = [_line(p)["ok"] for p in (procs[0], procs[2])]
            state = _settled(daemon, root, 1, 60)["state"]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.communicate()
        _expect(out, all(acked) and all(flushed), f"acked {acked}, flushed {flushed}")
        _expect(out, (dropped["rank"], back["rank"]) == (1, 1), f"{dropped} {back}")
        _expect(out, state == "promoted", f"step 1 is {state}")
        _expect(out, not daemon.of("checkpoint.failed"), f"{daemon.of('checkpoint.failed')}")
        out.observed = f"rank 1 disconnected, reconnected; step 1: {state}"
    return out


SCENARIOS: dict[str, Callable[[Path], Outcome]] = {
    "sigkill_mid_upload": sigkill_mid_upload,
    "sigstop_past_lease": sigstop_past_lease,
    "sigstop_past_save_timeout": sigstop_past_save_timeout,
    "writer_exception": writer_exception,
    "reconnect_within_lease": reconnect_within_lease,
}
"""Every rank fault, by name."""


def run_rank_faults(
    workdir: Path, rounds: int = 1, progress: Callable[[str], None] = lambda _m: None
) -> Result:
    """Run every ranks-fault scenario ``rounds`` times, each in a fresh directory."""
    return run_scenarios("ranks", SCENARIOS, workdir, rounds, progress)

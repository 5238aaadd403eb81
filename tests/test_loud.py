"""Real jobs: a restarted job takes its step over at once, and a strict trainer's mistakes raise.

Three small gloo jobs (``tests/_loud_worker.py``) against one real daemon whose lease
is long (300 s), so that nothing here can pass by waiting for a lease:

- a 2-rank job under torchelastic's names (run ``job``, restart 0) begins step 7 and is
  SIGKILLed mid-save; at once a 2-rank job of the same launch with restart count 1 saves
  step 7 with ``orchestrator.async_save`` under ``CKPTD_STRICT=1``: promoted, from a new
  attempt, the dead one failed "superseded by run ..." and set aside;
- a strict 1-rank job saves under a root given relative to its directory (promoted),
  then step 1 again and a step under a root the daemon does not serve: each raises
  ``SaveRefused`` naming the code, root, step and fix, and leaves no directory;
- the same job without strict: each refused call returns (its future fails), and leaves
  no directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._ranks import free_port, pump_lines, start_rank
from tests.conftest import REPO, DaemonProcess

pytestmark = pytest.mark.slow

WORKER = REPO / "tests" / "_loud_worker.py"
DEADLINE = 120.0
ELASTIC = {"TORCHELASTIC_RUN_ID": "job"}


class Lines:
    """Every JSON line of a job's ranks, waited for by event name with a deadline."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self._cond = threading.Condition()

    def put(self, line: dict[str, Any]) -> None:
        with self._cond:
            self.seen.append(line)
            self._cond.notify_all()

    def wait(self, event: str, count: int) -> list[dict[str, Any]]:
        with self._cond:
            found = self._cond.wait_for(
                lambda: len([x for x in self.seen if x.get("event") == event]) >= count, DEADLINE
            )
            assert found, (event, self.seen)
            return [x for x in self.seen if x.get("event") == event]


def _job(
    daemon: DaemonProcess, world: int, args: list[str], env: dict[str, str], lines: Lines
) -> list[subprocess.Popen[bytes]]:
    port = free_port()
    procs = []
    for rank in range(world):
        proc = start_rank([str(WORKER), *args], rank, world, port, daemon.socket_path, env)
        pump_lines(proc, rank, lines.put)
        procs.append(proc)
    return procs


@pytest.fixture(scope="module")
def jobs() -> Iterator[dict[str, Any]]:
    base = Path(tempfile.mkdtemp(prefix="ck-", dir="/tmp"))
    roots = {name: base / name for name in ("restart", "loud", "quiet")}
    for root in roots.values():
        root.mkdir()
    daemon = DaemonProcess(base / "d.sock", list(roots.values()), "--lease", "300")
    procs: list[subprocess.Popen[bytes]] = []
    out: dict[str, Any] = {"daemon": daemon, "base": base}
    try:
        daemon.start()
        held, resumed, loud, quiet = Lines(), Lines(), Lines(), Lines()
        restart = ["--root", str(roots["restart"]), "--step", "7"]
        dead = _job(daemon, 2, ["--mode", "hold", *restart], ELASTIC, held)
        procs += dead
        other = ["--cwd", str(base), "--other", str(base / "nowhere" / "ckpt")]
        strict = {"CKPTD_STRICT": "1"}
        procs += _job(daemon, 1, ["--mode", "loud", "--root", "loud", *other], strict, loud)
        procs += _job(daemon, 1, ["--mode", "quiet", "--root", "quiet", *other], {}, quiet)
        out["held"] = held.wait("begun", 2)
        for proc in dead:
            proc.send_signal(signal.SIGKILL)
            proc.wait(DEADLINE)
        env = {**ELASTIC, "TORCHELASTIC_RESTART_COUNT": "1", **strict}
        again = _job(daemon, 2, ["--mode", "resume", *restart], env, resumed)
        procs += again
        out["resumed"] = resumed.wait("saved", 2)
        out["loud"] = loud.wait("refused", 2) + loud.wait("saved", 1)
        out["quiet"] = quiet.wait("returned", 2)
        out["codes"] = [p.wait(DEADLINE) for p in procs[2:]]
        out["lines"] = held.seen + resumed.seen + loud.seen + quiet.seen
        yield out
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        daemon.kill()
        if daemon.proc is not None and daemon.proc.stdout is not None:
            daemon.proc.stdout.close()
        shutil.rmtree(base, ignore_errors=True)


class TestRestartedJob:
    """A job SIGKILLed mid-save and restarted at once saves the same step at once."""

    def test_promoted_from_a_new_attempt(self, jobs: dict[str, Any]) -> None:
        dead = {line["attempt"] for line in jobs["held"]}
        assert len(dead) == 1
        resumed = jobs["resumed"]
        assert [line["state"] for line in resumed] == ["promoted", "promoted"], jobs["lines"]
        assert {line["run"] for line in resumed} == {"torchelastic:job:1"}
        assert {line["attempt"] for line in resumed}.isdisjoint(dead)
        daemon: DaemonProcess = jobs["daemon"]
        (old,) = dead
        failed = daemon.wait_event("checkpoint.failed", match=lambda e: e["attempt"] == old)
        assert failed["reason"] == "superseded by run torchelastic:job:1"
        trash = os.listdir(jobs["base"] / "restart" / ".ckptd-trash")
        assert any(old in name for name in trash), trash


class TestLoudMistakes:
    """Strict: a refused begin raises in the trainer; nothing of a refused save stays."""

    def test_a_relative_root_is_saved_under_its_absolute_path(self, jobs: dict[str, Any]) -> None:
        (saved,) = [line for line in jobs["loud"] if line["event"] == "saved"]
        assert saved["state"] == "promoted", saved
        assert (jobs["base"] / "loud" / "step_1").is_dir()

    def test_refusals_raise_naming_code_root_step_and_fix(self, jobs: dict[str, Any]) -> None:
        refused = {line["name"]: line for line in jobs["loud"] if line["event"] == "refused"}
        promoted, unconfigured = refused["promoted"], refused["unconfigured"]
        assert promoted["code"] == "already_promoted"
        assert f"step 1 of {jobs['base'] / 'loud'}" in promoted["text"]
        assert "Fix: " in promoted["text"]
        assert unconfigured["code"] == "root_not_configured"
        assert "step 2 of" in unconfigured["text"] and "Fix: " in unconfigured["text"]

    def test_a_refused_save_leaves_no_directory(self, jobs: dict[str, Any]) -> None:
        for line in jobs["loud"] + jobs["quiet"]:
            if line["event"] in ("refused", "returned"):
                assert line["left"] is False, line
        assert not (jobs["base"] / "nowhere").exists()
        assert not (jobs["base"] / "loud" / "tmp_step_1").exists()

    def test_without_strict_the_call_returns(self, jobs: dict[str, Any]) -> None:
        quiet = {line["name"]: line for line in jobs["quiet"]}
        assert {q["outcome"] for q in quiet.values()} == {"CheckpointException"}, quiet

    def test_every_job_exits_0(self, jobs: dict[str, Any]) -> None:
        assert jobs["codes"] == [0, 0, 0, 0], jobs["lines"]

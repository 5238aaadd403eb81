"""NeMo-RL's GRPO checkpoint sequence end to end: ``examples/nemo_rl_grpo_shape.py``.

A real ``ckptd serve`` whose root has the policy NeMo-RL's ``keep_top_k=2`` maps to; the
example's driver (``orchestrator.nemo_rl.CheckpointManager``) and its 2 worker
processes (gloo, ``AutomodelCheckpointManager`` with async DCP uploads) run from cold,
and are SIGKILLed (driver, workers and upload processes together) right after the
workers' save of step 5 returned, while its uploads may still run. The daemon settles
that step (its lease runs out, or its uploads had landed); the job is started again,
resumes from the newest complete step with the state it saved, and trains to the end.
At each point what is on disk is what NeMo-RL's top-k keeps.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from orchestrator import CheckpointClient
from orchestrator.nemo_rl import retention_table, retention_toml
from tests._system import require_tool
from tests.conftest import REPO, DaemonProcess

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "examples" / "nemo_rl_grpo_shape.py"
RUN_TIMEOUT = 150.0
"""Seconds one run may take: about 35 s on 2 cores, most of it the start of the two
workers and of their upload processes (each imports torch and nemo_automodel)."""


def reward(step: int) -> float:
    return (step * 7 % 10) / 10  # as the example's


def top_k(steps: list[int], k: int = 2) -> list[int]:
    """What NeMo-RL's keep_top_k keeps of ``steps`` by reward (ties: newer), and the newest."""
    best = sorted(steps, key=lambda s: (-reward(s), -s))[:k]
    return sorted({*best, max(steps)})


class Run:
    """One run of the example in its own session (so SIGKILL reaches every process)."""

    def __init__(self, daemon: DaemonProcess, root: Path, steps: int) -> None:
        env = {**os.environ, "CKPTD_SOCKET": str(daemon.socket_path), "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, str(EXAMPLE), str(root), "--steps", str(steps)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace")
                self.output.append(line)
                if line.startswith("{"):
                    try:
                        self.events.put(json.loads(line))
                    except ValueError:  # not an event: the output keeps it for the failure
                        pass
        self.events.put({"event": "_exit"})

    def wait_event(self, name: str, **match: Any) -> dict[str, Any]:
        while True:
            try:
                event = self.events.get(timeout=RUN_TIMEOUT)
            except queue.Empty:
                raise AssertionError(f"no {name} in {RUN_TIMEOUT}s: {self.tail()}") from None
            if event["event"] == "_exit":
                raise AssertionError(f"exited ({self.proc.wait()}) before {name}: {self.tail()}")
            if event["event"] == name and all(event.get(k) == v for k, v in match.items()):
                return event

    def tail(self) -> str:
        return "".join(self.output[-40:])

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


def on_disk(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step_*"))


def settled(daemon: DaemonProcess, root: Path, expected: list[int]) -> None:
    """Wait (on the daemon's events, 30 s at most) until the root holds ``expected``."""
    deadline = time.monotonic() + 30
    while on_disk(root) != expected:
        daemon.wait_event("checkpoint.retired", max(deadline - time.monotonic(), 0.01))


class TestGrpoShape:
    """Cold, SIGKILLed mid-save, resumed: the newest complete step, top-k honoured."""

    def test_cold_then_killed_then_resumed(
        self, daemon_factory: Callable[..., DaemonProcess], root: Path, tmp_path: Path
    ) -> None:
        config = {
            "save_period": 1,
            "keep_top_k": 2,
            "metric_name": "val:reward",
            "higher_is_better": True,
        }
        toml = tmp_path / "ckptd.toml"
        toml.write_text(retention_toml(str(root), retention_table(config)))
        daemon = daemon_factory([], "--config", str(toml), "--lease", "2")

        cold = Run(daemon, root, steps=7)
        try:
            assert cold.wait_event("started")["uses_daemon"] is True
            cold.wait_event("saving", step=5)
        finally:
            cold.kill()
        with CheckpointClient(str(daemon.socket_path)) as client:
            verdict = client.wait(str(root), 5, timeout=60).state
        assert verdict in ("promoted", "failed")  # the lease settles it, if the uploads did not
        newest = 5 if verdict == "promoted" else 4
        settled(daemon, root, top_k(list(range(1, newest + 1))))

        again = Run(daemon, root, steps=7)
        resumed = again.wait_event("resumed")
        assert (resumed["step"], resumed["state_matches"]) == (newest, True)
        assert resumed["path"] == str(root / f"step_{newest}")
        done = again.wait_event("done")
        assert again.proc.wait(30) == 0, again.tail()
        assert done["latest"] == str(root / "step_7")
        assert done["best"] == str(root / "step_7")  # reward 0.9
        settled(daemon, root, top_k(list(range(1, 8))))
        assert on_disk(root) == [4, 7]
        assert "Traceback" not in "".join(again.output)


class TestEventLines:
    """The example writes each event line in one write, so its workers' logs cannot split it."""

    def test_one_write_per_event(self, tmp_path: Path) -> None:
        require_tool("strace")
        trace = tmp_path / "trace"
        code = f"import runpy; runpy.run_path({str(EXAMPLE)!r})['say'](event='saving', step=7)"
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        subprocess.run(
            ["strace", "-f", "-e", "trace=write", "-o", str(trace), sys.executable, "-c", code],
            check=True,
            env=env,
            stdout=subprocess.PIPE,
        )
        writes = [line for line in trace.read_text().splitlines() if "write(1," in line]
        assert len(writes) == 1, writes
        assert '{\\"event\\": \\"saving\\", \\"step\\": 7}\\n' in writes[0], writes

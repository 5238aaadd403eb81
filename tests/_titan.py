"""A 2-rank job of ``tests/_titan_worker.py`` against a real daemon, for the torchtitan tests."""

from __future__ import annotations

import queue
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from orchestrator.torchtitan import root_toml
from tests._ranks import free_port, pump_lines, start_rank
from tests.conftest import REPO, DaemonProcess

WORKER = str(REPO / "tests" / "_titan_worker.py")
WORLD = 2
JOB_DEADLINE = 180.0
"""Seconds a job may take to say what a test waits for: a deadline for a hang (a job
runs in 5-15 s on 2 cores)."""


def titan_daemon(base: Path, socket_dir: Path, keep_latest_k: int) -> tuple[DaemonProcess, Path]:
    """A daemon serving ``base/checkpoint`` as :func:`root_toml` says, and that root.

    The lease is 1 s, so that a killed job's step fails soon.
    """
    root = base / "checkpoint"
    root.mkdir(parents=True)
    config = base / "ckptd.toml"
    config.write_text(root_toml(str(root), keep_latest_k))
    daemon = DaemonProcess(socket_dir / "d.sock", [], "--config", str(config), "--lease", "1")
    return daemon.start(), root


class TitanJob:
    """Two ranks of the worker, their JSON lines gathered in one queue.

    Args:
        daemon: The daemon the ranks reach (``CKPTD_SOCKET``).
        args: The worker's arguments (``loop ROOT ...``, ``forms ROOT``).
        run: The run's id, as torchrun would set it (``TORCHELASTIC_RUN_ID``).
    """

    def __init__(self, daemon: DaemonProcess, args: list[str], run: str) -> None:
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        port = free_port()
        env = {
            "TORCHELASTIC_RUN_ID": run,
            "TORCHELASTIC_RESTART_COUNT": "0",
            "DCP_USE_PREFIX_STORE": "1",  # the upload processes join the job's store
        }
        self.procs = [
            start_rank([WORKER, *args], rank, WORLD, port, daemon.socket_path, env)
            for rank in range(WORLD)
        ]
        for rank, proc in enumerate(self.procs):
            pump_lines(proc, rank, self.lines.put)

    def wait(self, event: str, rank: int, **match: Any) -> dict[str, Any]:
        """The next line ``event`` of ``rank`` that matches; fails on an error or a hang."""
        deadline = time.monotonic() + JOB_DEADLINE
        for line in self.seen:
            if _matches(line, event, rank, match) and not line.get("_taken"):
                line["_taken"] = True
                return line
        while True:
            left = deadline - time.monotonic()
            try:
                line = self.lines.get(timeout=max(left, 0.001))
            except queue.Empty:
                raise AssertionError(f"no {event} of rank {rank}: {self.output()}") from None
            self.seen.append(line)
            if line.get("event") == "error":
                raise AssertionError(f"rank {line.get('rank')} failed: {self.output()}")
            if _matches(line, event, rank, match):
                line["_taken"] = True
                return line

    def output(self) -> str:
        """What the ranks said so far (for a failure's message)."""
        return "\n".join(str(line)[:300] for line in self.seen[-40:])

    def finish(self) -> None:
        """Wait for both ranks to exit 0."""
        for proc in self.procs:
            assert proc.wait(JOB_DEADLINE) == 0, self.output()

    def kill(self) -> None:
        """SIGKILL both ranks (and their upload processes' parent) and reap them."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:  # pragma: no cover - a hang, reported below
                raise AssertionError(f"rank {proc.pid} outlived SIGKILL") from None


def _matches(line: dict[str, Any], event: str, rank: int, match: dict[str, Any]) -> bool:
    return (
        line.get("event") == event
        and line.get("rank") == rank
        and all(line.get(k) == v for k, v in match.items())
    )


def step_dirs(root: Path) -> list[str]:
    """What torchtitan's discovery sees: the root's entries named like ``step-N``."""
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))

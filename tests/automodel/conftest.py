"""Real 2-rank gloo jobs running ``tests/automodel/_worker.py``, one process per rank."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._ranks import free_port, pump_lines, start_rank
from tests.conftest import REPO

WORKER = REPO / "tests" / "automodel" / "_worker.py"


class RankJob:
    """``world`` rank processes of one scenario, their JSON lines readable in order."""

    def __init__(
        self,
        scenario: str,
        args: list[str],
        socket_path: Path,
        world: int = 2,
        env: dict[str, str] | None = None,
    ) -> None:
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self.upload_pids: set[int] = set()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pumps: list[threading.Thread] = []
        port = free_port()
        for rank in range(world):
            # socket_path: a daemon's socket, or a path where none listens (the reference mode).
            cmd = [str(WORKER), scenario, *args]
            proc = start_rank(cmd, rank, world, port, socket_path, env)
            self.procs.append(proc)
            self.pumps.append(pump_lines(proc, rank, self._put))

    def _put(self, line: dict[str, Any]) -> None:
        if line.get("upload_pid"):
            self.upload_pids.add(int(line["upload_pid"]))
        self.lines.put(line)

    def wait_line(self, event: str, timeout: float = 90.0, **match: Any) -> dict[str, Any]:
        """The next line from any rank with ``event`` and the given fields."""
        for line in self.seen:
            if line["event"] == event and all(line.get(k) == v for k, v in match.items()):
                self.seen.remove(line)
                return line
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                tail = [x.get("line", x["event"]) for x in self.seen[-30:]]
                raise AssertionError(f"no {event} {match} within {timeout}s; saw {tail}") from None
            if line["event"] == event and all(line.get(k) == v for k, v in match.items()):
                return line
            self.seen.append(line)

    def drain(self) -> list[dict[str, Any]]:
        """Every line not yet taken by :meth:`wait_line`, once all ranks have exited."""
        for pump in self.pumps:
            pump.join(30)
        while True:
            try:
                self.seen.append(self.lines.get_nowait())
            except queue.Empty:
                return self.seen

    def wait(self, timeout: float = 120.0) -> list[int]:
        """Exit codes of every rank."""
        return [p.wait(timeout) for p in self.procs]

    def kill(self) -> None:
        """Kill every rank and every upload process still running."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for pid in self.upload_pids:
            try:
                os.kill(pid, signal.SIGKILL)  # also ends one left stopped by a test
            except ProcessLookupError:
                pass
        for pump in self.pumps:
            pump.join(30)


@pytest.fixture
def rank_jobs(short_dir: Path) -> Iterator[Callable[..., RankJob]]:
    """Start 2-rank jobs; whatever still runs at the end is killed."""
    started: list[RankJob] = []

    def make(
        scenario: str,
        *args: str,
        socket_path: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> RankJob:
        sock = socket_path or short_dir / "no-daemon.sock"
        job = RankJob(scenario, list(args), sock, env=env)
        started.append(job)
        return job

    yield make
    for job in started:
        job.kill()


def release(gate: Path) -> None:
    """Open a rank's FIFO gate: the rank waiting on it goes on."""
    with open(gate, "wb") as fh:
        fh.write(b"x")

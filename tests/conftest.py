"""Shared fixtures: real daemons (in a subprocess or in-process), real sockets, real roots."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator._nodes import ENV_VARS
from orchestrator._run import RUN_VARS
from tests._zygote import zygote

REPO = Path(__file__).resolve().parent.parent

# Every run ends with the test files that cost the most CPU (the suite's budget).
pytest_plugins = ["tests._cpu_report"]

# The suite's jobs run all their ranks on this machine: a launcher's count of ranks per
# node, or its run (the suite itself run under torchrun or in a Slurm job), must not
# reach the clients under test or the rank processes they start.
for _name in (*ENV_VARS, *RUN_VARS):
    os.environ.pop(_name, None)


_SHARED_FIXTURE = re.compile(r"@pytest\.fixture\(\s*scope=\"(module|class)\"")


AUTOMODEL = "tests/automodel/"
"""The tests that import nemo_automodel, in-process or in their ranks: one worker's."""


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Send each module whose tests share a module- or class-scoped fixture to one worker.

    Such a fixture (a 2-rank job whose checkpoint every test of the module reads) is set
    up once per worker that runs any of the module's tests: split across workers, its
    cost is paid once per worker. ``tests/automodel`` is one unit: its ranks are forked
    from a zygote that imported nemo_automodel (about 7 s of CPU each time one starts)
    and its in-process tests import it, so one worker pays that, not every worker.
    Every other test is its own unit of work, dealt out as ``--dist load`` would.
    (``--dist loadgroup`` with ``xdist_group`` marks would say the same, but pytest 9 no
    longer lets xdist rename the node ids it groups by.)
    """
    from xdist.scheduler import LoadScopeScheduling

    shared = {
        path.relative_to(REPO).as_posix()
        for path in (REPO / "tests").rglob("test_*.py")
        if _SHARED_FIXTURE.search(path.read_text())
    }

    class SharedFixtureScheduling(LoadScopeScheduling):  # type: ignore[misc]  # untyped
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if module.startswith(AUTOMODEL):
                return AUTOMODEL
            return module if module in shared else nodeid

    return SharedFixtureScheduling(config, log)


SLOW_DEADLINE = 600.0
"""Seconds a ``slow`` test may run (setup included) unless it says otherwise: a deadline
for a hang, not a measure of speed. Such a test runs whole jobs (ranks importing torch
and nemo_automodel, a Slurm cluster), which take 20-110 s here and three times that on a
slower, busier machine, all of them started together at the suite's start."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Deal the slow tests out first, interleaved with those that mostly wait.

    The workers take units of work in collection order. Alphabetically, modules of one
    or two long jobs (a Slurm cluster, a NeMo-RL driver and its workers) came last and
    ran alone at the end; started first, the short tests fill the other workers meanwhile.
    Tests marked ``waits`` (simulated nodes waiting out their mounts' caches, hung
    mounts, leases) are spread evenly among the slow ones, so that a worker waiting
    leaves the CPU to the others' jobs rather than all waiting together, and the tests
    that compute come last, keeping every worker busy to the end. Each group keeps its
    order. A slow test without a timeout of its own gets :data:`SLOW_DEADLINE`.
    """
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    waits = [item for item in items if item.get_closest_marker("waits") is not None]
    first = {id(item): i / len(slow) for i, item in enumerate(slow)}
    first.update(
        {id(item): i / len(waits) for i, item in enumerate(waits) if id(item) not in first}
    )
    items.sort(key=lambda item: first.get(id(item), 2.0))  # stable: the rest keep their order
    for item in slow:
        if not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_DEADLINE))


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory under /tmp: AF_UNIX paths must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="ck-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """An empty checkpoint root."""
    path = tmp_path / "run"
    path.mkdir()
    return path


class DaemonProcess:
    """``ckptd serve`` as a real subprocess, with its stdout events readable in order."""

    def __init__(
        self,
        socket_path: Path,
        roots: list[Path],
        *extra: str,
        state_dir: Path | None = None,
        env: dict[str, str] | None = None,
        wrap: list[str] | None = None,
        mount_ns: int | None = None,
    ) -> None:
        self.env = env or {}
        self.wrap = wrap or []
        """A command the daemon runs under (``nsenter ... --``, for a simulated node)."""
        self.mount_ns = mount_ns
        """Where ``wrap`` is that ``nsenter -m``: the pid whose mount namespace it enters,
        so that a daemon forked from the zygote enters it instead."""
        self.socket_path = socket_path
        self.state_dir = state_dir or socket_path.with_name(f"{socket_path.name}.state")
        self.roots = roots
        self.extra = list(extra)
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> DaemonProcess:
        """Start the daemon and wait for ``daemon.ready``."""
        cmd = [*self.wrap, sys.executable, "-m", "daemon", "serve"]
        cmd += ["--socket", str(self.socket_path)]
        if "--state-dir" not in self.extra:
            cmd += ["--state-dir", str(self.state_dir)]
        for r in self.roots:
            cmd += ["--root", str(r)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        env.pop("CKPTD_SOCKET", None)
        # Forked from a process that imported the daemon once (tests/_zygote.py); run
        # as a command when it runs under another command than a node's namespace.
        plain = not self.wrap or self.mount_ns is not None
        forked = zygote("daemon") if plain else None
        if forked is not None:
            argv = [*cmd[len(self.wrap) + 1 :], *self.extra]
            self.proc = forked.spawn(argv, env, REPO, mount_ns=self.mount_ns)
        else:
            self.proc = subprocess.Popen(
                cmd + self.extra,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
            )
        self._pump_thread = threading.Thread(target=self._pump, args=(self.proc,), daemon=True)
        self._pump_thread.start()
        self.wait_event("daemon.ready", timeout=timeout)
        return self

    def _pump(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        with proc.stdout:
            for raw in proc.stdout:
                try:
                    event = json.loads(raw)
                except ValueError:
                    event = {"event": "_stdout", "line": raw.decode(errors="replace")}
                self.events.put(event)
        self.events.put({"event": "_exit"})

    def wait_event(
        self,
        name: str,
        timeout: float = 30.0,
        match: Callable[[dict[str, Any]], bool] = lambda _e: True,
    ) -> dict[str, Any]:
        """Return the next event ``name`` that matches, failing after ``timeout``."""
        for event in self.seen:
            if event["event"] == name and match(event) and not event.get("_taken"):
                event["_taken"] = True
                return event
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                event = self.events.get(timeout=max(left, 0.001))
            except queue.Empty:
                names = [e["event"] for e in self.seen]
                raise AssertionError(f"no {name} within {timeout}s; saw {names}") from None
            self.seen.append(event)
            if event["event"] == "_exit" and name != "_exit":
                lines = [e.get("line", e["event"]) for e in self.seen]
                raise AssertionError(f"daemon exited while waiting for {name}: {lines}")
            if event["event"] == name and match(event):
                event["_taken"] = True
                return event

    def drain(self) -> list[dict[str, Any]]:
        """Every event so far, without waiting."""
        while True:
            try:
                self.seen.append(self.events.get_nowait())
            except queue.Empty:
                return self.seen

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal the daemon and return its exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout)
        self._pump_thread.join(timeout)
        return code

    def kill(self) -> None:
        """SIGKILL the daemon if it still runs, and reap it."""
        if self.proc is not None:
            self.stop(signal.SIGKILL)


@pytest.fixture
def daemon_factory(short_dir: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """Start real daemons; every one still running at the end is killed."""
    started: list[DaemonProcess] = []

    def make(
        roots: list[Path],
        *extra: str,
        socket_name: str = "d.sock",
        env: dict[str, str] | None = None,
    ) -> DaemonProcess:
        daemon = DaemonProcess(short_dir / socket_name, roots, *extra, env=env)
        started.append(daemon)
        return daemon.start()

    yield make
    for daemon in started:
        daemon.kill()
        if daemon.proc is not None and daemon.proc.stdout is not None:
            daemon.proc.stdout.close()  # a pipe left open fails the run (ResourceWarning)


@pytest.fixture
def start(daemon_factory: Callable[..., DaemonProcess]) -> Callable[..., DaemonProcess]:
    """``daemon_factory`` under the name the daemon tests use: ``start(roots, *flags)``."""
    return daemon_factory


class LineClient:
    """A raw protocol client over a real Unix socket, one JSON object per line."""

    def __init__(self, path: Path, timeout: float = 30.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))
        self.file = self.sock.makefile("rb")
        self._next = 0

    def send_raw(self, data: bytes) -> None:
        """Send bytes as they are."""
        self.sock.sendall(data)

    def recv(self) -> dict[str, Any]:
        """The next object the daemon sends."""
        line = self.file.readline()
        assert line, "daemon closed the connection"
        result: dict[str, Any] = json.loads(line)
        return result

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request with a fresh id; return its reply."""
        self._next += 1
        rid = self._next
        self.send_raw(json.dumps({"op": op, "id": rid, **fields}).encode() + b"\n")
        while True:
            reply = self.recv()
            if reply.get("id") == rid:
                return reply

    def close(self) -> None:
        """Close the connection."""
        self.file.close()
        self.sock.close()

    def __enter__(self) -> LineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

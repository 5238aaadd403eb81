"""Machinery shared by every fault campaign.

Daemons across restarts, rank processes, small real filesystems, and the invariants
checked on a checkpoint root at rest.

Each campaign (``kill``, ``ranks``, ``disk``, ``fuzz``) is a function returning a
:class:`Result`. The pytest sample calls it with small numbers and asserts that it found
no violation; ``python -m tests.faults`` calls it with large ones and writes the figures.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon import verify_checkpoint
from daemon.store._verify import MANIFEST_NAME
from tests._ranks import free_port, pump_lines, start_rank
from tests._zygote import ForkedProcess, zygote
from tests.conftest import REPO, DaemonProcess, LineClient

__all__ = [
    "WORKER",
    "FaultDaemon",
    "MountRefused",
    "Outcome",
    "Ranks",
    "Result",
    "check_root_at_rest",
    "fill",
    "reader_race_tracebacks",
    "release",
    "run_scenarios",
    "small_tmpfs",
    "step_dirs",
]

WORKER = REPO / "tests" / "faults" / "_worker.py"


@dataclass(slots=True)
class Outcome:
    """One scenario of a campaign: what the guarantees say, what happened."""

    name: str
    expected: str
    observed: str = ""
    violations: list[str] = field(default_factory=list)
    skipped: str | None = None
    seconds: float = 0.0
    evidence: dict[str, Any] = field(default_factory=dict)
    """What the scenario saw (e.g. a failure's reason), for tests that look closer."""


@dataclass(slots=True)
class Result:
    """What one campaign did and every invariant it found broken."""

    name: str
    trials: int = 0
    violations: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, outcome: Outcome) -> None:
        """Record a scenario; its violations become the campaign's."""
        self.outcomes.append(outcome)
        self.trials += outcome.skipped is None
        self.violations += [f"{outcome.name}: {v}" for v in outcome.violations]


_stateless = False


def set_stateless(on: bool) -> None:
    """Stateless campaigns: every daemon run starts on an empty state directory.

    As a Slurm prolog (which wipes the node's state directory for every job) or a pod's
    ``emptyDir`` leaves it: only the root and the ranks carry what the daemon knew. Each
    job (each :class:`Ranks`) then also names its run, as torchrun and Slurm do.
    """
    global _stateless
    _stateless = on


def stateless() -> bool:
    """Whether :func:`set_stateless` is on."""
    return _stateless


class FaultDaemon(DaemonProcess):
    """``ckptd serve`` as a subprocess that may be started, killed and started again.

    Unlike the fixture's daemons it can be launched without waiting for readiness (to
    kill it during recovery), and it counts the events named in ``counted`` instead of
    queueing them, so a run of 100,000 refused requests does not fill the harness.
    """

    def __init__(self, *args: Any, counted: frozenset[str] = frozenset(), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counted = counted
        self.counts: Counter[str] = Counter()
        self.stdout: list[str] = []

    def launch(self) -> FaultDaemon:
        """Start the process; do not wait for ``daemon.ready``."""
        if _stateless and self.state_dir is not None and self.state_dir.exists():
            shutil.rmtree(self.state_dir)
        cmd = [sys.executable, "-m", "daemon", "serve", "--socket", str(self.socket_path)]
        cmd += ["--state-dir", str(self.state_dir)]
        for r in self.roots:
            cmd += ["--root", str(r)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        env.pop("CKPTD_SOCKET", None)
        if "CKPTD_CRASH_AT" not in self.env:
            env.pop("CKPTD_CRASH_AT", None)
        # Forked from a process that imported the daemon once (tests/_zygote.py), as the
        # suite's other daemons are: the campaigns start dozens.
        forked = zygote("daemon")
        if forked is not None:
            self.proc = forked.spawn([*cmd[1:], *self.extra], env, REPO)
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
        return self

    def start(self, timeout: float = 30.0) -> FaultDaemon:
        """Start the process and wait for ``daemon.ready``."""
        self.launch()
        self.wait_event("daemon.ready", timeout=timeout)
        return self

    def ready(self, timeout: float = 60.0) -> bool:
        """Wait for ``daemon.ready``; False if the process exited first."""
        try:
            self.wait_event("daemon.ready", timeout=timeout)
        except AssertionError:
            if not any(e["event"] == "_exit" for e in self.seen):
                raise  # still running, and not ready in time
            assert self.proc is not None
            self.proc.wait(60)  # its output ended: it is exiting, if not yet reaped
            return False
        return True

    def _pump(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        with proc.stdout:
            for raw in proc.stdout:
                try:
                    event = json.loads(raw)
                except ValueError:
                    text = raw.decode(errors="replace")
                    self.stdout.append(text)
                    event = {"event": "_stdout", "line": text}
                if not isinstance(event, dict) or "event" not in event:
                    event = {"event": "_stdout", "line": repr(event)}
                name = event["event"]
                self.counts[name] += 1
                if name not in self.counted:
                    self.events.put(event)
        self.events.put({"event": "_exit"})

    def reap(self, sig: int = signal.SIGKILL) -> int:
        """Signal the process if it still runs, wait for it, read all it printed."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(60)
        self._pump_thread.join(60)
        self.drain()
        return code

    def names(self) -> list[str]:
        """Names of every event read so far, in order."""
        return [e["event"] for e in self.drain()]

    def of(self, name: str) -> list[dict[str, Any]]:
        """Every event ``name`` read so far."""
        return [e for e in self.drain() if e["event"] == name]

    def rss_kib(self) -> int:
        """The daemon's resident set size (``VmRSS``) in KiB."""
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise AssertionError("no VmRSS line")  # pragma: no cover - Linux always has it

    def request(self, op: str, io_timeout: float = 30.0, **fields: Any) -> dict[str, Any]:
        """One request on a fresh connection."""
        with LineClient(self.socket_path, timeout=io_timeout) as client:
            return client.request(op, **fields)


class Ranks:
    """``world`` real rank processes of one job (``tests/faults/_worker.py`` by default)."""

    def __init__(
        self,
        socket_path: Path,
        root: Path,
        world: int,
        *args: str,
        script: Path = WORKER,
        rank_env: Callable[[int], dict[str, str]] | None = None,
    ) -> None:
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.log: list[dict[str, Any]] = []
        self._taken: set[int] = set()
        port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self._pumps: list[threading.Thread] = []
        run = f"job-{uuid.uuid4().hex[:8]}"
        for rank in range(world):
            cmd = [str(script), "--root", str(root), *args]
            extra = rank_env(rank) if rank_env else None
            if _stateless:
                named = {"TORCHELASTIC_RUN_ID": run, "TORCHELASTIC_RESTART_COUNT": "0"}
                extra = {**named, **(extra or {})}
            proc = start_rank(cmd, rank, world, port, socket_path, extra)
            self.procs.append(proc)
            self._pumps.append(pump_lines(proc, rank, self.lines.put))

    def drain(self) -> list[dict[str, Any]]:
        """Every line the ranks printed so far, without waiting."""
        while True:
            try:
                self.log.append(self.lines.get_nowait())
            except queue.Empty:
                return self.log

    def wait_line(self, event: str, timeout: float = 60.0, **match: Any) -> dict[str, Any]:
        """The first line not yet taken with ``event`` and the given fields."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for i in range(seen, len(self.log)):
                line = self.log[i]
                if i not in self._taken and line.get("event") == event:
                    if all(line.get(k) == v for k, v in match.items()):
                        self._taken.add(i)
                        return line
            seen = len(self.log)
            try:
                got = self.lines.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                tail = self.log[-20:]
                raise AssertionError(f"no {event} {match} within {timeout}s: {tail}") from None
            self.log.append(got)

    def wait(self, timeout: float = 120.0) -> list[int]:
        """Exit codes of every rank."""
        codes = [p.wait(timeout) for p in self.procs]
        for pump in self._pumps:
            pump.join(timeout)
        self.drain()
        return codes

    def signal(self, rank: int, sig: int) -> None:
        """Send ``sig`` to one rank."""
        self.procs[rank].send_signal(sig)

    def freeze(self, rank: int, timeout: float = 30.0) -> None:
        """SIGSTOP one rank and return once the whole process has stopped.

        A stop completes only when every thread has taken it; until then a thread that
        I/O wakes (a write to the FIFO it reads) may still run, and the more so on a
        loaded machine. ``waitid(WSTOPPED)`` reports the completed stop (``WNOWAIT``:
        an exit instead is reported without being reaped, so ``Popen`` still sees it).

        Raises:
            AssertionError: the rank exited, or did not stop within ``timeout``.
        """
        proc = self.procs[rank]
        proc.send_signal(signal.SIGSTOP)
        if isinstance(proc, ForkedProcess):  # its parent, the zygote, watches for the stop
            if not proc.wait_stopped(timeout):
                raise AssertionError(f"rank {rank} ended or did not stop within {timeout}s")
            return
        seen: list[os.waitid_result | None] = []
        flags = os.WSTOPPED | os.WEXITED | os.WNOWAIT
        waiter = threading.Thread(
            target=lambda: seen.append(os.waitid(os.P_PID, proc.pid, flags)), daemon=True
        )
        waiter.start()
        waiter.join(timeout)
        if not seen:
            raise AssertionError(f"rank {rank} did not stop within {timeout}s")
        if seen[0] is None or seen[0].si_code != os.CLD_STOPPED:
            raise AssertionError(f"rank {rank} ended instead of stopping: {seen[0]}")

    def kill(self) -> None:
        """Kill every rank still running (continuing stopped ones first) and reap them."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()
        for pump in self._pumps:
            pump.join(30)

    def output(self) -> str:
        """The ranks' non-JSON output (tracebacks), for failure messages."""
        return "".join(x["line"] for x in self.drain() if x.get("event") == "_output")[-3000:]


# What asyncio's default exception handler prints when anyio's raw UNIX socket stream
# (``_RawSocketMixin._wait_until_readable``/``_writable``: ``loop.add_reader(sock,
# f.set_result, None)``) fires its reader for a future that a cancellation already
# completed. The daemon carries on; the lines go to stderr. See docs/reliability.md.
_READER_RACE = (
    "Exception in callback Future.set_result(None)",
    "handle: <Handle Future.set_result(None)>",
    "Traceback (most recent call last):",
    'File "',
    "self._context.run(self._callback, *self._args)",
    "asyncio.exceptions.InvalidStateError: invalid state",
)


def reader_race_tracebacks(lines: list[str]) -> tuple[int, list[str]]:
    """Split a daemon's non-JSON output into anyio reader-race tracebacks and the rest.

    Returns:
        How many such tracebacks there were, and every line that is not part of one.
    """
    count, rest, i = 0, [], 0
    while i < len(lines):
        block = lines[i : i + len(_READER_RACE)]
        if len(block) == len(_READER_RACE) and all(
            line.strip().startswith(want) for line, want in zip(block, _READER_RACE, strict=True)
        ):
            count += 1
            i += len(block)
        else:
            rest.append(lines[i])
            i += 1
    return count, rest


def release(gate: Path) -> None:
    """Let the rank waiting at the FIFO ``gate`` go on.

    Raises:
        AssertionError: no rank has the gate open (it has not reached it, or died).
    """
    try:
        fd = os.open(gate, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:  # ENXIO: nobody reads; never block on an absent reader
        raise AssertionError(f"no rank waits at {gate}: {exc}") from exc
    try:
        os.write(fd, b"x")
    finally:
        os.close(fd)


# -- small real filesystems -------------------------------------------------------------


class MountRefused(OSError):
    """Raised when this machine does not let the harness mount a tmpfs."""


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` (e.g. ``"6m"``) mounted at ``path``, unmounted after.

    Raises:
        MountRefused: not root, or no ``CAP_SYS_ADMIN`` (an unprivileged container).
    """
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        raise MountRefused(errno.EPERM, f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def fill(directory: Path, leave: int = 0) -> Path:
    """Fill the filesystem of ``directory`` with one file, leaving at most ``leave`` bytes.

    With ``leave=0`` it writes down to the last byte. Returns the filler file; removing
    it frees the space.
    """
    filler = directory / f".filler-{os.getpid()}-{time.monotonic_ns()}"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        st = os.statvfs(directory)
        target = max(0, st.f_bavail * st.f_frsize - leave)
        block = b"\0" * (1 << 20)
        written = 0
        while written + len(block) <= target:
            written += os.write(fd, block)
        if leave == 0:
            for size in (65536, 4096, 512, 1):
                with contextlib.suppress(OSError):
                    while os.write(fd, b"\0" * size):
                        pass
        else:
            with contextlib.suppress(OSError):
                os.write(fd, b"\0" * max(0, target - written))
    finally:
        os.close(fd)
    return filler


# -- invariants of a root at rest --------------------------------------------------------


def step_dirs(root: Path, prefix: str) -> set[int]:
    """Steps that have a directory ``ROOT/<prefix>N``."""
    found = set()
    for name in os.listdir(root):
        digits = name[len(prefix) :] if name.startswith(prefix) else ""
        if digits.isdigit():
            found.add(int(digits))
    return found


def check_root_at_rest(root: Path, verified: set[int]) -> list[str]:
    """Invariants 1, 3 and 5 on a root no daemon is changing (e.g. just after a SIGKILL).

    - no step exists both as ``tmp_step_N`` and ``step_N`` (promoted half);
    - every ``step_N`` has its manifest and passes ``ckptd verify`` (checked once per
      step: a promoted checkpoint never changes), and none that passed has vanished;
    - ``latest``, if present, names an existing ``step_N``.

    ``verified`` holds the steps already checked; newly checked ones are added to it.
    """
    problems: list[str] = []
    final, tmp = step_dirs(root, "step_"), step_dirs(root, "tmp_step_")
    problems += [f"step {s} exists both as tmp_step_{s} and step_{s}" for s in sorted(final & tmp)]
    problems += [f"promoted step_{s} vanished" for s in sorted(verified - final)]
    for step in sorted(final - verified):
        path = root / f"step_{step}"
        if not (path / MANIFEST_NAME).is_file():
            problems.append(f"step_{step} has no manifest")
            continue
        found = verify_checkpoint(str(path))
        if found:
            problems.append(f"step_{step} fails verification: {'; '.join(found[:3])}")
            continue
        verified.add(step)
    pointer = root / "latest"
    if os.path.lexists(pointer):
        target = os.readlink(pointer) if pointer.is_symlink() else "<not a symlink>"
        digits = target.removeprefix("step_")
        if not (target.startswith("step_") and digits.isdigit() and int(digits) in final):
            problems.append(f"latest names {target!r}, not a promoted step")
    return problems


def run_scenarios(
    name: str,
    scenarios: dict[str, Callable[[Path], Outcome]],
    workdir: Path,
    rounds: int = 1,
    progress: Callable[[str], None] = lambda _m: None,
) -> Result:
    """Run every scenario ``rounds`` times, each in a fresh directory under ``workdir``."""
    result = Result(name)
    started = time.monotonic()
    for round_ in range(rounds):
        for key, scenario in scenarios.items():
            where = workdir / f"{key}-{round_}"
            where.mkdir()
            began = time.monotonic()
            try:
                outcome = scenario(where)
            except MountRefused as exc:
                outcome = Outcome(key, "", skipped=exc.strerror)
            except AssertionError as exc:  # a wait that ran out is a finding too
                outcome = Outcome(key, "", violations=[str(exc)[:500]])
            outcome.seconds = time.monotonic() - began
            result.add(outcome)
            progress(f"{name}: {key}: {outcome.skipped or outcome.violations or 'ok'}")
    result.seconds = time.monotonic() - started
    return result

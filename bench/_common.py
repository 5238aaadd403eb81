"""What every benchmark shares: result rows, percentiles, a daemon subprocess, the machine.

Every figure a benchmark reports is a :class:`Row`: a median and a p99 over repeated
samples, and, where there is one, the baseline measured in the same run and the ratio
to it, with the target and whether it was met. Rows are plain data so they go straight
into the JSON results and the table.
"""

from __future__ import annotations

import json
import math
import os
import platform
import queue
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

__all__ = [
    "REPO",
    "BenchResult",
    "Daemon",
    "Row",
    "free_port",
    "machine_info",
    "median",
    "p99",
    "parse_ts",
    "markdown_table",
    "print_table",
    "raise_nofile",
    "scratch_dir",
]

REPO = Path(__file__).resolve().parent.parent
"""The source tree whose ``daemon`` and ``orchestrator`` are measured."""


@dataclass(slots=True)
class Row:
    """One reported figure: the median (and p99) of a metric, against a baseline."""

    bench: str
    """Benchmark that produced it (``stall``, ``throughput``, ...)."""
    name: str
    """The case measured, e.g. ``64 MB (d) ckptd``."""
    metric: str
    """What was measured, e.g. ``blocked per save``."""
    unit: str
    median: float
    p99: float | None = None
    n: int = 0
    """Samples behind the median."""
    baseline: float | None = None
    """The baseline's median, measured in the same run."""
    baseline_name: str | None = None
    ratio: float | None = None
    """``median / baseline``."""
    target: str | None = None
    met: bool | None = None
    """Whether the target was met; None where the row has no target."""
    note: str = ""


@dataclass(slots=True)
class BenchResult:
    """What one benchmark returns: its rows and its raw samples."""

    rows: list[Row]
    raw: dict[str, Any] = field(default_factory=dict)


def median(values: Sequence[float]) -> float:
    """The median of ``values`` (NaN when empty)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def p99(values: Sequence[float]) -> float:
    """The 99th percentile by nearest rank (the maximum for fewer than 100 samples)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def parse_ts(stamp: str) -> float:
    """A daemon event's ISO-8601 ``timestamp`` as POSIX seconds."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def raise_nofile(wanted: int) -> int:
    """Raise this process's open-file soft limit towards ``wanted``; children inherit it.

    Returns:
        The soft limit now in force.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


@contextmanager
def scratch_dir(base: str | None = None) -> Iterator[Path]:
    """A short temporary directory, removed after.

    Checkpoints, journals and the socket live here, so it must be on the disk being
    measured (not tmpfs): ``$CKPTD_BENCH_DIR``, default ``/var/tmp``. Its path stays
    short, since AF_UNIX socket paths must fit in 107 bytes.
    """
    base = base or os.environ.get("CKPTD_BENCH_DIR") or "/var/tmp"
    path = Path(tempfile.mkdtemp(prefix="ckb-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _read_kib(pid: int, field_name: str) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field_name} not in /proc/{pid}/status")


def _toml(value: int | str) -> str:
    """``value`` as a TOML literal (strings quoted as JSON quotes them, which TOML reads)."""
    return json.dumps(value) if isinstance(value, str) else str(value)


class Daemon:
    """``ckptd serve`` as a subprocess, with its stdout events readable as they come.

    Args:
        workdir: A short directory for the socket (and the state, unless ``state_dir``).
        roots: The checkpoint roots to configure.
        state_dir: Journal directory (default ``workdir/state``).
        module: Module run with ``python -m`` (``daemon``).
        keep_events: Parse and keep every event; False discards them after
            ``daemon.ready``, so a load test does not spend the bench's CPU on them.
        extra: More ``serve`` flags.
        tree: Source tree to run the daemon from (another checkout, to compare builds).
        settings: Configuration keys written to a TOML file passed with ``--config``
            (e.g. ``{"max_open_saves": 10**6}`` for a load test that leaves saves open).
        wrap: A command prefix the daemon runs under (``nsenter -t PID -m --``).
    """

    def __init__(
        self,
        workdir: Path,
        roots: Sequence[Path],
        *,
        state_dir: Path | None = None,
        module: str = "daemon",
        keep_events: bool = True,
        extra: Sequence[str] = (),
        tree: Path = REPO,
        settings: Mapping[str, int | str] | None = None,
        wrap: Sequence[str] = (),
    ) -> None:
        self.tree = tree
        self.wrap = list(wrap)
        """A command the daemon runs under (``nsenter ... --``, inside a mount namespace)."""
        self.socket = str(workdir / "d.sock")
        self.state_dir = state_dir or workdir / "state"
        self.roots = list(roots)
        self.module = module
        self.keep_events = keep_events
        self.extra = list(extra)
        if settings:
            config = workdir / "bench.toml"
            config.write_text("".join(f"{k} = {_toml(v)}\n" for k, v in settings.items()))
            self.extra += ["--config", str(config)]
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self._ready = threading.Event()
        self.ready_s = math.nan
        """Seconds from spawning the process to reading its ``daemon.ready`` line."""

    @property
    def pid(self) -> int:
        """The daemon's process id."""
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 60.0) -> Daemon:
        """Spawn the daemon and wait for ``daemon.ready``.

        Raises:
            RuntimeError: it exited or was not ready within ``timeout``.
        """
        cmd = [*self.wrap, sys.executable, "-m", self.module, "serve", "--socket", self.socket]
        cmd += ["--state-dir", str(self.state_dir)]
        for root in self.roots:
            cmd += ["--root", str(root)]
        # The bench package comes from this tree (for its shims), the daemon from ``tree``.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{self.tree}:{REPO}"}
        env.pop("CKPTD_SOCKET", None)
        self._ready.clear()
        start = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd + self.extra,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.tree,
        )
        self._pump = threading.Thread(target=self._read, args=(self.proc, start), daemon=True)
        self._pump.start()
        if not self._ready.wait(timeout) or self.proc.poll() is not None:
            self.stop(signal.SIGKILL)
            lines = [e.get("line", e.get("event")) for e in self.drain()]
            raise RuntimeError(f"daemon not ready within {timeout}s: {lines[-20:]}")
        return self

    def _read(self, proc: subprocess.Popen[bytes], start: float) -> None:
        assert proc.stdout is not None
        with proc.stdout:
            for raw in proc.stdout:
                if not self._ready.is_set() and b'"daemon.ready"' in raw:
                    self.ready_s = time.perf_counter() - start
                    self._ready.set()
                elif not self.keep_events and self._ready.is_set():
                    continue
                try:
                    event = json.loads(raw)
                except ValueError:
                    event = {"event": "_stdout", "line": raw.decode(errors="replace")}
                event["_received"] = time.perf_counter()
                self.events.put(event)
        self.events.put({"event": "_exit"})
        self._ready.set()

    def wait_event(
        self,
        name: str,
        timeout: float = 60.0,
        match: Callable[[dict[str, Any]], bool] = lambda _e: True,
    ) -> dict[str, Any]:
        """The next not-yet-taken event ``name`` that matches, within ``timeout``.

        Raises:
            TimeoutError: none arrived in time, or the daemon exited.
        """
        for event in self.seen:
            if event["event"] == name and match(event) and not event.get("_taken"):
                event["_taken"] = True
                return event
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self.events.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                raise TimeoutError(f"no {name} event within {timeout}s") from None
            self.seen.append(event)
            if event["event"] == "_exit":
                raise TimeoutError(f"daemon exited while waiting for {name}")
            if event["event"] == name and match(event):
                event["_taken"] = True
                return event

    def drain(self) -> list[dict[str, Any]]:
        """Every event read so far."""
        while True:
            try:
                self.seen.append(self.events.get_nowait())
            except queue.Empty:
                return self.seen

    def rss_kib(self) -> int:
        """The daemon's resident set (``VmRSS``) in KiB."""
        return _read_kib(self.pid, "VmRSS")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal the daemon, wait for it and return its exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._pump.join(timeout)
        return code

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _package(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "absent"


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info(scratch: str = "/tmp") -> dict[str, Any]:
    """Where and when the benchmarks ran: CPUs, memory, disk, load, versions, date."""
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = next(ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "loadavg": os.getloadavg(),
        "free_h": _run(["free", "-h"]),
        "disk": _run(["df", "-hT", scratch]),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": _package("torch"),
        "anyio": _package("anyio"),
        "msgspec": _package("msgspec"),
        "uvloop": _package("uvloop"),
        "ckptd": _package("ckptd"),
        "git": _run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]),
    }


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    text = f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return f"{text} {unit}".strip()


def print_table(rows: Sequence[Row], out: Any = None) -> None:
    """Print ``rows`` as an aligned text table (one line per row)."""
    out = out or sys.stdout
    head = ["bench", "case", "metric", "median", "p99", "baseline", "ratio", "target", "met"]
    body = [
        [
            r.bench,
            r.name,
            r.metric,
            _fmt(r.median, r.unit),
            _fmt(r.p99, r.unit),
            f"{_fmt(r.baseline, r.unit)}" + (f" ({r.baseline_name})" if r.baseline_name else ""),
            "-" if r.ratio is None else f"{r.ratio:.3g}x",
            r.target or "",
            {True: "yes", False: "NO", None: ""}[r.met],
        ]
        for r in rows
    ]
    widths = [
        max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)
    ]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)), file=out)
    for line in body:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)), file=out)
    out.flush()


def markdown_table(rows: Sequence[Row]) -> str:
    """``rows`` as a Markdown table (for ``docs/performance.md``)."""
    head = "| bench | case | metric | median | p99 | n | baseline | ratio | target | met |"
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        base = _fmt(r.baseline, r.unit) + (f" ({r.baseline_name})" if r.baseline_name else "")
        cells = [
            r.bench,
            r.name,
            r.metric,
            _fmt(r.median, r.unit),
            _fmt(r.p99, r.unit),
            str(r.n),
            base,
            "-" if r.ratio is None else f"{r.ratio:.3g}x",
            r.target or "",
            {True: "yes", False: "**no**", None: ""}[r.met],
        ]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"

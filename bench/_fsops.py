"""Counting the filesystem operations processes make on one directory, with strace.

``strace -f -y -ttt --seccomp-bpf -e trace=... -p PID`` logs every call a process makes
that can reach a filesystem's server, with the path each file descriptor names
(``-y``) and the wall-clock time of each; only those calls stop the process
(``--seccomp-bpf``), so the rest of it runs at full speed. :func:`count` turns the calls
on paths under one directory into the operations a network filesystem's client would
send for them, per time window:

| call | operations |
|---|---|
| ``openat`` | LOOKUP, and OPEN when it succeeds (CREATE too with ``O_CREAT``) |
| ``newfstatat``, ``statx``, ``lstat``, ``stat`` | LOOKUP, GETATTR |
| ``fstat``, or any of those on an open file (``AT_EMPTY_PATH``) | GETATTR |
| ``getdents64`` returning entries | READDIR |
| ``read`` returning data | READ |
| ``rename*`` | LOOKUP, RENAME |
| ``mkdir*`` | LOOKUP, CREATE |
| ``fsync``, ``fdatasync`` | FSYNC |

These are the calls the code makes, one client's worth per simulated node: a real
client's cache can only take some away (a lookup it answered from its cache), so they
bound what reaches the server from above (``docs/multinode.md``, "The load").

strace stops a traced thread at each of those calls until strace has logged it; with
thousands of threads (the simulated nodes' lanes) it falls behind, and the process
with it. The simulated nodes are therefore counted by the kernel too
(:class:`Counters`: ``perf stat`` on the syscall tracepoints, 100 ms at a time, which
stops nothing): the same calls, with no paths (after start-up, the simulated nodes'
process opens and lists nothing but the root) and no READ (a ``read`` count would
include its pipes). The benchmark checks the two against each other where both run.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["KINDS", "METADATA", "Counters", "Tracer", "available", "count"]

KINDS = ("LOOKUP", "GETATTR", "READDIR", "OPEN", "READ", "CREATE", "RENAME", "FSYNC")
"""Every kind of operation counted."""
METADATA = ("LOOKUP", "GETATTR", "READDIR", "OPEN", "CREATE", "RENAME")
"""The metadata operations (what loads a metadata server): all but READ and FSYNC."""

_CALLS = (
    "openat,newfstatat,statx,lstat,stat,fstat,getdents64,read,rename,renameat,renameat2,"
    "mkdir,mkdirat,fsync,fdatasync"
)
_LINE = re.compile(r"^(?P<pid>\d+)\s+(?P<t>\d+\.\d+)\s+(?P<rest>.*)$")
_CALL = re.compile(r"^(?P<name>\w+)\((?P<args>.*)\)\s+=\s+(?P<ret>-?\d+)(?P<tail>.*)$")
_UNFINISHED = " <unfinished ...>"
_RESUMED = re.compile(r"^<\.\.\. (?P<name>\w+) resumed>(?P<rest>.*)$")


def available() -> str | None:
    """Why strace and perf cannot count here, or None when they can."""
    if shutil.which("strace") is None:
        return "strace is not installed (apt-get install -y strace)"
    if shutil.which("perf") is None:
        return "perf is not installed (apt-get install -y linux-perf)"
    return None


_INTERVAL = 0.1
"""Seconds between perf's counts."""

# (tracepoint, filter, operations): one perf event each, in this order.
_EVENTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("sys_enter_openat", "", ("LOOKUP",)),
    ("sys_exit_openat", "ret >= 0", ("OPEN",)),
    ("sys_enter_openat", "flags & 64", ("CREATE",)),  # O_CREAT
    # An open file's attributes (``fstat``, which glibc makes ``AT_EMPTY_PATH``) need no
    # lookup; a path's do.
    ("sys_enter_newfstatat", "!(flag & 4096)", ("LOOKUP", "GETATTR")),
    ("sys_enter_newfstatat", "flag & 4096", ("GETATTR",)),
    ("sys_enter_statx", "!(flags & 4096)", ("LOOKUP", "GETATTR")),
    ("sys_enter_statx", "flags & 4096", ("GETATTR",)),
    ("sys_enter_newfstat", "", ("GETATTR",)),
    ("sys_exit_getdents64", "ret > 0", ("READDIR",)),
    ("sys_enter_rename", "", ("LOOKUP", "RENAME")),
    ("sys_enter_renameat", "", ("LOOKUP", "RENAME")),
    ("sys_enter_renameat2", "", ("LOOKUP", "RENAME")),
    ("sys_enter_mkdir", "", ("LOOKUP", "CREATE")),
    ("sys_enter_mkdirat", "", ("LOOKUP", "CREATE")),
    ("sys_enter_fsync", "", ("FSYNC",)),
    ("sys_enter_fdatasync", "", ("FSYNC",)),
)


class Counters:
    """``perf stat`` counting a command's calls (every thread), 100 ms at a time.

    :attr:`prefix` goes before the command; :meth:`count` reads the log once it ended.
    """

    def __init__(self, out: Path) -> None:
        self.out = out
        self.prefix = ["perf", "stat", "-I", str(round(_INTERVAL * 1000)), "-x", ","]
        self.prefix += ["-o", str(out)]
        for tracepoint, condition, _ops in _EVENTS:
            self.prefix += ["-e", f"syscalls:{tracepoint}"]
            if condition:
                self.prefix += ["--filter", condition]
        self.prefix.append("--")
        self.started = 0.0
        """Wall-clock time the command started (set by the caller just before)."""

    def count(self, windows: dict[str, tuple[float, float]]) -> dict[str, Counter[str]]:
        """The operations per named wall-clock window (to within a 100 ms interval)."""
        out: dict[str, Counter[str]] = {name: Counter() for name in windows}
        index: dict[str, int] = {}
        with open(self.out, encoding="utf-8") as fh:
            for line in fh:
                fields = line.strip().split(",")
                if len(fields) < 4 or line.startswith("#"):
                    continue
                try:
                    at = self.started + float(fields[0])
                    value = int(fields[1])
                except ValueError:
                    continue  # <not counted>: no thread ran
                # Each interval lists the events in order; the same tracepoint appears
                # twice (with and without a filter), so the position says which.
                stamp = fields[0]
                position = index.get(stamp, 0)
                index[stamp] = position + 1
                if position >= len(_EVENTS):
                    continue
                ops = _EVENTS[position][2]
                for window, (start, end) in windows.items():
                    # An interval's count is of the 100 ms before its stamp: a window
                    # takes the share of it that it overlaps.
                    share = (min(end, at) - max(start, at - _INTERVAL)) / _INTERVAL
                    if share > 0:
                        for op in ops:
                            out[window][op] += round(value * share)
        return out


class Tracer:
    """strace attached to running processes (and their threads) until :meth:`stop`."""

    def __init__(self, pids: Sequence[int], out: Path) -> None:
        self.out = out
        cmd = ["strace", "-f", "-qq", "-y", "-ttt", "--seccomp-bpf", "-e", f"trace={_CALLS}"]
        cmd += ["-o", str(out)]
        for pid in pids:
            cmd += ["-p", str(pid)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def stop(self) -> None:
        """Detach (the traced processes go on) and wait for the log to be complete."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.communicate(timeout=60.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()


def _calls(lines: Iterable[str]) -> Iterable[tuple[float, str, str, int, str]]:
    """(time, call, args, return value, what follows it) of each finished call."""
    pending: dict[str, tuple[float, str]] = {}
    for raw in lines:
        match = _LINE.match(raw.rstrip("\n"))
        if match is None:
            continue
        pid, t, rest = match["pid"], float(match["t"]), match["rest"]
        if rest.endswith(_UNFINISHED):
            pending[pid] = (t, rest[: -len(_UNFINISHED)])
            continue
        resumed = _RESUMED.match(rest)
        if resumed is not None:
            began = pending.pop(pid, None)
            if began is None:
                continue
            t, rest = began[0], began[1] + resumed["rest"]
        call = _CALL.match(rest)
        if call is not None:
            yield t, call["name"], call["args"], int(call["ret"]), call["tail"]


def _ops(name: str, args: str, ret: int, flags_create: bool) -> list[str]:
    if name == "openat":
        if ret < 0:
            return ["LOOKUP"]
        return ["LOOKUP", "OPEN", "CREATE"] if flags_create else ["LOOKUP", "OPEN"]
    if name in ("newfstatat", "statx", "lstat", "stat"):
        if "AT_EMPTY_PATH" in args:
            return ["GETATTR"]  # an open file's: no lookup
        return ["LOOKUP"] if ret < 0 else ["LOOKUP", "GETATTR"]
    if name == "fstat":
        return ["GETATTR"]
    if name == "getdents64":
        return ["READDIR"] if ret > 0 else []
    if name == "read":
        return ["READ"] if ret > 0 else []
    if name.startswith("rename"):
        return ["LOOKUP", "RENAME"]
    if name.startswith("mkdir"):
        return ["LOOKUP", "CREATE"]
    if name in ("fsync", "fdatasync"):
        return ["FSYNC"]
    return []


def count(
    log: Path, under: Sequence[str], windows: dict[str, tuple[float, float]]
) -> dict[str, Counter[str]]:
    """The operations in ``log`` on paths under ``under``, per named time window.

    Args:
        log: An strace log written by :class:`Tracer`.
        under: Directories whose calls count (the root as each process names it).
        windows: Name -> (start, end) in wall-clock seconds.
    """
    prefixes = tuple(d.rstrip("/") + "/" for d in under) + tuple(under)
    out: dict[str, Counter[str]] = {name: Counter() for name in windows}
    with open(log, encoding="utf-8", errors="replace") as fh:
        for t, name, args, ret, tail in _calls(fh):
            paths = re.findall(r'"([^"]*)"|<([^<>]*)>', args + tail)
            named = [a or b for a, b in paths]
            if not any(n.startswith(prefixes) for n in named):
                continue
            ops = _ops(name, args, ret, "O_CREAT" in args)
            for window, (start, end) in windows.items():
                if start <= t < end:
                    out[window].update(ops)
    return out

"""The filesystem calls a piece of code makes, counted by strace in a fresh interpreter.

What a look or a scan costs a shared filesystem's server is the calls it makes by path
(each a lookup there) and on open files; the code's own structure is not asked.
``traced`` runs a snippet under ``strace -f -y`` and counts, per kind of call and file
name, the calls on paths under one directory:

| kind | calls |
|---|---|
| ``open`` | ``openat`` by path: a lookup and an open |
| ``stat`` | ``newfstatat``, ``statx``, ``lstat``, ``stat`` by path: a lookup and attributes |
| ``fstat`` | the same on an open file (``AT_EMPTY_PATH``), ``fstat``: attributes only |
| ``fsync`` | ``fsync``, ``fdatasync`` |
| ``rename`` | ``rename``, ``renameat``, ``renameat2`` |
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from tests._system import require_tool

__all__ = ["traced"]

_CALLS = "openat,newfstatat,statx,lstat,stat,fstat,fsync,fdatasync,rename,renameat,renameat2"
_LINE = re.compile(
    r"^(?:\d+\s+)?(?P<name>\w+)\((?P<args>.*?)(?:\)\s+=\s+-?\d+.*| <unfinished \.\.\.>)$"
)
"""A call, finished or (another thread's call logged meanwhile) begun: each counted once,
at its beginning; ``<... resumed>`` lines match nothing."""
_QUOTED = re.compile(r'"(?P<path>[^"]+)"')
_FD = re.compile(r"\d+<(?P<path>[^>]*)>")
_KINDS = {
    "openat": "open",
    "newfstatat": "stat",
    "statx": "stat",
    "lstat": "stat",
    "stat": "stat",
    "fstat": "fstat",
    "fsync": "fsync",
    "fdatasync": "fsync",
    "rename": "rename",
    "renameat": "rename",
    "renameat2": "rename",
}
_REPO = Path(__file__).resolve().parent.parent


def traced(code: str, under: Path) -> Counter[tuple[str, str]]:
    """Run Python ``code`` under strace; its calls on paths under ``under``.

    Returns:
        ``(kind, path relative to under)`` -> how many times (the kinds are in the
        module's docstring), for the calls whose path, or whose open file's, lies
        under ``under``.
    """
    strace = require_tool("strace")
    out = under.parent / f"{under.name}.strace"
    env = {**os.environ, "PYTHONPATH": str(_REPO)}
    cmd = [strace, "-f", "-qq", "-y", "-e", f"trace={_CALLS}", "-o", str(out)]
    subprocess.run([*cmd, sys.executable, "-c", code], check=True, env=env, timeout=120)
    base = str(under.resolve())
    calls: Counter[tuple[str, str]] = Counter()
    for line in out.read_text().splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        kind = _KINDS[m.group("name")]
        found = _QUOTED.search(m.group("args"))
        if found is None:
            found = _FD.search(m.group("args"))
            if found is None:
                continue
            kind = "fstat" if kind == "stat" else kind
        path = found.group("path")
        if not os.path.isabs(path) and (at := _FD.search(m.group("args"))) is not None:
            path = os.path.join(at.group("path"), path)  # relative to a directory's fd
        if path == base or path.startswith(base + os.sep):
            calls[(kind, os.path.relpath(path, base))] += 1
    return calls

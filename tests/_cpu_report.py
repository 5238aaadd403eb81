"""CPU and wall time per test file: the suite's budget, printed at the end of every run.

``tests/conftest.py`` loads it in every run. Each test's CPU is counted across
its setup, call and teardown: the worker's own (``getrusage``), its reaped children's
(a daemon or rank started with ``subprocess``), and that of every process a zygote
forked for it (``tests/_zygote.py``: the zygote, their parent, reaps them and sends
their ``wait4`` usage back), so a rank or daemon a test starts counts once it has ended,
whichever started it. Under ``pytest-xdist`` each worker sends its rows to the
controller when it finishes; the controller prints the files that cost the most CPU,
and each worker's start (collection: importing what test modules import at the top).
"""

from __future__ import annotations

import collections
import os
import resource
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests import _zygote

SHOWN = int(os.environ.get("CKPTD_TEST_CPU_SHOWN", "10"))
"""How many test files the summary lists (``CKPTD_TEST_CPU_SHOWN``, default 10)."""

BY_TEST = os.environ.get("CKPTD_TEST_CPU_BY") == "test"
"""``CKPTD_TEST_CPU_BY=test``: the summary lists tests, not files (to find what to cut)."""

_KEY = "ckptd_cpu_rows"
_START_KEY = "ckptd_cpu_start"

_rows: list[tuple[str, float, float]] = []
_start_cpu: list[float] = []


def _cpu() -> float:
    own, children = (
        resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return (
        own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + _zygote.forked_cpu()
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    """Record what this process spent before the first test (imports, collection)."""
    _start_cpu.append(_cpu())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Count the test's wall and CPU time against its file."""
    wall, cpu = time.monotonic(), _cpu()
    try:
        return (yield)
    finally:
        key = item.nodeid if BY_TEST else item.nodeid.split("::")[0]
        _rows.append((key, time.monotonic() - wall, _cpu() - cpu))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On an xdist worker, hand the rows to the controller."""
    output: dict[str, Any] | None = getattr(session.config, "workeroutput", None)
    if output is not None:
        output[_KEY] = list(_rows)
        output[_START_KEY] = _start_cpu[0] if _start_cpu else 0.0


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent when the run is serial
def pytest_testnodedown(node: Any, error: object) -> None:
    """On the controller, take a finished worker's rows."""
    output: dict[str, Any] = getattr(node, "workeroutput", {}) or {}
    _rows.extend(tuple(row) for row in output.get(_KEY, ()))
    if _START_KEY in output:
        _start_cpu.append(float(output[_START_KEY]))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The files that cost the most CPU, the totals, and the workers' start."""
    if not _rows or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    wall: collections.defaultdict[str, float] = collections.defaultdict(float)
    cpu: collections.defaultdict[str, float] = collections.defaultdict(float)
    tests: collections.Counter[str] = collections.Counter()
    for path, w, c in _rows:
        wall[path] += w
        cpu[path] += c
        tests[path] += 1
    write = terminalreporter.write_line
    terminalreporter.section(
        f"the {SHOWN} test {'s' if BY_TEST else 'file'}s that cost the most CPU"
    )
    for path, seconds in sorted(cpu.items(), key=lambda kv: -kv[1])[:SHOWN]:
        write(f"{seconds:7.1f} s cpu {wall[path]:7.1f} s wall {tests[path]:5d} tests  {path}")
    started = ", ".join(f"{s:.1f}" for s in sorted(_start_cpu))
    write(
        f"tests: {sum(cpu.values()):.0f} s cpu, {sum(wall.values()):.0f} s wall summed over "
        f"{len(_rows)} tests; each process's start (imports and collection): {started} s cpu"
    )

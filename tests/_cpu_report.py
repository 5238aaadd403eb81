"""CPU and wall time per test file, for finding where the suite's time goes.

Opt in, in one process: ``CKPTD_TEST_WORKERS=0 scripts/test -p tests._cpu_report``.
CPU is this process's and its reaped children's (``getrusage``) across each test's
setup, call and teardown, so a rank or daemon a test starts counts once it has ended.
"""

from __future__ import annotations

import collections
import resource
import time
from collections.abc import Iterator

import pytest

_rows: list[tuple[str, float, float]] = []


def _cpu() -> float:
    own, children = (
        resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    wall, cpu = time.monotonic(), _cpu()
    try:
        return (yield)
    finally:
        _rows.append((item.nodeid.split("::")[0], time.monotonic() - wall, _cpu() - cpu))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    wall: collections.defaultdict[str, float] = collections.defaultdict(float)
    cpu: collections.defaultdict[str, float] = collections.defaultdict(float)
    tests: collections.Counter[str] = collections.Counter()
    for path, w, c in _rows:
        wall[path] += w
        cpu[path] += c
        tests[path] += 1
    write = terminalreporter.write_line
    write(f"CPU by test file (total {sum(cpu.values()):.0f} s, wall {sum(wall.values()):.0f} s):")
    for path, seconds in sorted(cpu.items(), key=lambda kv: -kv[1])[:30]:
        write(f"{seconds:8.1f} s cpu {wall[path]:8.1f} s wall {tests[path]:5d} tests  {path}")

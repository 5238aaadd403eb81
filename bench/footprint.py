"""Benchmark 6: the daemon's memory footprint and how fast it starts.

- Start: seconds from spawning ``ckptd serve`` to its ``daemon.ready`` line, with an
  empty state directory (cold). Baseline: a bare ``python -c pass`` in the same run.
- Resident memory (``VmRSS`` from ``/proc``): idle after start; with 1,024 client
  connections open (each has sent a ``ping`` and had its reply); with 10,000 steps
  known. The steps are world-size-2 saves of which only rank 0 begins and reports
  done, so all 10,000 stay open in the ledger with their leases and deadlines (the
  heaviest kind; settled saves are bounded by the ledger's history of 4,096).
- Recovery: the daemon holding those 10,000 open steps is stopped (SIGTERM) and started
  again on the same ``--state-dir``; seconds to ``daemon.ready`` (journal replayed,
  leases re-armed, journal compacted, roots scanned for orphans).

    .venv/bin/python -m bench.footprint [--full] [--steps 10000] [--connections 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time
from typing import Any

import msgspec

from ._common import BenchResult, Daemon, Row, median, p99, print_table, raise_nofile, scratch_dir

__all__ = ["run"]


def _interpreter_start() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return time.perf_counter() - start


def _open_connections(path: str, count: int) -> list[socket.socket]:
    """``count`` connections, each answered once (so the daemon serves every one)."""
    socks = []
    for i in range(count):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(60.0)
        s.connect(path)
        s.sendall(b'{"op": "ping", "id": %d}\n' % i)
        socks.append(s)
    for s in socks:
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(4096)
            if not chunk:
                raise ConnectionError("daemon closed a connection")
            buf += chunk
        if b'"ok":true' not in buf.replace(b" ", b""):
            raise RuntimeError(f"ping refused: {buf!r}")
    return socks


async def _drive_steps(path: str, root: str, steps: int, conns: int) -> None:
    async def one(first: int) -> None:
        reader, writer = await asyncio.open_unix_connection(path)
        try:
            for step in range(first, steps, conns):
                for op in ("begin", "done"):
                    req: dict[str, Any] = {"op": op, "id": step, "root": root, "step": step}
                    req["rank"] = 0
                    if op == "begin":
                        req["world_size"] = 2
                    writer.write(msgspec.json.encode(req) + b"\n")
                    reply = msgspec.json.decode(await reader.readline())
                    if not reply.get("ok"):
                        raise RuntimeError(f"refused: {reply}")
        finally:
            writer.close()

    await asyncio.gather(*(one(i) for i in range(conns)))


def _settle_rss(daemon: Daemon) -> float:
    time.sleep(0.5)
    return daemon.rss_kib() / 1024


def run(
    quick: bool = True,
    *,
    starts: int | None = None,
    connections: int = 1024,
    steps: int = 10_000,
) -> BenchResult:
    """Run benchmark 6.

    Args:
        quick: 3 cold starts and 2 recoveries; full: 10 and 5.
        starts: Cold starts (overrides the mode; recoveries: half, at least 1).
        connections: Connections held open for the RSS figure.
        steps: Open steps for the RSS and recovery figures.
    """
    raise_nofile(connections + 512)  # the daemon inherits it
    cold_n = starts or (3 if quick else 10)
    recov_n = max(1, cold_n // 2)
    cold: list[float] = []
    interp: list[float] = []
    idle_mb: list[float] = []
    recovery: list[float] = []
    with scratch_dir() as work:
        root = work / "run"
        root.mkdir()
        for i in range(cold_n):
            interp.append(_interpreter_start())
            state = work / f"cold{i}"
            with Daemon(work, [root], state_dir=state, keep_events=False) as daemon:
                cold.append(daemon.ready_s)
                idle_mb.append(_settle_rss(daemon))
        state = work / "state"
        lifted = {"max_open_saves": 2 * steps}  # the default cap is 10,000 open saves
        daemon = Daemon(work, [root], state_dir=state, keep_events=False, settings=lifted).start()
        try:
            socks = _open_connections(daemon.socket, connections)
            conn_mb = _settle_rss(daemon)
            for s in socks:
                s.close()
            asyncio.run(_drive_steps(daemon.socket, str(root), steps, 64))
            steps_mb = _settle_rss(daemon)
        finally:
            daemon.stop()
        for _ in range(recov_n):
            with Daemon(work, [root], state_dir=state, keep_events=False, settings=lifted) as again:
                recovery.append(again.ready_s)
                recovered_mb = _settle_rss(again)
    idle = median(idle_mb)
    rows = []
    row = Row("footprint", "cold start", "spawn -> daemon.ready", "s", median(cold))
    row.p99, row.n = p99(cold), len(cold)
    row.baseline, row.baseline_name = median(interp), "python -c pass"
    row.ratio = row.median / row.baseline
    row.target, row.met = "< 0.5 s", row.median < 0.5
    rows.append(row)
    row = Row(
        "footprint",
        f"recovery of {steps:,} open steps",
        "spawn -> daemon.ready",
        "s",
        median(recovery),
    )
    row.p99, row.n = p99(recovery), len(recovery)
    row.baseline, row.baseline_name = median(cold), "cold start"
    row.ratio = row.median / row.baseline
    row.target, row.met = "< 1 s", row.median < 1.0
    rows.append(row)
    row = Row("footprint", "idle", "RSS", "MB", idle)
    row.p99, row.n = max(idle_mb), len(idle_mb)
    rows.append(row)
    for name, mb, target in (
        (f"{connections:,} connections open", conn_mb, 100.0),
        (f"{steps:,} steps known (open)", steps_mb, None),
        (f"after recovering {steps:,} steps", recovered_mb, None),
    ):
        row = Row("footprint", name, "RSS", "MB", mb)
        row.n = 1
        row.baseline, row.baseline_name, row.ratio = idle, "idle", mb / idle
        if target is not None:
            row.target, row.met = f"< {target:g} MB", mb < target
        rows.append(row)
    raw = {
        "cold_s": cold,
        "interpreter_s": interp,
        "idle_mb": idle_mb,
        "connections_mb": conn_mb,
        "steps_mb": steps_mb,
        "recovery_s": recovery,
        "recovered_mb": recovered_mb,
    }
    return BenchResult(rows, raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--starts", type=int)
    parser.add_argument("--connections", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10_000)
    args = parser.parse_args()
    result = run(not args.full, starts=args.starts, connections=args.connections, steps=args.steps)
    print_table(result.rows)


if __name__ == "__main__":
    main()

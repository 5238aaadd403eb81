"""Benchmark 9: a checkpoint spanning nodes, from the last node's ``done`` to ``step_N``.

N simulated nodes (2, 8, 32, 64) of 8 protocol-level ranks each save one step of one
job through one daemon per node (``ckptd serve --node nI``), every rank's file written
into the shared ``tmp_step_N`` before its ``done``. The clock runs from the reply to the
last ``done`` of the last node to the leader's ``checkpoint.promoted`` on a subscriber
connection (the rename and the root's fsync are done by then), and on to the last of
the other nodes' ``wait`` answers (every node knows). Two filesystems:

- **local**: every daemon on one directory of this disk (``$CKPTD_BENCH_DIR``); they
  see each other's markers with inotify.
- **caching**: the directory through bindfs with 1 s lookup and attribute caching, as
  NFS clients cache. To keep 64 nodes affordable on a small machine, the leader runs in
  a mount namespace of its own and all the other nodes' daemons share a second one: the
  leader sees every follower's marker only through its own cache, as it would across
  machines (the followers share a cache among themselves, which only helps them learn
  the outcome, a figure reported apart). Needs root and bindfs; skipped otherwise.

Baseline, same run, same filesystem: one node's save of 8 ranks on the leader's daemon
(``local_world_size`` = ``world_size``), last ``done`` to ``checkpoint.promoted``.

The leader's CPU is read from ``/proc/<pid>/stat`` over a window while it waits, idle,
for markers that do not come (every rank begun, only its own done), against the same
window with no save open.

    .venv/bin/python -m bench.multinode [--full] [--nodes 2,8] [--reps 5] [--fs local]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ._common import (
    BenchResult,
    Daemon,
    Row,
    median,
    p99,
    parse_ts,
    print_table,
    raise_nofile,
    scratch_dir,
)
from ._mountns import CACHE_S, NamespaceMount, available
from .promotion import _Line

__all__ = ["run"]

RANKS_PER_NODE = 8
POLL_S = 0.25
"""The daemon's default ``poll_interval`` (the caching mount is polled)."""
_FILE = b"\0" * 4096
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """User plus system CPU seconds of ``pid`` so far."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


class _Cluster:
    """``n`` node daemons on one root, 8 rank connections each, and the leader's events."""

    def __init__(self, stack: ExitStack, work: Path, n: int, fs: str) -> None:
        if fs == "local":
            self.root = self.backing = work / "run"
            self.root.mkdir()
            wraps: list[list[str]] = [[] for _ in range(n)]
        else:
            backing, mount = work / "back", work / "mnt"
            (backing / "run").mkdir(parents=True)
            leader_ns = stack.enter_context(NamespaceMount(backing, mount))
            others_ns = stack.enter_context(NamespaceMount(backing, mount))
            self.root, self.backing = mount / "run", backing / "run"
            wraps = [leader_ns.enter, *([others_ns.enter] * (n - 1))]
        daemons = []
        for i in range(n):
            home = work / f"n{i}"
            home.mkdir()
            daemon = Daemon(
                home,
                [self.root],
                keep_events=False,
                extra=["--node", f"n{i}"],
                settings={"node_timeout": 3600},
                wrap=wraps[i],
            )
            daemons.append(daemon)
        # Started a few at a time; each is closed (killed if need be) on the way out.
        for daemon in daemons:
            stack.callback(daemon.stop)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda d: d.start(120.0), daemons))
        self.daemons = daemons
        self.world = n * RANKS_PER_NODE
        self.ranks = [
            [_Line(d.socket) for _ in range(RANKS_PER_NODE)] for d in daemons
        ]  # ranks[node][local]: global rank node * 8 + local
        self.waiters = [_Line(d.socket) for d in daemons[1:]]
        self.events = _Line(daemons[0].socket)
        self.events.call("subscribe")
        self.promotion_ms = math.nan
        for conn in [*(c for node in self.ranks for c in node), *self.waiters, self.events]:
            stack.callback(conn.close)

    def _all(self, sends: list[tuple[_Line, str, dict[str, Any]]]) -> None:
        """Send every request, then read every reply (pipelined across connections)."""
        ids = [(conn, conn.send(op, **fields)) for conn, op, fields in sends]
        for conn, rid in ids:
            while True:
                reply = conn.recv()
                if reply.get("id") == rid:
                    if not reply.get("ok"):
                        raise RuntimeError(f"refused: {reply}")
                    break

    def begin_all(self, step: int) -> None:
        """Every rank begins: the leader's first, then every other node's at once."""
        root = str(self.root)
        lead = RANKS_PER_NODE
        sends = []
        for i, node in enumerate(self.ranks):
            for lr, conn in enumerate(node):
                fields = {"root": root, "step": step, "rank": i * lead + lr}
                fields.update(world_size=self.world, local_world_size=lead)
                sends.append((conn, "begin", fields))
        self._all(sends[:lead])
        self._all(sends[lead:])

    def done(self, step: int, nodes: range) -> None:
        """The ranks of ``nodes`` write their file into the shared directory and say done."""
        tmp = self.backing / f"tmp_step_{step}"
        sends = []
        for i in nodes:
            for lr, conn in enumerate(self.ranks[i]):
                rank = i * RANKS_PER_NODE + lr
                (tmp / f"rank{rank}.bin").write_bytes(_FILE)
                files = [{"path": f"rank{rank}.bin", "size": len(_FILE)}]
                sends.append((conn, "done", {"root": str(self.root), "step": step,
                                             "rank": rank, "files": files}))  # fmt: skip
        self._all(sends)

    def promoted(self, step: int) -> float:
        """When the leader's ``checkpoint.promoted`` for ``step`` arrived."""
        while True:
            event = self.events.recv()
            if event.get("step") != step:
                continue
            if event.get("event") == "checkpoint.promoted":
                self.promotion_ms = float(event.get("promotion_ms", math.nan))
                return time.perf_counter()
            if event.get("event") == "checkpoint.failed":
                raise RuntimeError(f"step {step} failed: {event}")

    def sample(self, step: int) -> dict[str, float]:
        """One spanning save; seconds from the last done to promoted, and to every node."""
        self.begin_all(step)
        self.done(step, range(1))
        waits = [
            (w, w.send("wait", root=str(self.root), step=step, timeout=300)) for w in self.waiters
        ]
        self.done(step, range(1, len(self.ranks)))
        last_done, last_done_wall = time.perf_counter(), time.time()
        promoted = self.promoted(step)
        for conn, rid in waits:
            while (reply := conn.recv()).get("id") != rid:
                pass
            if reply.get("state") != "promoted":
                raise RuntimeError(f"a node's wait for step {step}: {reply}")
        everyone = time.perf_counter()
        # The markers travel into step_N with the rename; the last one's time splits the
        # latency into the nodes' part (check files, write the marker) and the leader's.
        written = [
            parse_ts(json.loads(path.read_text())["written"])
            for path in (self.backing / f"step_{step}").glob(".ckptd-node-*.json")
        ]
        return {
            "latency_ms": (promoted - last_done) * 1000,
            "all_ms": (everyone - last_done) * 1000,
            "markers_ms": (max(written) - last_done_wall) * 1000,
            "promotion_ms": self.promotion_ms,
        }

    def single(self, step: int) -> float:
        """The baseline: one node's 8-rank save on the leader; ms from last done."""
        root = str(self.root)
        node = self.ranks[0]
        self._all(
            [(c, "begin", {"root": root, "step": step, "rank": r, "world_size": len(node)})
             for r, c in enumerate(node)]
        )  # fmt: skip
        self.done(step, range(1))
        last_done = time.perf_counter()
        return (self.promoted(step) - last_done) * 1000

    def idle_cpu(self, step: int, window: float) -> tuple[float, float]:
        """The leader's CPU share with nothing open, then waiting for missing markers."""
        pid = self.daemons[0].pid
        before = _cpu_s(pid)
        time.sleep(window)  # measuring a rate over a fixed window, not waiting on an event
        quiet = (_cpu_s(pid) - before) / window
        self.begin_all(step)
        self.done(step, range(1))
        before = _cpu_s(pid)
        time.sleep(window)
        waiting = (_cpu_s(pid) - before) / window
        self.done(step, range(1, len(self.ranks)))
        self.promoted(step)
        self.everyone_knows(step)
        return quiet, waiting

    def everyone_knows(self, step: int) -> None:
        """Every other node has learned the outcome (so each stops at once when asked)."""
        waits = [
            (w, w.send("wait", root=str(self.root), step=step, timeout=300)) for w in self.waiters
        ]
        for conn, rid in waits:
            while (reply := conn.recv()).get("id") != rid:
                pass
            if reply.get("state") != "promoted":
                raise RuntimeError(f"a node's wait for step {step}: {reply}")


def run(
    quick: bool = True,
    *,
    nodes: list[int] | None = None,
    reps: int | None = None,
    filesystems: list[str] | None = None,
    window: float | None = None,
) -> BenchResult:
    """Run benchmark 9.

    Args:
        quick: 2 and 8 nodes, 5 samples, a 3 s CPU window; full: 2, 8, 32, 64 nodes,
            15 samples (10 from 32 nodes), a 10 s window.
        nodes: Node counts (overrides the mode).
        reps: Samples per node count (overrides the mode).
        filesystems: ``local`` and/or ``caching`` (default both; caching needs root).
        window: Seconds over which the leader's CPU is read.
    """
    counts = nodes or ([2, 8] if quick else [2, 8, 32, 64])
    window = window or (3.0 if quick else 10.0)
    kinds = filesystems or ["local", "caching"]
    why_not = available()
    raise_nofile(8192)
    rows: list[Row] = []
    raw: dict[str, Any] = {}
    for fs in kinds:
        if fs == "caching" and why_not is not None:
            rows.append(
                Row("multinode", "caching mount", "skipped", "-", float("nan"), note=why_not)
            )
            continue
        p50s: dict[int, float] = {}
        for n in counts:
            samples = reps or (5 if quick else (15 if n <= 8 else 10))
            with ExitStack() as stack:
                work = stack.enter_context(scratch_dir())
                cluster = _Cluster(stack, work, n, fs)
                cluster.sample(1)  # warm-up
                got = [cluster.sample(2 + i) for i in range(samples)]
                single = [cluster.single(10_000 + i) for i in range(samples)]
                quiet, waiting = cluster.idle_cpu(20_000, window) if n == max(counts) else (0, 0)
            lat = [s["latency_ms"] for s in got]
            every = [s["all_ms"] for s in got]
            raw[f"{fs} {n}"] = {"samples": got, "single_ms": single, "cpu": [quiet, waiting]}
            p50s[n] = median(lat)
            row = Row("multinode", f"{fs}, {n} nodes x 8", "last done -> promoted", "ms", p50s[n])
            row.p99, row.n = p99(lat), len(lat)
            row.baseline, row.baseline_name = median(single), "1 node x 8"
            row.ratio = row.median / row.baseline
            if fs == "local" and n == 8:
                row.target, row.met = "p50 < 50 ms", row.median < 50.0
            if fs == "caching":
                bound = (CACHE_S + POLL_S + 0.2) * 1000
                row.target, row.met = f"p50 < {bound:.0f} ms", row.median < bound
            rows.append(row)
            marks = [s["markers_ms"] for s in got]
            row = Row("multinode", f"{fs}, {n} nodes x 8", "last done -> last marker", "ms", 0.0)
            row.median, row.p99, row.n = median(marks), p99(marks), len(marks)
            row.note = "the nodes' part: the last node marker's written time (wall clock)"
            rows.append(row)
            promo = [s["promotion_ms"] for s in got]
            row = Row("multinode", f"{fs}, {n} nodes x 8", "leader's promotion", "ms", 0.0)
            row.median, row.p99, row.n = median(promo), p99(promo), len(promo)
            row.note = "promotion_ms of checkpoint.promoted: verify, flush, rename, pointer"
            rows.append(row)
            row = Row("multinode", f"{fs}, {n} nodes x 8", "last done -> every node", "ms", 0.0)
            row.median, row.p99, row.n = median(every), p99(every), len(every)
            row.note = "until the last other node's wait answered promoted"
            rows.append(row)
            if n == max(counts):
                cpu = Row("multinode", f"{fs}, {n} nodes", "leader CPU waiting", "%", waiting * 100)
                cpu.baseline, cpu.baseline_name = quiet * 100, "no save open"
                cpu.ratio = waiting / quiet if quiet else None
                cpu.n = 1
                cpu.note = f"/proc/PID/stat over {window:g} s, markers missing"
                if n >= 64:
                    cpu.target, cpu.met = "< 2% of a core", waiting < 0.02
                rows.append(cpu)
        ordered = sorted(p50s)
        for small, big in zip(ordered, ordered[1:], strict=False):
            growth = p50s[big] / p50s[small]
            row = Row("multinode", f"{fs}, {small} -> {big} nodes", "p50 growth", "x", growth)
            row.baseline, row.baseline_name = big / small, "linear"
            row.ratio = growth / (big / small)
            row.target, row.met = "<= linear", growth <= big / small
            rows.append(row)
    return BenchResult(rows, raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--nodes", help="comma-separated node counts")
    parser.add_argument("--reps", type=int)
    parser.add_argument("--fs", action="append", choices=["local", "caching"])
    parser.add_argument("--window", type=float)
    args = parser.parse_args()
    counts = [int(n) for n in args.nodes.split(",")] if args.nodes else None
    result = run(
        not args.full, nodes=counts, reps=args.reps, filesystems=args.fs, window=args.window
    )
    print_table(result.rows)


if __name__ == "__main__":
    main()

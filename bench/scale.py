"""Benchmark 11: thousands of nodes on one machine, and the load they put on the shared root.

One real leader daemon (``ckptd serve --node n0``, a subprocess) and N - 1 simulated
nodes in other processes (``bench/_scale_nodes.py``; 512 nodes a process from 257 nodes,
as real nodes run on machines of their own): each node a real ``Daemon`` object driven
through its request handler, joining the leader's attempt, writing its node marker the
way a daemon does and waiting for the outcome by the follower's own code. Every node has ``ranks``
protocol-level ranks; local rank 0 of each reports one 4 KiB file, written into
``tmp_step_N`` by this process before the step begins.

One step runs as a job's would: the leader's ranks begin and are done; every other
node's ranks begin and write for ``wait_s`` (the other nodes wait, looking for a
failure); then they are all done at once: the nodes check their files and write their
markers, the leader takes them, verifies and promotes, and every node learns it. Two
filesystems, as in benchmark 9: **local** (one directory of this disk; polled, so it
stands for a shared filesystem without a client cache) and **caching** (bindfs with
1 s lookup and attribute caching; the leader in a mount namespace of its own, and each
process of simulated nodes in another).

Counted (``bench/_fsops.py``, during the first step: the leader under strace, the
simulated nodes by the kernel's syscall counters, checked against strace up to 256
nodes): the metadata operations on the root per second while nothing is open (goal 0),
while the nodes write (goal < 2,000 at 4,096 nodes), and from the last ``done`` to the
last node learning; and per promotion. Each figure is printed against the model of
``docs/multinode.md`` ("The load"). Timed, on later steps without strace: the last
``done`` to ``checkpoint.promoted`` (goal: grows at most linearly with N), the leader's
verdict to each node learning it (goal: p99 within 2 s plus one cache time), and the
leader's CPU while it waits.

    .venv/bin/python -m bench.scale [--nodes 64,256] [--fs local] [--reps 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from . import _fsops
from ._common import (
    REPO,
    BenchResult,
    Daemon,
    Row,
    median,
    p99,
    parse_ts,
    print_table,
    raise_nofile,
)
from ._common import scratch_dir as _scratch
from ._mountns import CACHE_S, CACHING, PER_NODE_CACHING, NamespaceMount, available
from .multinode import _cpu_s
from .promotion import _Line

__all__ = ["model", "run"]

POLL_S = 0.25
"""``poll_interval``, the daemon's default."""
BUDGET = 1500.0
"""``poll_budget``, the daemon's default."""
WRITING_POLL = 5.0
"""``daemon.nodes._waker.WRITING_POLL``."""
FULL_EVERY = 50.0
"""``daemon.nodes._coordinator.FULL_EVERY``."""
FULL_OPS = 4.0
"""Metadata operations of a full look: lookups of the verdict and of ``step_N``'s
manifest, a lookup and an open of the attempt marker (a look is one lookup)."""
REREADS_PER_S = 20.0
"""``daemon.store._markers.REREADS_PER_S``."""
WRITING_REREAD = 1.0
"""``daemon.store._markers.WRITING_REREAD``."""
LISTED_BYTES = 48
"""Bytes of a directory listing per node marker (``getdents64``: 19 + its name)."""
STRACE_NODES = 256
"""Up to this many nodes the simulated nodes are counted by strace too, as a check of
the kernel's counters; beyond, strace's stops would slow them too much."""
NODES_PER_PROCESS = 512
"""Beyond :data:`STRACE_NODES`, the simulated nodes run in processes of at most this
many: in one process thousands of nodes' threads queue for one interpreter lock, each
look waiting on the others', where a real node's daemon has a machine of its own."""
LEADER_FLOOR_S = 0.1
"""The leader's part is counted as at least this long when its growth is judged."""
GOAL_OPS = 2000.0
GOAL_LEARN_S = 2.0
LATENCY_BUDGET = 2100.0
"""``poll_budget`` of the extra job run where no budget meets both goals (see
:func:`both_goals_possible`): the one the latency goal needs, at the load's cost."""
_FILE = b"\0" * 4096


def both_goals_possible(nodes: int, cache: float) -> bool:
    """Whether any poller can meet both goals for a job of ``nodes`` nodes.

    For 99 % of the ``nodes - 1`` waiting nodes to look within ``GOAL_LEARN_S + cache``
    after a verdict they cannot foresee, they must look ``0.99 (nodes - 1) / (GOAL_LEARN_S
    + cache)`` times a second between them (``docs/multinode.md``, "How soon every node
    knows"); above :data:`GOAL_OPS` that alone breaks the load's goal.
    """
    return 0.99 * (nodes - 1) / (GOAL_LEARN_S + cache) < GOAL_OPS


def model(
    nodes: int, *, poll: float = POLL_S, budget: float = BUDGET, cache: float = 0.0
) -> dict[str, float]:
    """What ``docs/multinode.md`` ("The load") predicts for a job of ``nodes`` nodes.

    Returns:
        ``interval`` (s between one waiting node's looks), ``writing_ops`` and
        ``waiting_ops`` (metadata operations a second, the nodes' looks and the
        leader's, while the other nodes write, and once their markers are in; a client
        cache of ``cache`` s turns a look more frequent than it into one a cache
        time), ``learn_p99`` (s from the verdict to 99 % of the nodes knowing it).
    """
    others = nodes - 1
    interval = max(poll, nodes / budget)
    full_every = FULL_EVERY * nodes / budget
    writing = max(interval, WRITING_POLL)

    def rate(every: float) -> float:
        # A look more frequent than the cache time reaches the server once a cache time.
        look = max(every, cache)
        full = max(look, full_every)
        return others * (1.0 / look + (FULL_OPS - 1.0) / full)

    # The leader: a listing every poll interval (a lookup and an open of the directory,
    # a READDIR per 32 KiB of entries), and while other nodes write, their unchanged
    # markers read again (an open with its lookup, the attributes through the open
    # file) at a bounded rate.
    listing = (2.0 + math.ceil(nodes * LISTED_BYTES / 32768)) / poll
    rereads = 3.0 * min(REREADS_PER_S, others / WRITING_REREAD)
    return {
        "interval": interval,
        "writing_ops": rate(writing) + listing + rereads,
        "waiting_ops": rate(interval) + listing,
        # A node's own cached negative lookup hides the verdict only while its looks
        # come more often than the cache time (its previous one is younger than that).
        "learn_p99": 0.99 * interval + (cache if interval < cache else 0.0),
    }


class _Job:
    """The leader daemon, its ranks, and the simulated nodes' process, on one root."""

    def __init__(
        self,
        stack: ExitStack,
        work: Path,
        n: int,
        fs: str,
        ranks: int,
        counters: list[_fsops.Counters],
        budget: float = BUDGET,
    ) -> None:
        self.n, self.ranks, self.fs = n, ranks, fs
        self.cache = CACHE_S if fs == "caching" else 0.0
        wrap_leader: list[str] = []
        wrap_nodes: list[list[str]] = [[] for _ in counters]
        if fs == "local":
            self.root = self.backing = work / "run"
            self.root.mkdir()
        else:
            backing, mount = work / "back", work / "mnt"
            (backing / "run").mkdir(parents=True)
            leader_ns = stack.enter_context(NamespaceMount(backing, mount))
            # The simulated nodes share one kernel cache where real nodes have one each.
            # A node looking less often than the cache time finds its own last negative
            # lookup expired, so on its own machine every look reaches the server; in a
            # shared cache another node's fresh one would hide the verdict. Their mount
            # then keeps no negative entries (each look is answered by the server).
            own = model(n, budget=budget)["interval"] >= CACHE_S
            # Each process of simulated nodes has a mount of its own, as each real
            # node has a client of its own: one FUSE server for all of them would
            # queue every node's calls behind the others'.
            wrap_nodes = [
                stack.enter_context(
                    NamespaceMount(backing, mount, PER_NODE_CACHING if own else CACHING)
                ).enter
                for _ in counters
            ]
            self.root, self.backing = mount / "run", backing / "run"
            wrap_leader = leader_ns.enter
        config = work / "leader.toml"
        config.write_text(
            'node = "n0"\nnode_timeout = 3600\n[[roots]]\n'
            f'path = "{self.root}"\nwatch = "poll"\npoll_interval = {POLL_S}\n'
            f"poll_budget = {budget}\n"
        )
        home = work / "n0"
        home.mkdir()
        self.leader = Daemon(
            home, [], keep_events=False, extra=["--config", str(config)], wrap=wrap_leader
        )
        stack.callback(self.leader.stop)
        self.leader.start(120.0)
        self.lines = [_Line(self.leader.socket) for _ in range(ranks)]
        self.events = _Line(self.leader.socket)
        self.events.call("subscribe")
        for line in [*self.lines, self.events]:
            stack.callback(line.close)
        nodes_home = work / "sim"
        nodes_home.mkdir()
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.sims: list[subprocess.Popen[str]] = []
        """The simulated nodes' processes, one for each of ``counters``."""
        stack.callback(self.close_nodes)
        for shard, counter in enumerate(counters):
            cmd = [*wrap_nodes[shard], *counter.prefix, sys.executable, "-m", "bench._scale_nodes"]
            cmd += ["--root", str(self.root), "--shard", f"{shard}/{len(counters)}"]
            cmd += ["--home", str(nodes_home), "--nodes", str(n), "--ranks", str(ranks)]
            cmd += ["--poll-interval", str(POLL_S), "--poll-budget", str(budget)]
            counter.started = time.time()
            self.sims.append(
                subprocess.Popen(
                    cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=REPO, text=True
                )
            )
        for sim in self.sims:
            self._read(sim)  # each is ready

    @staticmethod
    def _read(sim: subprocess.Popen[str]) -> dict[str, Any]:
        assert sim.stdout is not None
        line = sim.stdout.readline()
        if not line:
            raise RuntimeError(f"the simulated nodes exited ({sim.wait()})")
        reply: dict[str, Any] = json.loads(line)
        if reply.get("errors"):
            raise RuntimeError(f"a simulated node reported: {reply['errors']}")
        return reply

    def _ask(self, op: str, step: int) -> dict[str, Any]:
        """Send ``op`` to every simulated nodes' process at once; their replies, merged."""
        for sim in self.sims:
            assert sim.stdin is not None
            sim.stdin.write(json.dumps({"op": op, "step": step}) + "\n")
            sim.stdin.flush()
        replies = [self._read(sim) for sim in self.sims]
        merged: dict[str, Any] = {"ok": True, "t": max(r.get("t", 0.0) for r in replies)}
        if op == "done":
            merged["t_done"] = max(r["t_done"] for r in replies)
            merged["learned"] = [t for r in replies for t in r["learned"]]
            merged["lag"] = [sample for r in replies for sample in r["lag"]]
            states: dict[str, int] = {}
            for r in replies:
                for state, k in r["states"].items():
                    states[state] = states.get(state, 0) + k
            merged["states"] = states
        return merged

    def close_nodes(self) -> None:
        """End the simulated nodes' processes (again: nothing)."""
        for sim in self.sims:
            assert sim.stdin is not None and sim.stdout is not None
            if not sim.stdin.closed:
                sim.stdin.close()  # the simulated nodes stop at the end of their input
        for sim in self.sims:
            assert sim.stdout is not None
            try:
                sim.wait(timeout=60.0)
            except subprocess.TimeoutExpired:
                sim.kill()
                sim.wait()
            sim.stdout.close()

    def _all(self, sends: list[tuple[_Line, str, dict[str, Any]]]) -> None:
        ids = [(conn, conn.send(op, **fields)) for conn, op, fields in sends]
        for conn, rid in ids:
            while (reply := conn.recv()).get("id") != rid:
                pass
            if not reply.get("ok"):
                raise RuntimeError(f"refused: {reply}")

    def _promoted(self, step: int) -> tuple[float, float]:
        """When the leader's ``checkpoint.promoted`` came, and its last ``node.done``."""
        taken = math.nan
        while True:
            event = self.events.recv()
            if event.get("step") != step:
                continue
            if event.get("event") == "node.done":
                taken = time.time()
            if event.get("event") == "checkpoint.promoted":
                return time.time(), taken
            if event.get("event") == "checkpoint.failed":
                raise RuntimeError(f"step {step} failed: {event}")

    def _taken(self, timeout: float = 300.0) -> float:
        """Wait until the leader has read every new marker once; how long that took.

        The leader reads each marker it has not seen (two ``read`` calls, and its open):
        thousands at a job's start, as fast as it can. Then, while the nodes write, it
        reads only its listing and at most ``REREADS_PER_S`` markers a second. The
        window of the lasting load starts once a half second of the leader's reads
        (``/proc/PID/io``) falls to that level.
        """
        # Twice the rereads' two reads a marker, with room for what else counts there
        # (the listing's READDIRs do not, but a socket's reads do).
        steady = 2.0 * (
            2.0 * REREADS_PER_S + 4.0 * math.ceil(self.n * LISTED_BYTES / 32768) / POLL_S
        )
        start = time.monotonic()
        deadline = start + timeout
        before = _reads(self.leader.pid)
        while True:
            time.sleep(0.5)  # a rate over a fixed window, not a wait for an event
            now = _reads(self.leader.pid)
            if (now - before) / 0.5 <= steady:
                return time.monotonic() - start
            if time.monotonic() > deadline:
                raise RuntimeError(f"the leader still reads markers after {timeout:g}s")
            before = now

    @staticmethod
    def _markers(tmp: Path, n: int, timeout: float = 300.0) -> None:
        """Wait until ``tmp`` holds ``n`` node markers (read uncached, from the backing)."""
        deadline = time.monotonic() + timeout
        while sum(1 for m in tmp.glob(".ckptd-node-*.json")) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"fewer than {n} node markers in {tmp} after {timeout:g}s")
            time.sleep(0.05)  # the bench's own poll of the backing, not the daemon's

    def step(self, step: int, wait_s: float, idle_s: float) -> dict[str, Any]:
        """One step of the whole job; wall-clock times of its phases, and the latencies."""
        tmp = self.backing / f"tmp_step_{step}"
        tmp.mkdir()
        for node in range(self.n):
            (tmp / f"rank{node * self.ranks}.bin").write_bytes(_FILE)
        pid = self.leader.pid
        t_idle = time.time()
        cpu = _cpu_s(pid)
        time.sleep(idle_s)  # a rate over a fixed window with nothing open, not a wait
        idle_cpu = (_cpu_s(pid) - cpu) / idle_s
        t_open = time.time()
        root = str(self.root)
        world = self.n * self.ranks
        begins = [
            (c, "begin", {"root": root, "step": step, "rank": r, "world_size": world,
                          "local_world_size": self.ranks})
            for r, c in enumerate(self.lines)
        ]  # fmt: skip
        self._all(begins)
        self._ask("begin", step)
        dones = [
            (c, "done", {"root": root, "step": step, "rank": r,
                         "files": [{"path": "rank0.bin", "size": len(_FILE)}] if r == 0 else []})
            for r, c in enumerate(self.lines)
        ]  # fmt: skip
        self._all(dones)
        self._markers(tmp, self.n)  # every node's writing marker, and the leader's done one
        # The leader reads each new marker once, at least a cache time and a poll
        # interval after its write: per-marker work, not the load that lasts while the
        # nodes write, and the window below starts after it.
        time.sleep(self.cache + 2 * POLL_S)
        first_reads = self._taken()  # kept in the raw results: a wait, in 0.5 s steps
        t_wait = time.time()
        cpu = _cpu_s(pid)
        time.sleep(wait_s)  # the other nodes still write: a rate over a fixed window
        waiting_cpu = (_cpu_s(pid) - cpu) / wait_s
        t_writing_end = time.time()
        # The leader's events are read while the nodes settle, so that none backs up.
        with ThreadPoolExecutor(1) as pool:
            leader = pool.submit(self._promoted, step)
            got = self._ask("done", step)
            promoted, taken = leader.result(timeout=600.0)
        final = self.backing / f"step_{step}"
        verdicts = self.backing / ".ckptd-verdicts"
        verdict = next(verdicts.glob(f"tmp_step_{step}.attempt-*.json"))
        written = parse_ts(json.loads(verdict.read_text())["written"])
        markers = [
            parse_ts(json.loads(m.read_text())["written"]) for m in final.glob(".ckptd-node-*.json")
        ]
        learned = [t - written for t in got["learned"]]
        # How late the simulated nodes' own loops ran while the nodes were learning: a
        # look that late is a look a node with its own machine would have made sooner.
        lag = [round(late, 4) for t, late in got["lag"] if written <= t <= max(got["learned"])]
        return {
            "t_idle": t_idle,
            "t_open": t_open,
            "t_wait": t_wait,
            "t_writing_end": t_writing_end,
            "t_done": got["t_done"],
            "t_last_marker": max(markers),
            "t_promoted": promoted,
            "t_verdict": written,
            "t_learned": max(got["learned"]),
            "to_promoted_s": promoted - got["t_done"],
            "marker_to_promoted_s": written - max(markers),
            "taken_to_promoted_s": promoted - taken,
            "learn_s": learned,
            "lag_s": lag,
            "first_reads_s": first_reads,
            "idle_cpu": idle_cpu,
            "waiting_cpu": waiting_cpu,
            "states": got["states"],
        }


def _measure(
    fs: str,
    n: int,
    *,
    ranks: int,
    reps: int,
    wait_s: float,
    idle_s: float,
    budget: float = BUDGET,
) -> dict[str, Any]:
    """One job of ``n`` nodes: the first step counted under strace, the rest timed."""
    with ExitStack() as stack:
        work = stack.enter_context(_scratch())
        shards = 1 if n <= STRACE_NODES else math.ceil((n - 1) / NODES_PER_PROCESS)
        counters = [_fsops.Counters(work / f"nodes{i}.perf") for i in range(shards)]
        job = _Job(stack, work, n, fs, ranks, counters, budget)
        tracers = {"leader": _fsops.Tracer([job.leader.pid], work / "leader.strace")}
        if n <= STRACE_NODES:
            nodes_pid = _child(job.sims[0].pid)
            tracers["nodes"] = _fsops.Tracer([nodes_pid], work / "nodes.strace")
        try:
            counted = job.step(1, wait_s, idle_s)
        finally:
            for tracer in tracers.values():
                tracer.stop()
        windows = {
            # Clear of the 100 ms intervals of the kernel's counts that hold the
            # nodes' start-up and the step's first begins.
            "idle": (counted["t_idle"] + 0.3, counted["t_open"] - 0.15),
            "writing": (counted["t_wait"], counted["t_writing_end"]),
            "settling": (counted["t_done"], counted["t_learned"]),
            "step": (counted["t_open"], counted["t_learned"] + 0.001),
        }
        under = [str(job.root), str(job.backing)]
        by = {who: _fsops.count(t.out, under, windows) for who, t in tracers.items()}
        timed = [job.step(2 + i, wait_s, idle_s) for i in range(reps)]
        job.close_nodes()  # perf writes its last counts as the nodes' processes end
        kernel = {w: Counter[str]() for w in windows}
        for counter in counters:
            for w, found in counter.count(windows).items():
                kernel[w].update(found)
    ops = {w: by["leader"][w] + kernel[w] for w in windows}
    seconds = {k: max(b - a, 1e-9) for k, (a, b) in windows.items()}
    return {
        "ops": {k: dict(v) for k, v in ops.items()},
        "leader_ops": {k: dict(v) for k, v in by["leader"].items()},
        "nodes_perf": {k: dict(v) for k, v in kernel.items()},
        "nodes_strace": {k: dict(v) for k, v in by["nodes"].items()} if "nodes" in by else None,
        "seconds": seconds,
        "counted": counted,
        "timed": timed,
        "budget": budget,
    }


def _reads(pid: int) -> int:
    """``read`` calls ``pid`` has made so far (``syscr`` of ``/proc/PID/io``)."""
    with open(f"/proc/{pid}/io", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("syscr:"):
                return int(line.split()[1])
    raise RuntimeError(f"no syscr in /proc/{pid}/io")


def _child(pid: int, timeout: float = 30.0) -> int:
    """The process ``perf`` (or ``nsenter``, then ``perf``) runs: the Python under it."""
    deadline = time.monotonic() + timeout
    while True:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as fh:
            kids = [int(k) for k in fh.read().split()]
        if kids:
            with open(f"/proc/{kids[0]}/comm", encoding="ascii") as fh:
                if fh.read().strip().startswith("python"):
                    return kids[0]
            pid = kids[0]
            continue
        if time.monotonic() > deadline:
            raise RuntimeError(f"no simulated nodes' process under {pid}")
        time.sleep(0.05)  # the child is being started


def _metadata(ops: dict[str, int]) -> float:
    return float(sum(ops.get(k, 0) for k in _fsops.METADATA))


def run(
    quick: bool = True,
    *,
    nodes: list[int] | None = None,
    filesystems: list[str] | None = None,
    ranks: int | None = None,
    reps: int | None = None,
    wait_s: float | None = None,
    idle_s: float | None = None,
    report: Callable[[list[Row]], None] | None = None,
) -> BenchResult:
    """Run benchmark 11.

    Args:
        quick: 64 and 256 nodes of 2 ranks, one timed step, 6 s of writing; full: 64,
            256, 1,024 and 4,096 nodes of 8 ranks, 2 timed steps, 12 s of writing.
        nodes: Node counts (overrides the mode).
        filesystems: ``local`` and/or ``caching`` (default both; caching needs root).
        ranks: Ranks a node.
        reps: Timed steps per node count, after the counted one.
        wait_s: Seconds the other nodes write while the leader's ranks are done.
        idle_s: Seconds with nothing open before each step.
        report: Called with each job's rows as soon as it has run.
    """
    counts = nodes or ([64, 256] if quick else [64, 256, 1024, 4096])
    ranks = ranks or (2 if quick else 8)
    reps = 1 if reps is None and quick else (2 if reps is None else reps)
    wait_s = wait_s or (6.0 if quick else 12.0)
    idle_s = idle_s or 2.0
    kinds = filesystems or ["local", "caching"]
    raise_nofile(65536)
    rows: list[Row] = []
    raw: dict[str, Any] = {}
    for fs in kinds:
        if fs == "caching" and (why := available()) is not None:
            rows.append(Row("scale", "caching mount", "skipped", "-", math.nan, note=why))
            continue
        if (why := _fsops.available()) is not None:
            rows.append(Row("scale", fs, "skipped", "-", math.nan, note=why))
            continue
        cache = CACHE_S if fs == "caching" else 0.0
        leader_s: dict[int, float] = {}
        for n in counts:
            got = _measure(fs, n, ranks=ranks, reps=reps, wait_s=wait_s, idle_s=idle_s)
            raw[f"{fs} {n}"] = got
            job_rows = _rows(fs, n, got, cache, leader_s)
            if not both_goals_possible(n, cache):
                # No budget meets both goals here: the default one keeps the load's,
                # and a second job shows the latency goal met at the load's cost.
                got = _measure(
                    fs,
                    n,
                    ranks=ranks,
                    reps=reps,
                    wait_s=wait_s,
                    idle_s=idle_s,
                    budget=LATENCY_BUDGET,
                )
                raw[f"{fs} {n} budget {LATENCY_BUDGET:.0f}"] = got
                job_rows += _rows(fs, n, got, cache, {})
            rows += job_rows
            if report is not None:
                report(job_rows)
        ordered = sorted(leader_s)
        for small, big in zip(ordered, ordered[1:], strict=False):
            growth = leader_s[big] / leader_s[small]
            row = Row("scale", f"{fs}, {small} -> {big} nodes", "leader's part growth", "x", growth)
            row.baseline, row.baseline_name = big / small, "linear"
            row.ratio = growth / (big / small)
            row.target, row.met = "<= linear", growth <= big / small
            row.note = "the leader's last marker taken -> promoted, median, at least 0.1 s"
            rows.append(row)
        if len(ordered) > 2:
            small, big = ordered[0], ordered[-1]
            growth = leader_s[big] / leader_s[small]
            row = Row("scale", f"{fs}, {small} -> {big} nodes", "leader's part growth", "x", growth)
            row.baseline, row.baseline_name = big / small, "linear"
            row.ratio = growth / (big / small)
            row.target, row.met = "<= linear", growth <= big / small
            row.note = "over the whole range"
            rows.append(row)
    return BenchResult(rows, raw)


def _rows(
    fs: str, n: int, got: dict[str, Any], cache: float, leader_s: dict[int, float]
) -> list[Row]:
    """The rows of one job of ``n`` nodes.

    Where :func:`both_goals_possible` says no budget meets both goals, the job at the
    default budget is held to the load's goal and to the model's p99, and the job at
    :data:`LATENCY_BUDGET` to the latency goal, its load reported against the model.
    """
    budget = float(got.get("budget", BUDGET))
    trade = not both_goals_possible(n, cache)
    name = f"{fs}, {n} nodes" + (f", poll_budget {budget:.0f}" if budget != BUDGET else "")
    want = model(n, budget=budget, cache=cache)
    ops, seconds = got["ops"], got["seconds"]
    rows: list[Row] = []
    idle = _metadata(ops["idle"]) / seconds["idle"]
    row = Row("scale", name, "ops/s, nothing open", "ops/s", idle, n=1)
    row.target, row.met = "0", idle == 0
    rows.append(row)
    writing = _metadata(ops["writing"]) / seconds["writing"]
    row = Row("scale", name, "ops/s, nodes writing", "ops/s", writing, n=1)
    row.baseline, row.baseline_name = want["writing_ops"], "model"
    row.ratio = writing / want["writing_ops"] if want["writing_ops"] else None
    if n >= 4096 and budget == BUDGET:
        row.target, row.met = f"< {GOAL_OPS:.0f}", writing < GOAL_OPS
    elif row.ratio is not None:
        row.target, row.met = "0.5-1.5x model", 0.5 <= row.ratio <= 1.5
    lead = _metadata(got["leader_ops"]["writing"]) / seconds["writing"]
    row.note = f"the leader's {lead:.0f}/s; " + " ".join(
        f"{k}={v}" for k, v in sorted(ops["writing"].items())
    )
    rows.append(row)
    settling = _metadata(ops["settling"]) / seconds["settling"]
    row = Row("scale", name, "ops/s, last done -> all know", "ops/s", settling, n=1)
    row.baseline, row.baseline_name = want["waiting_ops"], "model, looks only"
    row.ratio = settling / want["waiting_ops"]
    per = {k: round(v / n, 2) for k, v in sorted(ops["settling"].items())}
    row.note = f"{seconds['settling']:.2f} s; per node: " + " ".join(
        f"{k}={v}" for k, v in per.items()
    )
    rows.append(row)
    if got["nodes_strace"] is not None:
        kernel, traced = (
            _metadata(got["nodes_perf"]["step"]),
            _metadata(got["nodes_strace"]["step"]),
        )
        row = Row("scale", name, "nodes' ops, perf vs strace", "ops", kernel, n=1)
        row.baseline, row.baseline_name = traced, "strace"
        row.ratio = kernel / traced if traced else None
        row.target = "within 10%"
        row.met = row.ratio is not None and abs(row.ratio - 1.0) <= 0.10
        row.note = "the simulated nodes' metadata operations over the counted step"
        rows.append(row)
    per_step = _metadata(ops["step"])
    row = Row("scale", name, "ops per promotion, per node", "ops", per_step / n, n=1)
    row.note = f"{per_step:.0f} in all, begin to the last node knowing"
    rows.append(row)
    timed = got["timed"] or [got["counted"]]
    learn = [s for step in timed for s in step["learn_s"]]
    row = Row("scale", name, "verdict -> node knows", "s", median(learn))
    row.p99, row.n = p99(learn), len(learn)
    row.baseline, row.baseline_name = want["learn_p99"], "model p99"
    row.ratio = row.median / row.baseline if row.baseline else None
    late = [s for step in timed for s in step.get("lag_s", [])]
    if late:
        row.note = (
            f"the simulated nodes' loops ran late meanwhile: p50 {median(late):.2f} s, "
            f"p99 {p99(late):.2f} s"
        )
    goal = GOAL_LEARN_S + cache
    if trade and budget == BUDGET:
        # 2 s here takes more looks than the load's goal allows: held to the model,
        # and the latency goal to the job at LATENCY_BUDGET.
        row.target = f"p99 <= 1.1x model (p99 <= {goal:g} s needs > {GOAL_OPS:.0f} looks/s)"
        row.met = row.p99 <= 1.1 * want["learn_p99"]
    else:
        row.target, row.met = f"p99 <= {goal:g} s", row.p99 <= goal
    rows.append(row)
    if trade and budget != BUDGET:
        # The load this job pays for its latency, while every marker is in.
        waiting = _metadata(ops["settling"]) / seconds["settling"]
        rows[-1].note += "; " if rows[-1].note else ""
        rows[-1].note += (
            f"the load's price: {want['waiting_ops']:.0f} looks/s modelled once the markers "
            f"are in ({waiting:.0f}/s measured from the last done, the promotion's work with it)"
        )
    promoted = [step["to_promoted_s"] for step in timed]
    row = Row("scale", name, "last done -> promoted", "s", median(promoted))
    row.p99, row.n = max(promoted), len(promoted)
    row.note = "the nodes' marker writes, then the leader's part"
    rows.append(row)
    lead = [step["marker_to_promoted_s"] for step in timed]
    row = Row("scale", name, "last marker written -> verdict", "s", median(lead))
    row.p99, row.n = max(lead), len(lead)
    row.note = "from the last marker's own time: its write, the leader's look, then below"
    rows.append(row)
    took = [step["taken_to_promoted_s"] for step in timed]
    # Below a tenth of a second this machine's noise (other processes on its 2 cores)
    # is larger than the leader's work: the growth is judged from there up.
    leader_s[n] = max(median(took), LEADER_FLOOR_S)
    row = Row("scale", name, "leader: last marker taken -> promoted", "s", median(took))
    row.p99, row.n = max(took), len(took)
    row.note = "its last node.done to checkpoint.promoted: verify, flush, rename, verdict"
    rows.append(row)
    cpu = [step["waiting_cpu"] * 100 for step in timed]
    quiet = [step["idle_cpu"] * 100 for step in timed]
    row = Row("scale", name, "leader CPU, nodes writing", "%", median(cpu), n=len(cpu))
    row.baseline, row.baseline_name = median(quiet), "nothing open"
    rows.append(row)
    return rows


def _print_now(rows: list[Row]) -> None:
    print_table(rows)
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--nodes", help="comma-separated node counts")
    parser.add_argument("--fs", action="append", choices=["local", "caching"])
    parser.add_argument("--ranks", type=int)
    parser.add_argument("--reps", type=int)
    parser.add_argument("--wait", type=float)
    args = parser.parse_args()
    counts = [int(n) for n in args.nodes.split(",")] if args.nodes else None
    result = run(
        not args.full,
        nodes=counts,
        filesystems=args.fs,
        ranks=args.ranks,
        reps=args.reps,
        wait_s=args.wait,
        report=_print_now,
    )
    print_table(result.rows)
    json.dump(result.raw, sys.stderr, default=str)


if __name__ == "__main__":
    main()

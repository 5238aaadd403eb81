"""Benchmark 1: how long a checkpoint blocks the training thread, and when ``step_N`` shows.

Two real ranks (gloo over 127.0.0.1, CPU) save the same per-rank state several times,
each round once per variant, interleaved (see :mod:`bench._stall_worker`):

(a) synchronous ``dcp.save`` + rename; (b) NeMo-RL's pattern: ``async_save``, wait for
the upload, rename; (c) bare ``dcp.async_save`` with the same stager and group, no daemon
(the floor); (d) ckptd: ``orchestrator.async_save``, the daemon promotes; (e) in full
mode, (d) with the ``begin`` acknowledged before ``dcp.async_save`` starts instead of
overlapping it.

Reported per save: the time the training thread is blocked (slowest rank), and the time
from the save call until ``step_N`` is visible (the trainer's rename in (a)/(b), the
daemon's ``checkpoint.promoted`` in (d)/(e)).

    .venv/bin/python -m bench.stall [--full] [--mb 64,512] [--saves 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from ._common import REPO, BenchResult, Daemon, Row, free_port, median, p99, parse_ts, scratch_dir

__all__ = ["run", "run_job"]

_NAMES = {
    "a": "(a) sync dcp.save",
    "b": "(b) NeMo-RL: wait upload, rename",
    "c": "(c) bare async_save",
    "d": "(d) ckptd",
    "e": "(e) ckptd, begin awaited first",
}


def run_job(
    base: Path, mb: int, saves: int, warmup: int, variants: list[str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run one 2-rank job (and a daemon for the ckptd variants).

    Returns:
        The workers' ``sample`` lines, and the daemon's events.
    """
    import json

    for v in variants:
        (base / v).mkdir(parents=True, exist_ok=True)
    daemon_roots = [base / v for v in variants if v in ("d", "e")]
    daemon = Daemon(base, daemon_roots) if daemon_roots else None
    if daemon is not None:
        daemon.start()
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    outs = [base / f"rank{r}.out" for r in range(2)]
    try:
        for rank in range(2):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "PYTHONPATH": str(REPO),
                "OMP_NUM_THREADS": "1",
            }
            if daemon is not None:
                env["CKPTD_SOCKET"] = daemon.socket
            cmd = [sys.executable, "-m", "bench._stall_worker", "--base", str(base)]
            cmd += ["--mb", str(mb), "--saves", str(saves), "--warmup", str(warmup)]
            cmd += ["--variants", ",".join(variants)]
            with open(outs[rank], "wb") as out:
                procs.append(
                    subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
                )
        codes = [p.wait(1800) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        events = []
        if daemon is not None:
            daemon.stop()
            events = [e for e in daemon.drain() if e["event"] != "_exit"]
    lines = [ln for out in outs for ln in out.read_text(errors="replace").splitlines()]
    if codes != [0, 0]:
        raise RuntimeError(f"rank processes failed {codes}:\n" + "\n".join(lines[-40:]))
    samples = []
    for line in lines:
        if line.startswith("{"):
            obj = json.loads(line)
            if obj.get("event") == "sample" and not obj["warmup"]:
                samples.append(obj)
    return samples, events


def promoted_times(events: list[dict[str, Any]], root: str) -> dict[int, dict[str, float]]:
    """Per step of ``root``: POSIX times of its first begin, last done and promotion."""
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for e in events:
        if e.get("root") != root or "step" not in e:
            continue
        t, step = parse_ts(e["timestamp"]), int(e["step"])
        if e["event"] == "save.begun":
            out[step]["first_begin"] = min(out[step].get("first_begin", t), t)
        elif e["event"] == "save.rank_done":
            out[step]["last_done"] = max(out[step].get("last_done", t), t)
        elif e["event"] == "checkpoint.promoted":
            out[step]["promoted"] = t
            out[step]["bytes"] = float(e["bytes"])
    return dict(out)


def _per_step(samples: list[dict[str, Any]], variant: str) -> dict[int, list[dict[str, Any]]]:
    steps: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for s in samples:
        if s["variant"] == variant:
            steps[s["step"]].append(s)
    return steps


def _rows_for_size(
    mb: int, samples: list[dict[str, Any]], events: list[dict[str, Any]], base: Path
) -> tuple[list[Row], dict[str, Any]]:
    blocked: dict[str, list[float]] = {}
    visible: dict[str, list[float]] = {}
    landed: dict[str, list[float]] = {}
    for v in sorted({s["variant"] for s in samples}):
        steps = _per_step(samples, v)
        blocked[v] = [max(s["blocked_s"] for s in ss) * 1000 for ss in steps.values()]
        landed[v] = [
            max(s["landed"] for s in ss) * 1000
            for ss in steps.values()
            if all("landed" in s for s in ss)
        ]
        if v in ("a", "b"):
            visible[v] = [
                s["visible"] * 1000 for ss in steps.values() for s in ss if "visible" in s
            ]
        elif v in ("d", "e"):
            times = promoted_times(events, str(base / v))
            visible[v] = [
                (times[step]["promoted"] - min(s["t0"] for s in ss)) * 1000
                for step, ss in steps.items()
                if "promoted" in times.get(step, {})
            ]
    size = f"{mb} MB/rank"
    rows: list[Row] = []
    c = median(blocked["c"]) if "c" in blocked else None
    b = median(blocked["b"]) if "b" in blocked else None
    for v, values in blocked.items():
        row = Row("stall", f"{size} {_NAMES[v]}", "blocked per save", "ms", median(values))
        row.p99, row.n = p99(values), len(values)
        if v in ("d", "e") and c is not None:
            allowed = max(1.05 * c, c + 1.0)
            row.baseline, row.baseline_name = c, "(c)"
            row.ratio = row.median / c
            row.target = f"<= max(1.05x, +1 ms) (c) = {allowed:.3g} ms"
            row.met = row.median <= allowed
        rows.append(row)
        if v in ("d", "e") and b is not None:
            vs_b = Row("stall", f"{size} {_NAMES[v]}", "blocked vs (b)", "ms", median(values))
            vs_b.p99, vs_b.n = p99(values), len(values)
            vs_b.baseline, vs_b.baseline_name, vs_b.ratio = b, "(b)", vs_b.median / b
            if mb >= 512:
                vs_b.target, vs_b.met = "<= 0.25x (b)", vs_b.ratio <= 0.25
            rows.append(vs_b)
    for v, values in visible.items():
        row = Row("stall", f"{size} {_NAMES[v]}", "step_N visible after", "ms", median(values))
        row.p99, row.n = p99(values), len(values)
        if v in ("d", "e") and "b" in visible:
            row.baseline, row.baseline_name = median(visible["b"]), "(b)"
            row.ratio = row.median / row.baseline
        rows.append(row)
    steps = _per_step(samples, "e")
    begins = [max(s.get("begin_s", 0.0) for s in ss) * 1000 for ss in steps.values()]
    if begins:
        row = Row("stall", f"{size} {_NAMES['e']}", "of which begin()", "ms", median(begins))
        row.p99, row.n = p99(begins), len(begins)
        row.note = "client.save(): the begin round trip, journal fsync included"
        rows.append(row)
    for v in ("d", "e"):
        times = promoted_times(events, str(base / v))
        lat = [t["promoted"] - t["last_done"] for t in times.values() if "promoted" in t]
        lat = [x * 1000 for x in lat]
        if lat:
            row = Row("stall", f"{size} {_NAMES[v]}", "last done -> promoted", "ms", median(lat))
            row.p99, row.n = p99(lat), len(lat)
            row.note = "daemon timestamps: promotion of a real 2-rank DCP save"
            rows.append(row)
    if "c" in landed:
        row = Row(
            "stall", f"{size} {_NAMES['c']}", "upload landed after", "ms", median(landed["c"])
        )
        row.p99, row.n = p99(landed["c"]), len(landed["c"])
        rows.append(row)
    raw = {"blocked_ms": blocked, "visible_ms": visible, "landed_ms": landed}
    return rows, raw


def run(
    quick: bool = True,
    *,
    sizes: list[int] | None = None,
    saves: int | None = None,
    variants: list[str] | None = None,
) -> BenchResult:
    """Run benchmark 1.

    Args:
        quick: 64 MB per rank, 3 saves per variant; full: 64 and 512 MB, more saves, and
            variant (e).
        sizes: MiB of state per rank (overrides the mode).
        saves: Timed saves per variant and size (overrides the mode).
        variants: Variants to run (default a, b, c, d; plus e in full mode).
    """
    sizes = sizes or ([64] if quick else [64, 512])
    variants = variants or (["a", "b", "c", "d"] if quick else ["a", "b", "c", "d", "e"])
    rows: list[Row] = []
    raw: dict[str, Any] = {}
    for mb in sizes:
        n = saves or (3 if quick else (30 if mb < 512 else 10))
        with scratch_dir() as base:
            samples, events = run_job(base, mb, n, 1, variants)
            size_rows, size_raw = _rows_for_size(mb, samples, events, base)
        rows += size_rows
        raw[f"{mb}MB"] = size_raw
    return BenchResult(rows, raw)


def main() -> None:
    from ._common import print_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--mb", help="comma-separated MiB per rank")
    parser.add_argument("--saves", type=int)
    parser.add_argument("--variants", help="comma-separated, e.g. a,b,c,d,e")
    args = parser.parse_args()
    result = run(
        not args.full,
        sizes=[int(m) for m in args.mb.split(",")] if args.mb else None,
        saves=args.saves,
        variants=args.variants.split(",") if args.variants else None,
    )
    print_table(result.rows)


if __name__ == "__main__":
    main()

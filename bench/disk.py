"""Benchmark 3: end to end against the disk.

Two real ranks save through ckptd (``orchestrator.async_save``, variant (d) of
:mod:`bench.stall`); the figure is checkpoint bytes / (``checkpoint.promoted``, stamped
by the daemon, - the first rank's save call). The call, not the first ``save.begun``:
the client sends ``begin`` once ``dcp.async_save`` has returned, so timing from it would
leave DCP's staging out. Interleaved with each save, rank 0 writes
the same number of bytes sequentially and fsyncs them (``disk`` variant): the disk's own
sequential write bandwidth in the same run, on the same filesystem. Bare
``dcp.async_save`` (variant (c)) runs interleaved too, to separate what DCP itself
reaches from what ckptd adds. The save's time
includes staging (a memory copy), DCP planning and its collectives, the shard writes with
their fsyncs, verification and promotion.

    .venv/bin/python -m bench.disk [--full] [--mb 512] [--saves 5]
"""

from __future__ import annotations

import argparse
from typing import Any

from ._common import BenchResult, Row, median, print_table, scratch_dir
from .stall import promoted_times, run_job

__all__ = ["run"]


def run(quick: bool = True, *, mb: int | None = None, saves: int | None = None) -> BenchResult:
    """Run benchmark 3.

    Args:
        quick: 64 MB per rank, 3 saves; full: 512 MB per rank, 10 saves.
        mb: MiB of state per rank (overrides the mode).
        saves: Timed saves (overrides the mode).
    """
    mb = mb or (64 if quick else 512)
    saves = saves or (3 if quick else 10)
    with scratch_dir() as base:
        samples, events = run_job(base, mb, saves, 1, ["c", "d", "disk"])
        times = promoted_times(events, str(base / "d"))
    # From the save call (the earliest rank's), not from the first begin: the client
    # sends begin after dcp.async_save returns, which would leave staging out.
    called: dict[int, float] = {}
    for s in samples:
        if s["variant"] == "d" and not s["warmup"]:
            called[s["step"]] = min(called.get(s["step"], s["t0"]), s["t0"])
    ckpt_gbps = [
        t["bytes"] / (t["promoted"] - called[step]) / 1e9
        for step, t in times.items()
        if step in called and "promoted" in t
    ]
    disk_gbps = [
        s["bytes"] * 2 / s["disk_s"] / 1e9
        for s in samples
        if s["variant"] == "disk" and s["rank"] == 0
    ]
    dcp_steps: dict[int, list[dict[str, Any]]] = {}
    for s in samples:
        if s["variant"] == "c":
            dcp_steps.setdefault(s["step"], []).append(s)
    dcp_gbps = [
        sum(s["bytes"] for s in ss) / max(s["landed"] for s in ss) / 1e9
        for ss in dcp_steps.values()
    ]
    row = Row("disk", f"{mb} MB/rank x 2 ranks", "ckptd end to end", "GB/s", median(ckpt_gbps))
    row.p99, row.n = min(ckpt_gbps, default=float("nan")), len(ckpt_gbps)
    row.baseline, row.baseline_name = median(disk_gbps), "write+fsync"
    row.ratio = row.median / row.baseline
    row.target, row.met = ">= 0.8x disk", row.ratio >= 0.8
    row.note = "p99 column: the slowest save (lowest bandwidth)"
    bare = Row(
        "disk", f"{mb} MB/rank x 2 ranks", "bare async_save landed", "GB/s", median(dcp_gbps)
    )
    bare.p99, bare.n = min(dcp_gbps, default=float("nan")), len(dcp_gbps)
    bare.baseline, bare.baseline_name = row.baseline, "write+fsync"
    bare.ratio = bare.median / bare.baseline
    bare.note = "(c) of benchmark 1: DCP's own upload, no daemon; what ckptd starts from"
    vs_dcp = Row("disk", f"{mb} MB/rank x 2 ranks", "ckptd vs bare DCP", "GB/s", row.median)
    vs_dcp.baseline, vs_dcp.baseline_name = bare.median, "bare async_save"
    vs_dcp.ratio = row.median / bare.median
    disk = Row("disk", f"{mb * 2} MB sequential", "disk write+fsync", "GB/s", median(disk_gbps))
    disk.p99, disk.n = min(disk_gbps, default=float("nan")), len(disk_gbps)
    raw: dict[str, Any] = {
        "ckptd_gbps": ckpt_gbps,
        "bare_dcp_gbps": dcp_gbps,
        "disk_gbps": disk_gbps,
        "mb_per_rank": mb,
    }
    return BenchResult([row, bare, vs_dcp, disk], raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--mb", type=int)
    parser.add_argument("--saves", type=int)
    args = parser.parse_args()
    print_table(run(not args.full, mb=args.mb, saves=args.saves).rows)


if __name__ == "__main__":
    main()

"""Run every ckptd benchmark: a table of medians, p99s and ratios, raw JSON, a chart.

    .venv/bin/python -m bench                 # quick mode: each benchmark under a minute
    .venv/bin/python -m bench --full          # the figures in docs/performance.md
    .venv/bin/python -m bench --only stall --only throughput
    .venv/bin/python -m bench --json out.json --chart out.png

Each figure is measured side by side with its baseline in the same run; see
``docs/performance.md`` for what each benchmark does and what limits it.
Checkpoints and journals go to ``$CKPTD_BENCH_DIR`` (default ``/var/tmp``): it must be on
the disk being measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import (
    client_cost,
    disk,
    footprint,
    metrics,
    multinode,
    promotion,
    retention,
    s3,
    scale,
    stall,
    throughput,
    tiers,
)
from ._chart import draw
from ._common import REPO, BenchResult, Row, machine_info, markdown_table, print_table

BENCHMARKS: dict[str, Callable[[bool], BenchResult]] = {
    "stall": stall.run,
    "promotion": promotion.run,
    "disk": disk.run,
    "throughput": throughput.run,
    "client_cost": client_cost.run,
    "footprint": footprint.run,
    "metrics": metrics.run,
    "multinode": multinode.run,
    "retention": retention.run,
    "s3": s3.run,
    "scale": scale.run,
    "tiers": tiers.run,
}
"""Every benchmark, in the order they run, by the name ``--only`` takes."""


def _clean(value: Any) -> Any:
    """Round floats so the JSON stays readable (microsecond precision is plenty)."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _run(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    """Run the selected benchmarks, printing each table; returns the results document."""
    quick = not args.full
    names = args.only or list(BENCHMARKS)
    info = machine_info()
    print(
        f"ckptd benchmarks ({'quick' if quick else 'full'}): {info['nproc']} CPUs, "
        f"load {info['loadavg'][0]:.2f}, python {info['python']}, torch {info['torch']}",
        flush=True,
    )
    rows: list[Row] = []
    raw: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    for name in names:
        start = time.perf_counter()
        print(f"-- {name} ...", flush=True)
        result = BENCHMARKS[name](quick)
        seconds[name] = time.perf_counter() - start
        print_table(result.rows)
        print(f"   ({seconds[name]:.0f} s)", flush=True)
        rows += result.rows
        raw[name] = result.raw
    print("\n== all results ==")
    print_table(rows)
    info["loadavg_after"] = machine_info()["loadavg"]
    return {
        "mode": "quick" if quick else "full",
        "command": "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": info,
        "seconds": seconds,
        "rows": [asdict(r) for r in rows],
        "raw": raw,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the selected benchmarks; returns 0, or 1 if a target was missed (``--strict``)."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick", action="store_true", help="each benchmark under a minute (default)"
    )
    mode.add_argument(
        "--full", action="store_true", help="larger states, more samples, all variants"
    )
    parser.add_argument("--only", action="append", choices=list(BENCHMARKS), metavar="NAME")
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results.json")
    parser.add_argument("--chart", type=Path, default=REPO / "docs" / "performance.png")
    parser.add_argument("--no-chart", action="store_true")
    parser.add_argument(
        "--markdown", type=Path, help="also write the table as Markdown (docs/performance.md)"
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        metavar="PATH",
        help="run nothing: redraw the table, Markdown and chart from earlier results",
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 if any target is missed")
    args = parser.parse_args(argv)
    if args.from_json is not None:
        document = json.loads(args.from_json.read_text())
        rows = [Row(**r) for r in document["rows"]]
        print_table(rows)
    else:
        document = _run(args, argv)
        rows = [Row(**r) for r in document["rows"]]
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(_clean(document), indent=1) + "\n")
        print(f"raw results: {args.json}")
    if args.markdown is not None:
        args.markdown.write_text(markdown_table(rows))
        print(f"markdown table: {args.markdown}")
    if not args.no_chart:
        info = document["machine"]
        title = (
            f"ckptd benchmarks, {document['mode']} mode, {info['date'][:10]}, "
            f"{info['nproc']} CPUs ({info['cpu']}), load {info['loadavg'][0]:.1f}"
        )
        if draw(document["raw"], args.chart, title):
            print(f"chart: {args.chart}")
        else:
            print("chart skipped: matplotlib is not installed (pip install -e '.[dev]')")
    missed = [r for r in rows if r.met is False]
    if missed:
        print(
            f"{len(missed)} target(s) missed: "
            + "; ".join(f"{r.bench}: {r.name} {r.metric}" for r in missed)
        )
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())

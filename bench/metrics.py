"""Benchmark 7: what keeping Prometheus metrics costs the request path.

The throughput benchmark's load (closed-loop clients sending ``begin``/``done`` pairs,
journal fsynced, events on stdout) drives the same daemon twice per point, interleaved
round by round:

The journal is on tmpfs (``/dev/shm``), where ``fsync`` costs nothing: the figure is then
the daemon's own CPU per request, the part metrics could add to.

- ``metrics off`` (the baseline): no ``metrics_listen``, no ``metrics_textfile``, so no
  metric is kept at all;
- ``metrics on``: both an HTTP endpoint and a node_exporter textfile, with a scraper
  reading ``/metrics`` every :data:`SCRAPE_EVERY` seconds throughout (Prometheus' usual
  interval is 15 to 60 s: this is the harsher case).

The figures are requests per second and round-trip p50/p99; the ratio on/off is the cost.
Target: within the run-to-run noise of this machine (ratio >= 0.95).

On a loaded machine that noise is large, so two figures are also measured in-process,
each against its own baseline in the same run:

- ``emit``: microseconds per event with the metrics' observer hooked in, against the same
  events without it (what each request pays: an event or two, one dictionary lookup);
- ``scrape``: event-loop milliseconds to sample the gauges of a ledger holding
  :data:`LEDGER_SAVES` saves (paid once per scrape, never per request), against one
  journal flush hook call repeated as many times.

    .venv/bin/python -m bench.metrics [--full] [--clients 8,64] [--seconds 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import threading
import urllib.request
from contextlib import contextmanager
from typing import Any, Final

from ._common import BenchResult, Daemon, Row, median, p99, print_table, scratch_dir
from .throughput import load

__all__ = ["run"]

LEDGER_SAVES: Final = 10_000
"""Saves in the ledger the in-process scrape figure samples."""

SCRAPE_EVERY: Final = 0.5
"""Seconds between scrapes while the ``metrics on`` load runs."""

_MAX_OPEN = 1_000_000


@contextmanager
def _scraping(port: int) -> Any:
    """Scrape ``/metrics`` every :data:`SCRAPE_EVERY` seconds until the block ends."""
    stop = threading.Event()
    scrapes: list[int] = []

    def scrape() -> None:
        while not stop.wait(SCRAPE_EVERY):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                scrapes.append(len(r.read()))

    thread = threading.Thread(target=scrape, daemon=True)
    thread.start()
    try:
        yield scrapes
    finally:
        stop.set()
        thread.join(15)


def _point(on: bool, clients: int, seconds: float) -> dict[str, Any]:
    # The journal on tmpfs: fsync is free there, so what is measured is the daemon's own
    # CPU per request, which is what metrics could add to (a disk's fsync would hide it).
    with scratch_dir() as work, scratch_dir("/dev/shm") as state:
        root = work / "run"
        root.mkdir()
        settings: dict[str, int | str] = {"max_open_saves": _MAX_OPEN}
        if on:
            settings["metrics_listen"] = "127.0.0.1:0"
            settings["metrics_textfile"] = str(work / "ckptd.prom")
        daemon = Daemon(work, [root], state_dir=state, keep_events=False, settings=settings)
        with daemon:
            sock = str(work / "d.sock")
            if on:
                port = daemon.wait_event("metrics.listening", 30)["port"]
                with _scraping(port) as scrapes:
                    rate, lat = load(sock, str(root), clients, seconds)
                if not scrapes:
                    raise RuntimeError("no scrape completed during the load")
            else:
                rate, lat = load(sock, str(root), clients, seconds)
    ms = [x * 1000 for x in lat]
    return {"rps": rate, "p50_ms": median(ms), "p99_ms": p99(ms), "n": len(ms)}


class _NoStalls:
    def stalled(self, root: str | None = None) -> list[Any]:
        return []


class _NoPasses:
    passes: dict[str, Any] = {}


class _Host:
    """What the gauges read, without a running daemon: a config and a full ledger."""

    def __init__(self, config: Any, ledger: Any) -> None:
        self.config = config
        self.ledger = ledger
        self.lanes = _NoStalls()
        self.journal = None
        self.waits = 0
        self.retiring: dict[str, Any] = {}
        self.retention = _NoPasses()


def _in_process(events_n: int) -> tuple[list[Row], dict[str, Any]]:
    """Per-event cost of the observer, and event-loop cost of one scrape's sample."""
    import os
    import time

    from daemon.base._events import Events, configure_logging
    from daemon.config._config import Config, RootConfig
    from daemon.ledger._ledger import Ledger, SaveKey
    from daemon.ops._metrics import Metrics

    with open(os.devnull, "w") as null:
        configure_logging("info", stream=null)
        with scratch_dir() as work:
            root = RootConfig(path=str(work), real=str(work))
            config = Config(roots=(root,), state_dir=str(work / "state"))
            events = Events()
            ledger = Ledger(lease=30.0, save_timeout=None)
            for step in range(LEDGER_SAVES):
                ledger.begin(SaveKey(root.path, step), 0, 2, 1, 0.0, fresh=f"a{step}")

            metrics = Metrics(_Host(config, ledger), version="bench")
            fields: dict[str, Any] = {
                "root": root.path,
                "step": 1,
                "rank": 0,
                "world_size": 2,
                "attempt": "a",
            }

            def emit_us(observer: Any) -> list[float]:
                events.observer = observer
                out = []
                for _ in range(5):
                    start = time.perf_counter()
                    for _ in range(events_n):
                        events.emit("save.begun", **fields)
                    out.append((time.perf_counter() - start) / events_n * 1e6)
                return out

            off, on = emit_us(None), emit_us(metrics.observe)
            scrape_ms = []
            for _ in range(5):
                start = time.perf_counter()
                list(metrics.collect())
                scrape_ms.append((time.perf_counter() - start) * 1000)
    emit = Row("metrics", "emit, observer on", "per event", "us", median(on))
    emit.baseline, emit.baseline_name = median(off), "observer off"
    emit.ratio, emit.n = emit.median / emit.baseline, events_n * 5
    emit.target, emit.met = "<= 1.1x observer off", emit.ratio <= 1.1
    scrape = Row(
        "metrics", f"scrape sample, {LEDGER_SAVES} saves", "event loop", "ms", median(scrape_ms)
    )
    scrape.p99, scrape.n = max(scrape_ms), len(scrape_ms)
    scrape.note = "once per scrape, not per request"
    raw = {"emit_off_us": off, "emit_on_us": on, "scrape_ms": scrape_ms}
    return [emit, scrape], raw


def run(
    quick: bool = True,
    *,
    clients: list[int] | None = None,
    seconds: float | None = None,
    rounds: int | None = None,
) -> BenchResult:
    """Run benchmark 7.

    Args:
        quick: 1.5 s per point and 2 rounds; full: 5 s and 5 rounds.
        clients: Concurrent client counts (default 8 and 64).
        seconds: Load duration per point (overrides the mode).
        rounds: Interleaved off/on rounds per client count (overrides the mode).
    """
    counts = clients or [8, 64]
    secs = seconds or (1.5 if quick else 5.0)
    reps = rounds or (2 if quick else 5)
    raw: dict[str, Any] = {"off": {}, "on": {}}
    for n in counts:
        for _ in range(reps):
            for kind in ("off", "on"):
                raw[kind].setdefault(str(n), []).append(_point(kind == "on", n, secs))
    rows: list[Row] = []
    for n in counts:
        off, on = raw["off"][str(n)], raw["on"][str(n)]
        off_rps, on_rps = median([r["rps"] for r in off]), median([r["rps"] for r in on])
        row = Row("metrics", f"metrics on, {n} clients", "requests/s", "req/s", on_rps)
        row.n = sum(r["n"] for r in on)
        row.baseline, row.baseline_name, row.ratio = off_rps, "metrics off", on_rps / off_rps
        row.target, row.met = ">= 0.95x metrics off", row.ratio >= 0.95
        rows.append(row)
        base = Row("metrics", f"metrics off, {n} clients", "requests/s", "req/s", off_rps)
        base.n = sum(r["n"] for r in off)
        rows.append(base)
        on_p50 = median([r["p50_ms"] for r in on])
        lat = Row("metrics", f"metrics on, {n} clients", "round trip", "ms", on_p50)
        lat.p99 = median([r["p99_ms"] for r in on])
        lat.baseline = median([r["p50_ms"] for r in off])
        lat.baseline_name, lat.ratio = "metrics off p50", on_p50 / lat.baseline
        lat.note = f"p99 off {median([r['p99_ms'] for r in off]):.3f} ms"
        rows.append(lat)
    in_rows, raw["in_process"] = _in_process(20_000 if quick else 100_000)
    return BenchResult(rows + in_rows, raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--clients", help="comma-separated client counts")
    parser.add_argument("--seconds", type=float)
    parser.add_argument("--rounds", type=int)
    args = parser.parse_args()
    result = run(
        not args.full,
        clients=[int(c) for c in args.clients.split(",")] if args.clients else None,
        seconds=args.seconds,
        rounds=args.rounds,
    )
    print_table(result.rows)


if __name__ == "__main__":
    main()

"""Benchmark 4: daemon throughput and round-trip latency under 1 to 512 concurrent clients.

One load generator (asyncio, on uvloop when installed, msgspec codecs) opens N Unix
connections; each sends ``begin``/``done`` pairs for rank 0 of its own world-size-2
saves, one request at a time, so nothing is promoted and the figure is the request path
with the journal on: validation, ledger, a group-committed ``write`` + ``fsync`` before
each reply, events on stdout. The saves stay open, so the ledger grows through each
point (the daemon's ``max_open_saves`` is lifted for it). The same generator drives,
point by point and interleaved:

- ``echo``: a bare asyncio newline-JSON echo server (:mod:`bench._echo`), the ceiling
  of the language and the socket here (the baseline);
- ``ckptd``: the daemon as shipped (on uvloop, journal fsynced on the benchmark's disk);
- ``ckptd, begin + fail``: each ``begin`` followed by a ``fail`` instead, so every step
  is a fresh attempt whose directory is marked, then set aside (each durably);
- ``ckptd, ranks of one step`` (``join``): the N clients are N ranks of the same steps,
  one after another, so one ``begin`` a step makes its attempt and the others join it;
- ``ckptd, journal on tmpfs`` (full mode): the same with ``--state-dir`` on
  ``/dev/shm``, where ``fsync`` is free: what the daemon's own code costs;
- ``ckptd on asyncio`` (full mode): the same daemon on the standard library's event loop
  (``event_loop = "asyncio"``), which it ran on before uvloop measured faster;
- ``echo server (uvloop)`` (full mode): the echo server on uvloop, the ceiling on the
  daemon's own event loop.

Every point gets a fresh server.

    .venv/bin/python -m bench.throughput [--full] [--clients 1,8,64,512] [--seconds 3]
        [--tree OTHER_CHECKOUT]   # also measure another build's daemon, same run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import msgspec

from ._common import REPO, BenchResult, Daemon, Row, median, p99, print_table, scratch_dir

__all__ = ["load", "run"]

_MAX_OPEN = 1_000_000
"""The load leaves every save open (tens of thousands per point): lift the daemon's cap."""

_encode = msgspec.json.encode
_decode = msgspec.json.decode


async def _client(
    path: str,
    root: str,
    ident: int,
    stop_at: float,
    lat: list[float],
    second: str = "done",
    clients: int = 1,
) -> int:
    reader, writer = await asyncio.open_unix_connection(path, limit=1 << 20)
    sent = 0
    # Its own steps, as rank 0 of world size 2; or, joining, rank ``ident`` of steps
    # 1, 2, 3... that every client saves (one rank more than the clients: never complete).
    join = second == "join"
    step = 0 if join else ident * 10_000_000
    rank, world = (ident, clients + 1) if join else (0, 2)
    clock = time.perf_counter
    try:
        while clock() < stop_at:
            step += 1
            for op in ("begin", "done" if join else second):
                req: dict[str, Any] = {
                    "op": op, "id": sent, "root": root, "step": step, "rank": rank
                }  # fmt: skip
                if op == "begin":
                    req["world_size"] = world
                elif op == "fail":
                    req["reason"] = "bench"
                start = clock()
                writer.write(_encode(req) + b"\n")
                reply = _decode(await reader.readline())
                lat.append(clock() - start)
                if not reply.get("ok"):
                    raise RuntimeError(f"request refused: {reply}")
                sent += 1
    finally:
        writer.close()
    return sent


async def _load(
    path: str, root: str, clients: int, seconds: float, second: str = "done"
) -> tuple[float, list[float]]:
    lat: list[float] = []
    start = time.perf_counter()
    stop_at = start + seconds
    counts = await asyncio.gather(
        *(_client(path, root, i, stop_at, lat, second, clients) for i in range(clients))
    )
    return sum(counts) / (time.perf_counter() - start), lat


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def load(
    path: str, root: str, clients: int, seconds: float, second: str = "done"
) -> tuple[float, list[float]]:
    """Drive ``path`` with ``clients`` closed-loop clients for ``seconds``.

    Args:
        path: The server's socket.
        root: The checkpoint root the requests name.
        clients: Connections, each with one request in flight.
        seconds: How long.
        second: What follows each ``begin``: ``done`` (the save stays open) or ``fail``
            (the attempt fails and its fresh directory is set aside); or ``join``: every
            client is one rank of the same steps (``begin`` + ``done``), so all but the
            first ``begin`` of a step join its attempt.

    Returns:
        Requests per second and every round trip in seconds.
    """
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(_load(path, root, clients, seconds, second))


@contextmanager
def _echo_server(work: Path, *flags: str) -> Any:
    sock = str(work / "e.sock")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench._echo", sock, *flags],
        stdout=subprocess.PIPE,
        env=env,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        if b"daemon.ready" not in proc.stdout.readline():
            raise RuntimeError("echo server did not start")
        yield sock
    finally:
        proc.terminate()
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()


@contextmanager
def _daemon(work: Path, root: Path, kind: str, tree: Path) -> Any:
    state = None
    settings: dict[str, int | str] = {"max_open_saves": _MAX_OPEN}
    if kind == "tmpfs":
        state = Path(tempfile.mkdtemp(prefix="ckb-", dir="/dev/shm"))
    elif kind == "asyncio":
        settings["event_loop"] = "asyncio"
    try:
        daemon = Daemon(
            work, [root], state_dir=state, keep_events=False, tree=tree, settings=settings
        )
        with daemon:
            yield str(work / "d.sock")
    finally:
        if state is not None:
            subprocess.run(["rm", "-rf", str(state)], check=False)


_TARGETS = {
    "echo": "echo server (asyncio)",
    "ckptd": "ckptd",
    "tmpfs": "ckptd, journal on tmpfs",
    "fail": "ckptd, begin + fail",
    "join": "ckptd, ranks of one step",
    "asyncio": "ckptd on asyncio",
    "echo-uvloop": "echo server (uvloop)",
}


def run(
    quick: bool = True,
    *,
    clients: list[int] | None = None,
    seconds: float | None = None,
    targets: list[str] | None = None,
    trees: list[Path] | None = None,
) -> BenchResult:
    """Run benchmark 4.

    Args:
        quick: 1.5 s per point, echo and ckptd; full: 5 s per point, plus the tmpfs
            journal and asyncio-loop variants.
        clients: Concurrent client counts (default 1, 8, 64, 512).
        seconds: Load duration per point (overrides the mode).
        targets: Any of ``echo``, ``ckptd``, ``fail``, ``join``, ``tmpfs``, ``asyncio``,
            ``echo-uvloop``.
        trees: Other source trees whose daemon to measure as well (``ckptd`` kind).
    """
    counts = clients or [1, 8, 64, 512]
    secs = seconds or (1.5 if quick else 5.0)
    kinds = targets or (
        ["echo", "ckptd"] if quick else ["echo", "ckptd", "tmpfs", "asyncio", "echo-uvloop"]
    )
    points: list[tuple[str, str, Path]] = [(k, _TARGETS[k], REPO) for k in kinds]
    points += [("ckptd", f"ckptd ({t.name})", t) for t in trees or []]
    for kind in ("fail", "join"):
        if kind in kinds:
            points += [(kind, f"{_TARGETS[kind]} ({t.name})", t) for t in trees or []]
    results: dict[str, dict[int, dict[str, Any]]] = {label: {} for _, label, _ in points}
    for n in counts:
        for kind, label, tree in points:
            with scratch_dir() as work:
                root = work / "run"
                root.mkdir()
                server: AbstractContextManager[str]
                if kind.startswith("echo"):
                    server = _echo_server(work, *(["--uvloop"] if kind == "echo-uvloop" else []))
                else:
                    server = _daemon(work, root, kind, tree)
                with server as sock:
                    second = kind if kind in ("fail", "join") else "done"
                    rate, lat = load(sock, str(root), n, secs, second)
            ms = [x * 1000 for x in lat]
            results[label][n] = {"rps": rate, "p50_ms": median(ms), "p99_ms": p99(ms), "n": len(ms)}
    rows: list[Row] = []
    echo = results.get(_TARGETS["echo"], {})
    for label, per_n in results.items():
        for n, r in per_n.items():
            row = Row("throughput", f"{label}, {n} clients", "requests/s", "req/s", r["rps"])
            row.n = r["n"]
            if label != _TARGETS["echo"] and n in echo:
                row.baseline, row.baseline_name = echo[n]["rps"], "echo"
                row.ratio = r["rps"] / echo[n]["rps"]
                if n == 64 and label == _TARGETS["ckptd"]:
                    row.target, row.met = ">= 0.5x echo", row.ratio >= 0.5
            rows.append(row)
            lat_row = Row("throughput", f"{label}, {n} clients", "round trip", "ms", r["p50_ms"])
            lat_row.p99, lat_row.n = r["p99_ms"], r["n"]
            if label != _TARGETS["echo"] and n in echo:
                lat_row.baseline, lat_row.baseline_name = echo[n]["p50_ms"], "echo p50"
                lat_row.ratio = r["p50_ms"] / echo[n]["p50_ms"]
            if n == 8 and label == _TARGETS["ckptd"]:
                lat_row.target, lat_row.met = "p99 < 2 ms", r["p99_ms"] < 2.0
            rows.append(lat_row)
    raw = {label: {str(n): r for n, r in per_n.items()} for label, per_n in results.items()}
    return BenchResult(rows, raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--clients", help="comma-separated client counts")
    parser.add_argument("--seconds", type=float)
    parser.add_argument(
        "--targets", help="comma-separated: echo,ckptd,fail,join,tmpfs,asyncio,echo-uvloop"
    )
    parser.add_argument("--tree", type=Path, action="append", default=[])
    args = parser.parse_args()
    result = run(
        not args.full,
        clients=[int(c) for c in args.clients.split(",")] if args.clients else None,
        seconds=args.seconds,
        targets=args.targets.split(",") if args.targets else None,
        trees=args.tree,
    )
    print_table(result.rows)


if __name__ == "__main__":
    main()

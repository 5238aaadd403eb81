"""Daemon request throughput and latency under concurrent clients.

Starts a daemon from a source tree (this one, or another checkout given with ``--tree``,
to compare two versions in the same run), opens N connections, and has each send
``begin``/``done`` pairs for its own rank of open saves (world size 2, so nothing is
promoted: the figure is the request path, journal included). Prints requests/s and
round-trip p50/p99 per client count.

    .venv/bin/python -m bench.throughput [--clients 1,8,64] [--seconds 5] [--tree DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


async def _client(path: str, root: str, ident: int, stop_at: float, lat: list[float]) -> int:
    reader, writer = await asyncio.open_unix_connection(path)
    sent = 0
    step = ident * 10_000_000
    while time.perf_counter() < stop_at:
        step += 1
        for op in ("begin", "done"):
            req = {"op": op, "id": sent, "root": root, "step": step, "rank": 0}
            if op == "begin":
                req["world_size"] = 2
            start = time.perf_counter()
            writer.write(json.dumps(req).encode() + b"\n")
            reply = json.loads(await reader.readline())
            lat.append(time.perf_counter() - start)
            if not reply.get("ok"):
                raise SystemExit(f"request refused: {reply}")
            sent += 1
    writer.close()
    return sent


async def _load(path: str, root: str, clients: int, seconds: float) -> tuple[float, list[float]]:
    lat: list[float] = []
    stop_at = time.perf_counter() + seconds
    start = time.perf_counter()
    counts = await asyncio.gather(*(_client(path, root, i, stop_at, lat) for i in range(clients)))
    return sum(counts) / (time.perf_counter() - start), lat


def run(tree: Path, clients: list[int], seconds: float, label: str) -> list[dict[str, float]]:
    """Measure one daemon build; one fresh daemon per client count."""
    rows = []
    for n in clients:
        with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
            root, sock = Path(tmp) / "run", str(Path(tmp) / "d.sock")
            root.mkdir()
            cmd = [sys.executable, "-m", "daemon", "serve", "--socket", sock, "--root", str(root)]
            cmd += ["--log-level", "error"]
            help_text = subprocess.run(
                [*cmd[:4], "--help"], cwd=tree, capture_output=True, text=True, check=True
            ).stdout
            if "--state-dir" in help_text:
                cmd += ["--state-dir", str(Path(tmp) / "state")]
            env = {**os.environ, "PYTHONPATH": str(tree)}
            daemon = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL)
            try:
                deadline = time.monotonic() + 30
                while not os.path.exists(sock):
                    if time.monotonic() > deadline or daemon.poll() is not None:
                        raise SystemExit(f"{label}: daemon did not start")
                    time.sleep(0.02)
                rate, lat = asyncio.run(_load(sock, str(root), n, seconds))
            finally:
                daemon.terminate()
                daemon.wait(60)
        lat.sort()
        rows.append(
            {
                "clients": n,
                "rps": rate,
                "p50_ms": statistics.median(lat) * 1000,
                "p99_ms": lat[int(len(lat) * 0.99) - 1] * 1000,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,8,64")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--tree", type=Path, action="append", default=[])
    args = parser.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    trees = args.tree or [REPO]
    print(f"{'build':<28} {'clients':>7} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for tree in trees:
        for row in run(tree, clients, args.seconds, str(tree)):
            print(
                f"{tree.name[:28]:<28} {row['clients']:>7} {row['rps']:>9.0f} "
                f"{row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()

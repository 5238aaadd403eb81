"""Promotion latency of real 2-rank DCP saves: last ``done`` to ``checkpoint.promoted``.

Starts a daemon, runs the test suite's DCP rank worker (``tests/_dcp_worker.py``) as a
real 2-process gloo job saving several steps, and reads the daemon's own event stream:
for each step, the time from the last ``save.rank_done`` to ``checkpoint.promoted``
(both stamped by the daemon), and the ``promotion_ms`` it reports (verify + fsync +
rename + pointer).

    .venv/bin/python -m bench.promotion_latency [--steps 10] [--numel 4194304]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _ts(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--numel", type=int, default=4 * 1024 * 1024, help="floats per rank")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        root = Path(tmp) / "run"
        root.mkdir()
        sock = Path(tmp) / "d.sock"
        events_path = Path(tmp) / "events.jsonl"
        with open(events_path, "wb") as events_out:
            daemon = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "daemon",
                    "serve",
                    "--socket",
                    str(sock),
                    "--root",
                    str(root),
                ],
                stdout=events_out,
                cwd=REPO,
            )
            try:
                _run_job(root, sock, args)
                _wait_promoted(events_path, args.steps)
            finally:
                daemon.terminate()
                daemon.wait(60)
        events = [json.loads(line) for line in events_path.read_text().splitlines()]
    _report(events, args)


def _run_job(root: Path, sock: Path, args: argparse.Namespace) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    steps = ",".join(str(i) for i in range(1, args.steps + 1))
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "CKPTD_SOCKET": str(sock),
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, str(REPO / "tests" / "_dcp_worker.py"), "--root", str(root)]
        cmd += ["--steps", steps, "--numel", str(args.numel)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, cwd=REPO))
    codes = [p.wait(600) for p in procs]
    if codes != [0, 0]:
        raise SystemExit(f"rank processes failed: {codes}")


def _wait_promoted(events_path: Path, steps: int) -> None:
    import time

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if events_path.read_text().count('"checkpoint.promoted"') >= steps:
            return
        time.sleep(0.05)
    raise SystemExit("not every step was promoted within 120 s")


def _report(events: list[dict[str, Any]], args: argparse.Namespace) -> None:
    last_done: dict[int, float] = {}
    latency_ms: list[float] = []
    promotion_ms: list[float] = []
    sizes: list[int] = []
    for event in events:
        if event["event"] == "save.rank_done":
            last_done[event["step"]] = _ts(event)
        elif event["event"] == "checkpoint.promoted":
            latency_ms.append((_ts(event) - last_done[event["step"]]) * 1000)
            promotion_ms.append(float(event["promotion_ms"]))
            sizes.append(int(event["bytes"]))
    print(f"2 ranks, {args.steps} steps, {statistics.median(sizes) / 2**20:.1f} MiB per step")
    for name, values in (("last done -> promoted", latency_ms), ("promotion_ms", promotion_ms)):
        values = sorted(values)
        print(
            f"{name:22s} median {statistics.median(values):7.2f} ms   "
            f"min {values[0]:7.2f}   max {values[-1]:7.2f}"
        )


if __name__ == "__main__":
    main()

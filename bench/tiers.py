"""Benchmark 13: a fast tier against a single-tier root, the durable root throttled.

The durable root runs far below the local disk's speed.

The durable root is a rate-limited FUSE passthrough (:mod:`bench._throttlefs`, reads
and writes each capped, ``direct_io``) over a directory on the bench disk; the fast
tier is a directory on the local disk itself. One daemon serves two roots on the
throttled mount, ``single`` (no fast tier: ranks write into it) and ``tiered`` (a fast
tier, drained every 2 steps). One rank (:mod:`bench._tiers_worker`) saves the same
state into each through ``orchestrator.CheckpointManager``, with simulated training
between saves, then a fresh process restores each. Reported, side by side in one run:

- the training thread's stall per save (DCP's backpressure: the next save of a
  directory waits for the last one's upload);
- the shortest save interval with no stall: how long one upload takes to land (the
  durable root's write for ``single``, the local disk's for ``tiered``);
- restart to loaded: a new process's ``restore`` (the decision and the load), from the
  fast tier and from the durable root;
- the drain's throughput (``tier.drained``: copy, read-back check and durable commit)
  against a plain copy of the same files into the same throttled root (goal >= 0.8x).

    .venv/bin/python -m bench.tiers [--full] [--mb 128] [--rate 40]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._common import REPO, BenchResult, Daemon, Row, free_port, median, p99, scratch_dir

__all__ = ["run"]


def _mount(backing: Path, mount: Path, rate: float) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "bench._throttlefs", str(backing), str(mount)]
    proc = subprocess.Popen([*cmd, "--mb-s", str(rate)], cwd=REPO)
    deadline = time.monotonic() + 20
    while not os.path.ismount(mount):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the throttled FUSE mount did not come up")
        time.sleep(0.05)
    return proc


def _unmount(proc: subprocess.Popen[bytes], mount: Path) -> None:
    subprocess.run(["fusermount", "-u", "-z", str(mount)], check=False)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _worker(args: list[str], socket: str) -> list[dict[str, Any]]:
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "CKPTD_SOCKET": socket,
    }
    out = subprocess.run(
        [sys.executable, "-m", "bench._tiers_worker", *args],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"worker {args} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]


def _of(root: str, step: int) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e.get("root") == root and e.get("step") == step


def _plain_copy(src: Path, dst: Path) -> tuple[int, float]:
    """Copy every file under ``src`` into ``dst`` with fsync; bytes and seconds."""
    total, start = 0, time.perf_counter()
    for path in sorted(src.rglob("*")):
        if not path.is_file() or ".ckptd" in str(path.relative_to(src)):
            continue
        target = dst / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "rb") as fin, open(target, "wb") as fout:
            shutil.copyfileobj(fin, fout, 4 << 20)
            fout.flush()
            os.fsync(fout.fileno())
        total += path.stat().st_size
    return total, time.perf_counter() - start


def measure(mb: int, saves: int, compute: float, rate: float, restores: int) -> dict[str, Any]:
    """One side-by-side run; the raw figures."""
    with scratch_dir() as base:
        backing, mount, fast = base / "back", base / "mnt", base / "fast"
        for d in (backing, mount, fast, backing / "single", backing / "tiered"):
            d.mkdir()
        fs = _mount(backing, mount, rate)
        daemon: Daemon | None = None
        try:
            config = base / "tiers.toml"
            config.write_text(
                f'[[roots]]\npath = "{mount / "single"}"\nwatch = "poll"\n'
                f'[[roots]]\npath = "{mount / "tiered"}"\nwatch = "poll"\n'
                f'[roots.fast]\npath = "{fast}"\nkeep = 3\ndrain_every_steps = 2\n'
                'drain_ionice = "none"\n'
            )
            daemon = Daemon(base, [], extra=["--config", str(config)])
            daemon.start()
            raw: dict[str, Any] = {"mb": mb, "rate_mb_s": rate, "compute_s": compute}
            for name in ("single", "tiered"):
                root = str(mount / name)
                lines = _worker(
                    ["save", root, "--mb", str(mb), "--saves", str(saves),
                     "--compute", str(compute)], daemon.socket,
                )  # fmt: skip
                raw[name] = {
                    "upload_s": next(x["upload_s"] for x in lines if "upload_s" in x),
                    "blocked_s": [x["blocked_s"] for x in lines if "blocked_s" in x],
                    "tail_s": next(x["tail_s"] for x in lines if "tail_s" in x),
                }
                last = next(x["last"] for x in lines if "last" in x)
                if name == "single":
                    daemon.wait_event("checkpoint.promoted", 600, _of(root, last))
            tiered = str(mount / "tiered")
            # Every drain ordered during the loop, to its end.
            drained = []
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                events = daemon.drain()
                drained = [e for e in events if e["event"] == "tier.drained"]
                started = [e for e in events if e["event"] == "tier.drain_started"]
                if drained and len(drained) >= len(started):
                    break
                time.sleep(0.2)
            raw["drains"] = [
                {"step": e["step"], "bytes": e["bytes"], "seconds": e["seconds"]} for e in drained
            ]
            step = max(e["step"] for e in drained)
            copied, seconds = _plain_copy(fast / f"step_{step}", mount / "plain")
            raw["plain_copy"] = {"bytes": copied, "seconds": seconds}
            for name, root in (("fast", tiered), ("durable", str(mount / "single"))):
                times = []
                for _ in range(restores):
                    out = _worker(["restore", root, "--mb", str(mb)], daemon.socket)[-1]
                    assert out["ok"], out
                    times.append(out["restore_s"])
                raw[f"restore_{name}"] = times
        finally:
            if daemon is not None:
                daemon.stop()
            _unmount(fs, mount)
    return raw


def rows(raw: dict[str, Any]) -> list[Row]:
    """The reported figures of one run."""
    mb, rate = raw["mb"], raw["rate_mb_s"]
    case = f"{mb} MB, durable {rate:g} MB/s"
    out = []
    single, tiered = raw["single"], raw["tiered"]
    base = median([x * 1000 for x in single["blocked_s"]])
    got = median([x * 1000 for x in tiered["blocked_s"]])
    out.append(
        Row("tiers", f"{case}, a save every {raw['compute_s']:g} s", "stall per save", "ms",
            got, p99([x * 1000 for x in tiered["blocked_s"]]), len(tiered["blocked_s"]),
            base, "single-tier root", got / base if base else None)
    )  # fmt: skip
    out.append(
        Row("tiers", case, "shortest interval without a stall (one upload)", "s",
            tiered["upload_s"], None, 1, single["upload_s"], "single-tier root",
            tiered["upload_s"] / single["upload_s"])
    )  # fmt: skip
    fast, durable = median(raw["restore_fast"]), median(raw["restore_durable"])
    out.append(
        Row("tiers", case, "restart to loaded", "s", fast, max(raw["restore_fast"]),
            len(raw["restore_fast"]), durable, "from the durable root", fast / durable)
    )  # fmt: skip
    drains = [d["bytes"] / d["seconds"] / 1e6 for d in raw["drains"] if d["seconds"]]
    plain = raw["plain_copy"]["bytes"] / raw["plain_copy"]["seconds"] / 1e6
    got = median(drains)
    out.append(
        Row("tiers", case, "drain throughput", "MB/s", got, min(drains), len(drains), plain,
            "plain copy", got / plain, ">= 0.8x", got / plain >= 0.8)
    )  # fmt: skip
    return out


def run(quick: bool = True) -> BenchResult:
    """The benchmark, quick (64 MB) or full (256 MB)."""
    mb, saves = (64, 4) if quick else (256, 6)
    raw = measure(mb, saves, compute=1.0, rate=40.0, restores=2 if quick else 3)
    return BenchResult(rows(raw), raw)


def main() -> None:
    """Run and print."""
    from ._common import print_table

    parser = argparse.ArgumentParser()
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--mb", type=int)
    parser.add_argument("--rate", type=float, default=40.0)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--compute", type=float, default=1.0)
    args = parser.parse_args()
    mb = args.mb or (256 if args.full else 64)
    raw = measure(mb, args.saves, args.compute, args.rate, 3 if args.full else 2)
    print_table(rows(raw))
    print(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()

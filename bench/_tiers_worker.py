"""One rank (world size 1) of the fast-tier benchmark, saving or restoring a state.

Started by :mod:`bench.tiers`. ``save``: one save waited for until it landed (how long
an upload takes), then ``--saves`` saves through ``orchestrator.CheckpointManager``
with ``--compute`` seconds of simulated training between them, each save's blocked
time on the training thread printed. ``restore``: a fresh manager restores the newest
step (a restarted job); the time from start to loaded is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import orchestrator


def say(**fields: Any) -> None:
    """One JSON line for the parent."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def state(mb: int) -> dict[str, Any]:
    """``mb`` MB of float32, split between a model and an optimizer dict."""
    n = mb * (1 << 20) // 4 // 8
    return {
        "model": {f"w{i}": torch.full((n,), float(i)) for i in range(4)},
        "optim": {f"m{i}": torch.full((n,), float(-i)) for i in range(4)},
    }


def main() -> None:
    """Run the mode named on the command line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "restore"])
    parser.add_argument("root")
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--compute", type=float, default=1.0)
    parser.add_argument("--first", type=int, default=1)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    if args.mode == "save":
        sd = state(args.mb)
        manager = orchestrator.CheckpointManager(args.root)
        step = args.first
        start = time.perf_counter()
        manager.save(step, sd, force=True)
        manager.wait_until_finished()
        say(upload_s=time.perf_counter() - start)
        for _ in range(args.saves):
            step += 1
            time.sleep(args.compute)  # the training between two saves
            start = time.perf_counter()
            manager.save(step, sd, force=True)
            say(step=step, blocked_s=time.perf_counter() - start)
        start = time.perf_counter()
        manager.wait_until_finished()
        say(tail_s=time.perf_counter() - start, last=step)
        manager.close()
    else:
        sd = state(args.mb)
        for group in sd.values():
            for t in group.values():
                t.zero_()
        start = time.perf_counter()
        manager = orchestrator.CheckpointManager(args.root)
        step = manager.restore(sd)
        loaded = time.perf_counter() - start
        ok = bool(sd["model"]["w3"][0] == 3.0)
        say(restore_s=loaded, step=step, ok=ok)
        manager.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

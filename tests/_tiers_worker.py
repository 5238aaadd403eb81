"""One process of a 1-rank gloo job saving into, then restoring from, a root's fast tier.

``save``: a model saved at steps 1 and 2 through ``orchestrator.CheckpointManager``
(the ``begin`` reply names the fast tier), each step waited for until promoted there.
``restore``: a fresh model restored by a new manager (a restarted job: another run);
prints the step, the directory it was read from, and whether the weights equal step 2's.
One JSON line per finding, for ``tests/test_tiers.py``. Run as 2 ranks on 2 simulated
nodes (``LOCAL_WORLD_SIZE=1``), the manager saves with per-rank metadata, so that each
node's fast tier holds what its rank reads.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist

import orchestrator


def say(**fields: Any) -> None:
    """One JSON line for the test."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def build(seed: int) -> torch.nn.Module:
    """A small model; the same for one seed."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))


def main() -> None:
    """Run the mode named on the command line (``save``/``restore`` ROOT [FIRST_STEP])."""
    mode, root = sys.argv[1], sys.argv[2]
    first = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    dist.init_process_group("gloo")
    if mode == "save":
        manager = orchestrator.CheckpointManager(root)
        for step in (first, first + 1):
            model = build(step)
            manager.save(step, {"model": model}, force=True)
            manager.wait_until_finished()
            reply = manager.client.wait(root, step, timeout=30)
            say(saved=step, state=reply.state, path=reply.path)
        manager.close()
    else:
        manager = orchestrator.CheckpointManager(root)
        model = build(99)
        restored = manager.restore({"model": model})
        want = build(first + 1).state_dict()
        same = all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
        say(restored=restored, same=same, latest=orchestrator.latest(root))
        manager.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""One rank of a small 2-rank gloo job that saves once and then ends as training scripts do.

``--ending``:

- ``destroy``: ``orchestrator.async_save`` of a model and its optimizer (one handle),
  then ``dist.destroy_process_group()`` at once, no close;
- ``exit``: the same save, then the script returns (no close, no destroy);
- ``manager-destroy``: ``CheckpointManager.save``, then ``destroy_process_group()`` at
  once, the manager never closed;
- ``manager-with``: the manager as a context manager, then ``destroy_process_group()``;
- ``close``: the same save as ``destroy``, ``client.close()``, then
  ``destroy_process_group()``.

It prints ``{"event": "saved"}`` once the save call returned and ``{"event": "ended"}``
after its ending, as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist

import orchestrator

STEP = 1


def say(**fields: object) -> None:
    """One JSON line for the test."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def main() -> None:
    """Save step 1 of a small model, then end as ``--ending`` says."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--ending", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    # Large enough that the upload is still running when the script ends (MBs).
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 512)).sum().backward()
    optim.step()
    state = {"model": model, "optim": optim}
    if args.ending.startswith("manager"):
        if args.ending == "manager-with":
            with orchestrator.CheckpointManager(args.root) as manager:
                manager.save(STEP, state, force=True)
                say(event="saved", rank=rank)
        else:
            manager = orchestrator.CheckpointManager(args.root)
            manager.save(STEP, state, force=True)
            say(event="saved", rank=rank)
        dist.destroy_process_group()
        say(event="ended", rank=rank)
        return
    client = orchestrator.default_client()
    handle = client.save(args.root, STEP, rank, world)
    sd = {"model": model.state_dict(), "optim": optim.state_dict()}
    for part in ("model", "optim"):
        orchestrator.async_save(
            {part: sd[part]}, root=args.root, step=STEP, subdir=part, handle=handle
        )
    handle.seal()
    say(event="saved", rank=rank)
    if args.ending == "close":
        client.close()
    if args.ending in ("destroy", "close"):
        dist.destroy_process_group()
    say(event="ended", rank=rank)


if __name__ == "__main__":
    main()

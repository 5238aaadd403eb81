"""One rank of a real DCP job checkpointing to an ``s3://`` root through ckptd.

Started by the tests once per rank (gloo, CPU), with the store's AWS environment. It
saves step ``--step`` with ``orchestrator.async_save`` (each rank uploads its own shards
straight to the store), says so on stdout as JSON lines, and with ``--load`` then loads
the root's ``latest`` back through ``FsspecReader`` and checks every value. With
``--die-mid-upload`` rank 1 is SIGKILLed by its own upload thread once its first object
has landed, as a rank whose node dies mid-upload.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

import orchestrator


def state_for(rank: int, step: int, numel: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` saves at ``step``: its own tensors and one every rank shares."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return {
        f"rank{rank}.weight": torch.randn(numel, generator=gen),
        f"rank{rank}.extra": torch.randn(numel // 2 + 1, generator=gen),
        "shared.step": torch.tensor([step]),
    }


def say(**fields: Any) -> None:
    """One JSON line for the test."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


class DyingWriter(FsspecWriter):
    """``FsspecWriter`` whose rank is killed once its first object is in the store."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        future.wait()
        say(event="dying", rank=dist.get_rank())
        os.kill(os.getpid(), signal.SIGKILL)
        return future


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--step", type=int, default=1)
    parser.add_argument("--numel", type=int, default=4096)
    parser.add_argument("--load", action="store_true")
    parser.add_argument("--die-mid-upload", action="store_true")
    parser.add_argument("--run", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    client = orchestrator.CheckpointClient(run=args.run, begin_timeout=30)
    handle = client.save(args.root, args.step, rank, world)
    say(event="begun", rank=rank, path=handle.path, attempt=handle.attempt)
    kwargs: dict[str, Any] = {}
    if args.die_mid_upload and rank == 1:
        kwargs["storage_writer"] = DyingWriter(handle.path, sync_files=False)
    state = {"model": state_for(rank, args.step, args.numel)}
    future = orchestrator.async_save(
        state, root=args.root, step=args.step, client=client, handle=handle, **kwargs
    )
    handle.seal()
    try:
        future.result()
    except BaseException as exc:  # a peer died: DCP's collective fails here
        say(event="upload_failed", rank=rank, error=repr(exc)[:300])
        client.close(timeout=10)
        os._exit(3)
    say(event="uploaded", rank=rank)
    client.wait_saves(timeout=60)
    if args.load:
        if rank == 0:
            outcome = client.wait(args.root, args.step, timeout=60)
            say(event="settled", rank=rank, state=outcome.state, path=outcome.path)
        dist.barrier()
        url = orchestrator.latest(args.root)
        assert url is not None
        target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
        dcp_load(target, checkpoint_id=url, storage_reader=orchestrator.storage_reader(url))
        same = all(torch.equal(target["model"][k], v) for k, v in state["model"].items())
        say(event="loaded", rank=rank, url=url, same=same)
    client.close(timeout=30)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

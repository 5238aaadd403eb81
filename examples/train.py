"""A small data-parallel training job that checkpoints through ckptd.

Run one process per rank (``torchrun --nproc-per-node 2 examples/train.py ROOT``). A tiny
causal transformer language model (plain torch, no download) trains on random tokens
with AdamW under DDP (gloo, CPU). Every ``--every`` steps each rank hands the model and
optimizer state to ``dcp.async_save`` through ``orchestrator.async_save`` and goes
straight back to training; the node's ckptd promotes ``tmp_step_N`` to ``step_N`` once
every rank's uploads have landed. On start it resumes from the newest promoted
checkpoint, if any. The root may be an object store (``s3://BUCKET/PREFIX``): each rank
then uploads straight to it, and ckptd commits each step with one conditional write.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel

import orchestrator


class TinyLM(torch.nn.Module):
    """A two-layer causal transformer language model small enough to train on two CPU cores.

    Plain torch: each rank imports torch alone, not a model library (seconds a rank).
    """

    def __init__(self, vocab: int = 512, width: int = 128, layers: int = 2, context: int = 128):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Embedding(context, width)
        block = torch.nn.TransformerEncoderLayer(
            width,
            nhead=4,
            dim_feedforward=2 * width,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The mean next-token cross-entropy of ``tokens`` (batch, length)."""
        length = tokens.shape[1]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(length)
        hidden = self.embed(tokens) + self.position(torch.arange(length))
        hidden = self.blocks(hidden, mask=mask, is_causal=True)
        logits = self.head(self.norm(hidden))[:, :-1]
        return functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )


def build_model() -> torch.nn.Module:
    """The job's model, initialised the same on every rank."""
    torch.manual_seed(0)
    return TinyLM()


def latest_checkpoint(root: str) -> tuple[int, str] | None:
    """The step and the path (or URL) of the root's ``latest`` checkpoint (ckptd's word).

    On a filesystem the ``latest`` symlink; on an object store (``s3://``) one GET of the
    ``latest`` pointer object, which names only a committed step.
    """
    where = orchestrator.latest(root)
    if where is None:
        return None
    match = re.search(r"/step_(\d+)(?:/[0-9a-f]+)?$", where)
    return (int(match.group(1)), where) if match else None


def load_dir(path: str) -> dict[str, Any]:
    """``dcp.load``'s arguments for a DCP directory on a filesystem or an object store."""
    if path.startswith("s3://"):
        return {"checkpoint_id": path, "storage_reader": orchestrator.storage_reader(path)}
    return {"checkpoint_id": path}


def main() -> None:
    """Train, checkpointing every ``--every`` steps through the node's ckptd."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("root", help="checkpoint root the daemon manages")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5, help="checkpoint interval in steps")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="rank %(process)d: %(message)s")

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model = build_model()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    client = orchestrator.CheckpointClient()

    start = 0
    found = latest_checkpoint(args.root)
    if found is not None:
        resume, step_dir = found
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp_load({"model": model_sd}, **load_dir(f"{step_dir}/model"))
        dcp_load({"optim": optim_sd}, **load_dir(f"{step_dir}/optim"))
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        start = resume
        if rank == 0:
            print(f"[train] resumed from {step_dir}", flush=True)

    gen = torch.Generator().manual_seed(1234 + rank)
    for step in range(start + 1, start + args.steps + 1):
        tokens = torch.randint(0, 512, (4, 64), generator=gen)
        loss = ddp(tokens)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % args.every:
            continue
        began = time.perf_counter()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        # Model and optimizer are two DCP directories of one step: one handle, sealed
        # after both, so the step is promoted only when both have landed on every rank.
        handle = client.save(args.root, step, rank, world)
        orchestrator.async_save(
            {"model": model_sd}, root=args.root, step=step, subdir="model", handle=handle
        )
        orchestrator.async_save(
            {"optim": optim_sd}, root=args.root, step=step, subdir="optim", handle=handle
        )
        if rank == 0:  # the step's directory exists once save() has returned
            info = json.dumps({"step": step, "loss": loss.item()}).encode()
            with orchestrator.open_file(f"{handle.path}/training_info.json", "wb") as fh:
                fh.write(info)
            handle.add_files([orchestrator.FileEntry("training_info.json", len(info))])
        handle.seal()
        blocked_ms = (time.perf_counter() - began) * 1000
        if rank == 0:
            print(
                f"[train] step {step:3d}  loss {loss.item():.3f}  "
                f"checkpoint handed off in {blocked_ms:.1f} ms",
                flush=True,
            )
    # Before exiting, let the last uploads land: a rank that exits mid-upload loses them
    # (the daemon would then fail the step when the rank's lease runs out).
    client.wait_saves()
    last = start + args.steps - (start + args.steps) % args.every
    if rank == 0 and last > start:
        try:
            outcome = client.wait(args.root, last, timeout=120)
        except orchestrator.DaemonError as exc:  # no daemon: the steps stay in tmp_step_N
            print(f"[train] step {last}: not promoted ({exc})", flush=True)
        else:
            where = outcome.path or outcome.reason
            print(f"[train] step {last}: {outcome.state} {where}", flush=True)
    client.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

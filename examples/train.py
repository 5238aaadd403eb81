"""A small data-parallel training job that checkpoints through ckptd.

Run one process per rank (``torchrun --nproc-per-node 2 examples/train.py ROOT``). A tiny
causal transformer language model (plain torch, no download) trains on random tokens
with AdamW under DDP (gloo, CPU), through ``orchestrator.CheckpointManager``: every
``--every`` steps each rank hands the model and optimizer to it (``dcp.async_save``
under it) and goes straight back to training; the node's ckptd promotes ``tmp_step_N``
to ``step_N`` once every rank's uploads have landed. On start it resumes from the
newest promoted checkpoint, if any. The root may be an object store
(``s3://BUCKET/PREFIX``): each rank then uploads straight to it, and ckptd commits each
step with one conditional write.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
import torch.distributed as dist
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


def main() -> None:
    """Train, checkpointing every ``--every`` steps through the node's ckptd."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("root", help="checkpoint root the daemon manages")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5, help="checkpoint interval in steps")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="rank %(process)d: %(message)s")

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    model = build_model()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Each name is a DCP directory of the step (model/, optim/); the step is promoted
    # once both have landed on every rank.
    state = {"model": model, "optim": optimizer}

    with orchestrator.CheckpointManager(args.root, interval=args.every) as manager:
        start = manager.restore(state) or 0  # the newest promoted step; every rank the same
        if rank == 0 and start:
            print(f"[train] resumed from {orchestrator.latest(args.root)}", flush=True)
        gen = torch.Generator().manual_seed(1234 + rank)
        for step in range(start + 1, start + args.steps + 1):
            tokens = torch.randint(0, 512, (4, 64), generator=gen)
            loss = ddp(tokens)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            began = time.perf_counter()
            # Returns once the state is copied: training goes on while it uploads.
            if manager.save(step, state, metrics={"loss": loss.item()}) and rank == 0:
                blocked_ms = (time.perf_counter() - began) * 1000
                print(
                    f"[train] step {step:3d}  loss {loss.item():.3f}  "
                    f"checkpoint handed off in {blocked_ms:.1f} ms",
                    flush=True,
                )
        manager.wait_until_finished()  # every upload landed and reported
        last = start + args.steps - (start + args.steps) % args.every
        if rank == 0 and last > start:
            report(manager.client, args.root, last)
    # The manager closed (uploads landed) before the process group goes.
    dist.destroy_process_group()


def report(client: orchestrator.CheckpointClient, root: str, step: int) -> None:
    """Print what the daemon made of ``step``: promoted where, or failed why."""
    try:
        outcome = client.wait(root, step, timeout=120)
    except orchestrator.DaemonError as exc:  # no daemon: the steps stay in tmp_step_N
        print(f"[train] step {step}: not promoted ({exc})", flush=True)
    else:
        where = outcome.path or outcome.reason
        print(f"[train] step {step}: {outcome.state} {where}", flush=True)


if __name__ == "__main__":
    main()

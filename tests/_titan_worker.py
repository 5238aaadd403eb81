"""One rank of a 2-rank gloo job that checkpoints through ``orchestrator.torchtitan``.

Started by the tests as ``python tests/_titan_worker.py MODE ROOT ...`` once per rank.
It drives the manager exactly as torchtitan's ``Trainer`` does: built from its config
with ``Config.build(dataloader=..., model_parts=..., optimizers=..., lr_schedulers=...,
states={"train_state": ...}, sd_adapter=..., base_folder=...)``, then ``load(step=...)``,
and per step the forward and backward pass, ``maybe_wait_for_staging()`` before the
optimizer's step, ``save(step, last_step=step == steps)``; ``close()`` at the end. The
model, optimizer (FQN-keyed, as torchtitan's container), scheduler, data position and
train state are real and small. One JSON object per line on stdout.

Modes:

- ``loop ROOT --steps N [--die-at S]``: torchtitan's loop from ``load`` to ``close``.
  With ``--die-at S``, at step S rank 1 says ``dying`` and stops before its save (it
  never returns), while rank 0 saves S: its upload waits in DCP's collective for a rank
  that never comes, until the test kills the job mid-save.
- ``forms ROOT``: one save of each form (``disabled``, ``async``,
  ``async_with_pinned_mem``, the last step model-only in bfloat16, and in HF
  safetensors, unsharded and sharded), each by a manager of its own; then, once the
  daemon promoted them, the DCP ones loaded back through a manager.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import orchestrator.torchtitan as titan
from orchestrator import CheckpointClient

WIDTH = 16


def say(**fields: Any) -> None:
    """One JSON line for the test."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def digest(model: torch.nn.Module) -> float:
    """A number that changes with every weight (compared across runs, exactly)."""
    return float(
        sum((p.detach().double() * (i + 1)).sum() for i, p in enumerate(model.parameters()))
    )


class Optimizers:
    """An AdamW behind torchtitan's container interface: FQN-keyed state dicts."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


class Schedulers:
    """One LR scheduler behind torchtitan's container interface."""

    def __init__(self, optimizers: Optimizers) -> None:
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizers.optimizer, lambda step: 1.0 / (1 + step)
        )

    def step(self) -> None:
        self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return {"lr_scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict["lr_scheduler"])


class Data:
    """A stateful data source: the batch of step ``position`` (torchtitan's dataloader)."""

    def __init__(self) -> None:
        self.position = 0

    def next(self) -> torch.Tensor:
        self.position += 1
        gen = torch.Generator().manual_seed(self.position)
        return torch.randn(4, WIDTH, generator=gen)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.position = int(state_dict["position"])


class TrainState:
    """The trainer's own state (torchtitan's ``Trainer.state_dict``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


class Adapter:
    """A state dict adapter to HF names (torchtitan's ``BaseStateDictAdapter`` shape)."""

    hf_assets_path = None

    def __init__(self, sharded: bool) -> None:
        names = [f"model.layers.{i}.{kind}" for i in (0, 2) for kind in ("weight", "bias")]
        self.fqn_to_index_mapping = (
            {n: 1 + (i // 2) for i, n in enumerate(names)} if sharded else None
        )

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {f"model.layers.{k}": v for k, v in state_dict.items()}

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return {k.removeprefix("model.layers."): v for k, v in hf_state_dict.items()}


class Job:
    """The model and what torchtitan's trainer hands its checkpoint manager."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH)
        )
        self.optimizers = Optimizers(self.model)
        self.schedulers = Schedulers(self.optimizers)
        self.data = Data()
        self.train_state = TrainState()

    def manager(self, root: str, adapter: Adapter | None = None, **config: Any) -> Any:
        """Build the manager as torchtitan's trainer does, from its config."""
        folder = os.path.basename(root)
        cfg = titan.CheckpointManager.Config(enable=True, folder=folder, **config)
        return cfg.build(
            dataloader=self.data,
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.schedulers,
            states={"train_state": self.train_state},
            sd_adapter=adapter,
            base_folder=os.path.dirname(root),
        )

    def train_step(self, checkpointer: Any) -> None:
        """Forward, backward, gradients averaged over the ranks, then the optimizer."""
        loss = self.model(self.data.next()).square().mean()
        loss.backward()
        for p in self.model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        checkpointer.maybe_wait_for_staging()  # as torchtitan, before the weights change
        self.optimizers.step()
        self.schedulers.step()


def loop(args: argparse.Namespace, rank: int) -> None:
    """Torchtitan's ``Trainer.train``, checkpoint calls and all."""
    job = Job()
    checkpointer = job.manager(
        args.root,
        interval=args.interval,
        keep_latest_k=args.keep,
        async_mode=args.async_mode,
        last_save_model_only=False,
    )
    loaded = checkpointer.load(step=-1)
    say(
        event="loaded",
        rank=rank,
        loaded=loaded,
        step=job.train_state.step,
        position=job.data.position,
        digest=digest(job.model),
        daemon=checkpointer.uses_daemon,
    )
    while job.train_state.step < args.steps:
        job.train_state.step += 1
        step = job.train_state.step
        job.train_step(checkpointer)
        if step == args.die_at and rank == 1:
            say(event="dying", rank=rank, step=step)
            threading.Event().wait()  # never returns: the test kills this rank
        checkpointer.save(step, last_step=step == args.steps)
        say(event="saved", rank=rank, step=step, digest=digest(job.model))
    checkpointer.close()
    say(event="closed", rank=rank)


def forms(args: argparse.Namespace, rank: int) -> None:
    """One save of each form, then the DCP ones loaded back through a manager."""
    job = Job()
    digests: dict[int, float] = {}
    plans: list[tuple[int, dict[str, Any], Adapter | None]] = [
        (1, {"async_mode": "disabled"}, None),
        (2, {"async_mode": "async"}, None),
        (3, {"async_mode": "async_with_pinned_mem"}, None),
        (4, {"last_save_model_only": True, "export_dtype": "bfloat16"}, None),
        (5, {"last_save_model_only": True, "last_save_in_hf": True}, Adapter(sharded=False)),
        (6, {"last_save_model_only": True, "last_save_in_hf": True}, Adapter(sharded=True)),
    ]
    for step, config, adapter in plans:
        job.train_state.step = step
        job.train_step(_NoStaging())
        checkpointer = job.manager(args.root, adapter, interval=1, keep_latest_k=0, **config)
        checkpointer.save(step, last_step=step >= 4)
        checkpointer.maybe_wait_for_staging()
        checkpointer.maybe_wait_for_saving()
        digests[step] = digest(job.model)
        say(
            event="saved",
            rank=rank,
            step=step,
            digest=digests[step],
            daemon=checkpointer.uses_daemon,
        )
        checkpointer.close()
    with CheckpointClient() as verdicts:  # the daemon's verdicts, before loading them back
        for step, _, _ in plans:
            reply = verdicts.wait(args.root, step, 60.0)
            say(event="verdict", rank=rank, step=step, state=reply.state, reason=reply.reason)
    reader = job.manager(args.root, None, interval=100, keep_latest_k=0)
    for step in (1, 2, 3):
        with torch.no_grad():
            for p in job.model.parameters():
                p.zero_()
        reader.load(step=step)
        say(
            event="reloaded",
            rank=rank,
            step=step,
            digest=digest(job.model),
            saved=digests[step],
            train_step=job.train_state.step,
        )
    reader.close()


class _NoStaging:
    def maybe_wait_for_staging(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["loop", "forms"])
    parser.add_argument("root")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--interval", type=int, default=1)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--async-mode", default="async")
    parser.add_argument("--die-at", type=int, default=0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        (loop if args.mode == "loop" else forms)(args, rank)
    except BaseException as exc:
        say(event="error", rank=rank, error=f"{type(exc).__name__}: {exc}")
        raise
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

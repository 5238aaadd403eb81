"""One rank of a 2-rank gloo job exercising ``orchestrator.CheckpointManager`` end to end.

Prints one JSON line per finding for ``tests/test_manager.py``:

- ``ddp``: a DDP model and AdamW saved at steps 2 and 4 (``interval=2``, a metric each),
  then a fresh model and optimizer restored by a new manager: the newest (4), then step 2
  by name, each equal to what was saved; ``should_save``, ``latest_step``, ``best_step``;
  a step that is not a checkpoint;
- ``fsdp2``: an FSDP2 (``fully_shard``) model and optimizer saved, restored into fresh
  ones, equal;
- ``refused``: under ``strict``, saving an already promoted step, and saving into a root
  the daemon does not serve, raise ``SaveRefused`` on the rank;
- ``not_strict``: ``strict=False`` saving an already promoted step returns, also with
  ``CKPTD_STRICT=1`` in the environment;
- ``done`` at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import orchestrator


def say(**fields: Any) -> None:
    """One JSON line for the test."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def build(seed: int) -> torch.nn.Module:
    """A small model, the same on every rank for one seed."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> float:
    """One step on rank- and step-dependent data; the loss."""
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    loss = model(torch.randn(8, 16, generator=gen)).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    return float(loss.item())


def snapshot(model: torch.nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Full copies of the parameters and the optimizer's moments (DTensors gathered)."""

    def full(t: torch.Tensor) -> torch.Tensor:
        gather = getattr(t, "full_tensor", None)
        return (gather() if gather is not None else t).detach().clone()

    values = [full(p) for p in model.parameters()]
    for p in model.parameters():
        values += [full(v) for v in optim.state[p].values() if isinstance(v, torch.Tensor)]
    return values


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether two snapshots are equal."""
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def ddp(root: str) -> None:
    """Save through DDP at steps 2 and 4, restore the newest and step 2 into fresh objects."""
    model = build(0)
    wrapped = DistributedDataParallel(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = {"epoch": torch.tensor([0])}
    state = {"model": wrapped, "optim": optim, "extra": extra}
    saved: dict[int, list[torch.Tensor]] = {}
    losses = {2: 3.0, 4: 1.0}  # step 4 is the best
    with orchestrator.CheckpointManager(root, interval=2) as manager:
        first = manager.restore(state)
        asked = [manager.should_save(s) for s in range(1, 5)]
        for step in range(1, 5):
            train_step(wrapped, optim, step)
            extra["epoch"] = torch.tensor([step])
            if manager.save(step, state, metrics={"loss": losses.get(step, 9.0)}):
                saved[step] = snapshot(model, optim)
        again = manager.save(4, state)  # not after the last saved step: no
        manager.wait_until_finished()
        if dist.get_rank() == 0:
            for step in (2, 4):
                assert manager.client.wait(manager.root, step, timeout=60).state == "promoted"
        dist.barrier()
    say(event="ddp_saved", first=first, asked=asked, saved=sorted(saved), again=again)

    fresh = build(1)
    fresh_ddp = DistributedDataParallel(fresh)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    extra = {"epoch": torch.tensor([-1])}
    state = {"model": fresh_ddp, "optim": fresh_optim, "extra": extra}
    with orchestrator.CheckpointManager(root, interval=2) as manager:
        newest = manager.restore(state)
        equal_newest = same(snapshot(fresh, fresh_optim), saved[4])
        epoch = int(extra["epoch"].item())
        named = manager.restore(state, step=2)
        equal_named = same(snapshot(fresh, fresh_optim), saved[2])
        try:
            manager.restore(state, step=3)
            missing = ""
        except FileNotFoundError as exc:
            missing = str(exc)
        say(
            event="ddp_restored",
            newest=newest,
            equal_newest=equal_newest,
            epoch=epoch,
            named=named,
            equal_named=equal_named,
            missing=missing,
            latest=manager.latest_step(),
            best=manager.best_step(),
            should_save_4=manager.should_save(4),
            should_save_6=manager.should_save(6),
        )


def fsdp2(root: str) -> None:
    """Save an FSDP2 model and optimizer, restore them into fresh ones."""
    model = build(0)
    fully_shard(model)  # in place: the module becomes an FSDPModule and stays a Module
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, optim, 1)
    with orchestrator.CheckpointManager(root) as manager:
        manager.save(1, {"model": model, "optim": optim}, force=True)
        manager.wait_until_finished()  # landed; promoted a moment later:
        if dist.get_rank() == 0:
            assert manager.client.wait(manager.root, 1, timeout=60).state == "promoted"
        dist.barrier()
    saved = snapshot(model, optim)
    fresh = build(1)
    fully_shard(fresh)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    with orchestrator.CheckpointManager(root) as manager:
        step = manager.restore({"model": fresh, "optim": fresh_optim})
    say(event="fsdp2", step=step, equal=same(snapshot(fresh, fresh_optim), saved))


def refused(root: str, unserved: str) -> None:
    """Under strict, a refused save raises in the trainer."""
    model = build(0)
    state = {"model": model}
    codes = []
    for where, step in ((root, 4), (unserved, 1)):
        with orchestrator.CheckpointManager(where) as manager:
            try:
                manager.save(step, state, force=True)
                codes.append("")
            except orchestrator.SaveRefused as exc:
                codes.append(exc.code)
    say(event="refused", codes=codes)


def not_strict(root: str) -> None:
    """``strict=False`` holds even where ``CKPTD_STRICT=1`` makes clients strict."""
    os.environ["CKPTD_STRICT"] = "1"
    raised = ""
    try:
        with orchestrator.CheckpointManager(root, strict=False) as manager:
            manager.save(4, {"model": build(0)}, force=True)  # already promoted: refused
    except orchestrator.SaveRefused as exc:
        raised = exc.code
    finally:
        del os.environ["CKPTD_STRICT"]
    say(event="not_strict", raised=raised)


def main() -> None:
    """Run every part in order on this rank."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--ddp-root", required=True)
    parser.add_argument("--fsdp-root", required=True)
    parser.add_argument("--unserved", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    ddp(args.ddp_root)
    fsdp2(args.fsdp_root)
    refused(args.ddp_root, args.unserved)
    not_strict(args.ddp_root)
    dist.destroy_process_group()
    say(event="done")


if __name__ == "__main__":
    main()

"""Benchmark: torchtitan's ``async_with_pinned_mem`` on a GPU, through ckptd and bare.

One process, one CUDA device: a model of ``--mb`` MB of fp32 weights (and AdamW's
state, twice as much again) on the GPU, trained a step between saves. Each round saves
once with each, interleaved:

(a) bare: torchtitan's own ``CheckpointManager`` (``dcp.async_save`` with DCP's process
    writer and torchtitan's pinned-memory stager), no daemon;
(b) ckptd: ``orchestrator.torchtitan.CheckpointManager``, the same save staged and
    promoted by a daemon started here.

Reported per save: the training thread's stall, what torchtitan's loop blocks in
(``save()`` plus ``maybe_wait_for_staging()`` before the optimizer's step), median and
p99 of each, and their ratio. Then the last ckptd step is waited for (promoted to
``step-N``) and loaded back through the manager, its weights compared with what was
saved. Ends within ``--budget`` seconds (default 240; at most 5 minutes with start-up).

Without a CUDA device it prints why it skipped and exits 0.

    .venv/bin/python -m bench.gpu [--mb 1024] [--saves 5] [--budget 240]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ._common import Daemon, free_port, median, p99, scratch_dir

SKIP = "bench.gpu: skipped: no CUDA device here (torch.cuda.is_available() is False)"


def _model(mb: int) -> Any:
    import torch

    width = 4096
    layers = max(1, (mb * 2**20) // (4 * width * width))
    return torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))


class _Stateless:
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class _Optim:
    def __init__(self, model: Any) -> None:
        import torch

        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


def _manager(cls: Any, base: Path, name: str, model: Any, optim: _Optim) -> Any:
    config = cls.Config(
        enable=True, folder=name, interval=1, keep_latest_k=0, async_mode="async_with_pinned_mem"
    )
    return config.build(
        dataloader=_Stateless(),
        model_parts=[model],
        optimizers=optim,
        lr_schedulers=_Stateless(),
        states={},
        sd_adapter=None,
        base_folder=str(base),
    )


def _digest(model: Any) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def _train_step(model: Any, optim: _Optim, manager: Any) -> None:
    import torch

    x = torch.randn(8, model[0].in_features, device="cuda")
    model(x).square().mean().backward()
    manager.maybe_wait_for_staging()  # torchtitan's loop, before the weights change
    optim.optimizer.step()
    optim.optimizer.zero_grad()


def run(mb: int, saves: int, budget: float) -> dict[str, Any]:
    """Measure both variants in one run; returns the figures (see the module)."""
    import torch
    import torch.distributed as dist
    from torchtitan.components.checkpointer.dcp import CheckpointManager as Bare

    from orchestrator.torchtitan import CheckpointManager, root_toml

    deadline = time.monotonic() + budget
    with scratch_dir() as base:
        root = base / "ckptd"
        root.mkdir()
        (base / "ckptd.toml").write_text(root_toml(str(root), 0))
        with Daemon(base, [], extra=["--config", str(base / "ckptd.toml")]) as daemon:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", DCP_USE_PREFIX_STORE="1")
            os.environ["CKPTD_SOCKET"] = daemon.socket
            dist.init_process_group("gloo")
            torch.cuda.set_device(0)
            model = _model(mb).cuda()
            optim = _Optim(model)
            bare = _manager(Bare, base, "bare", model, optim)
            ours = _manager(CheckpointManager, base, "ckptd", model, optim)
            assert ours.uses_daemon, "the daemon does not serve the ckptd folder"
            stalls: dict[str, list[float]] = {"bare": [], "ckptd": []}
            saved: dict[int, float] = {}
            step = 0
            for _ in range(saves):
                if time.monotonic() > deadline:
                    break
                for name, manager in (("bare", bare), ("ckptd", ours)):
                    step += 1
                    _train_step(model, optim, manager)
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    manager.save(step)
                    manager.maybe_wait_for_staging()
                    stalls[name].append(time.perf_counter() - start)
                    saved[step] = _digest(model)
            bare.maybe_wait_for_saving()
            ours.maybe_wait_for_saving()
            last = step if step % 2 == 0 else step - 1  # ckptd saves the even steps
            daemon.wait_event("checkpoint.promoted", 120.0, lambda e: e.get("step") == last)
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            ours.load(step=last)
            reloaded = _digest(model)
            bare.close()
            ours.close()
            dist.destroy_process_group()
    figures: dict[str, Any] = {
        "mb": mb,
        "saves": len(stalls["ckptd"]),
        "device": torch.cuda.get_device_name(0),
        "promoted_step": last,
        "reloaded_equal": reloaded == saved[last],
    }
    for name, values in stalls.items():
        figures[f"{name}_stall_median_s"] = median(values[1:] or values)
        figures[f"{name}_stall_p99_s"] = p99(values[1:] or values)
    figures["ratio_median"] = figures["ckptd_stall_median_s"] / figures["bare_stall_median_s"]
    return figures


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or say why not) and print its figures as JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    parser.add_argument("--mb", type=int, default=1024, help="fp32 weights, MB")
    parser.add_argument("--saves", type=int, default=5, help="saves per variant")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds for the rounds")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(SKIP)
        return 0
    figures = run(args.mb, args.saves, args.budget)
    print(json.dumps(figures, indent=2))
    return 0 if figures["reloaded_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())

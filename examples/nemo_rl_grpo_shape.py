"""NeMo-RL's GRPO checkpoint sequence, with ckptd's drop-ins, on 2 CPU worker processes.

The driver (this process, as NeMo-RL's Ray driver) and two workers (gloo, as NeMo-RL's
policy workers, started by the driver and driven over pipes instead of Ray)::

    python examples/nemo_rl_grpo_shape.py ROOT [--steps N] [--every K]

Per checkpoint, as ``grpo.py`` does it: ``finalize_pending()`` (the previous step),
``init_tmp_checkpoint(step, training_info)`` on the driver (then its
``train_dataloader.pt``, written before the workers save), ``save_checkpoint`` on every
worker (``AutomodelCheckpointManager``, async DCP, naming the driver's run), then
``begin_finalization(tmp, wait_fn=workers.finalize_async_save)``. On start it resumes
from ``get_latest_checkpoint_path()`` through ``get_resume_paths``. Retention is NeMo-RL's
``keep_top_k=2`` by ``val:reward``; with a daemon serving ROOT (``--print-daemon-config``
prints its configuration) the daemon promotes and prunes, without one the driver does.
Events go to stdout as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from orchestrator.nemo_rl import CheckpointManager, retention_table, retention_toml

WORLD = 2


def say(**event: Any) -> None:
    """One JSON line on stdout, in one write.

    The workers log to the same stream (their stderr is this process's stdout): with
    ``print``, which writes the text and its newline apart when the stream is unbuffered
    (``PYTHONUNBUFFERED``), a worker's line could land between the two.
    """
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def reward(step: int) -> float:
    """The validation reward of ``step`` (fixed, so tests know what top-k keeps)."""
    return (step * 7 % 10) / 10


def checkpointing(root: str, every: int) -> dict[str, Any]:
    """NeMo-RL's ``checkpointing`` block of this run."""
    return {
        "enabled": True,
        "checkpoint_dir": root,
        "metric_name": "val:reward",
        "higher_is_better": True,
        "save_period": every,
        "keep_top_k": 2,
        "save_optimizer": True,
    }


# -- a worker: NeMo-RL's policy worker, reduced to its checkpoint calls --------------------


def worker() -> None:
    """Serve the driver's commands (one JSON object per line on stdin)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from orchestrator.automodel import AutomodelCheckpointManager

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = AutomodelCheckpointManager(mesh["dp"], mesh["tp"])
    manager.init_checkpointer(
        {"model_save_format": "torch_save", "save_consolidated": False, "is_async": True}
    )

    def checksum() -> float:
        return float(sum(p.detach().double().sum() for p in model.parameters()))

    for line in sys.stdin:
        cmd = json.loads(line)
        op, reply = cmd["op"], {}
        if op == "train":
            generator = torch.Generator().manual_seed(cmd["step"])
            batch = torch.randn(16, 32, generator=generator)
            loss = model(batch).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        elif op == "checksum":
            reply = {"checksum": checksum()}
        elif op == "save":
            manager.save_checkpoint(
                model,
                os.path.join(cmd["path"], "policy", "weights"),
                optimizer,
                os.path.join(cmd["path"], "policy", "optimizer"),
                is_final_checkpoint=cmd["final"],
                run=cmd["run"],
            )
        elif op == "load":
            manager.load_checkpoint(model, cmd["weights"], optimizer, cmd["optimizer"])
            reply = {"checksum": checksum()}
        elif op == "finalize":
            manager.finalize_async_save()
        elif op == "exit":
            manager.close()
        print("@" + json.dumps(reply), flush=True)
        if op == "exit":
            break
    dist.destroy_process_group()


class Workers:
    """The driver's handle on its worker processes (NeMo-RL's ``Policy``)."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.procs = []
        for rank in range(WORLD):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(WORLD),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
            }
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--worker"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    env=env,
                    text=True,
                )
            )

    def call(self, op: str, **fields: Any) -> list[dict[str, Any]]:
        """Send a command to every worker; each one's reply, by rank."""
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            proc.stdin.flush()
        replies = []
        for proc in self.procs:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("@"):
                    replies.append(json.loads(line[1:]))
                    break
            else:
                raise RuntimeError(f"worker {proc.pid} exited ({proc.wait()}) during {op}")
        return replies

    def finalize_async_save(self) -> None:
        """NeMo-RL's ``policy.finalize_async_save``: used without a daemon only."""
        self.call("finalize")

    def close(self) -> None:
        """Close every worker's manager and wait for the processes."""
        self.call("exit")
        for proc in self.procs:
            proc.wait(60)


# -- the driver: NeMo-RL's GRPO loop, reduced to its checkpoint sequence -------------------


def main() -> None:
    """Train ``--steps`` steps, checkpointing every ``--every``, resuming from latest."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--print-daemon-config", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker()
        return
    root = os.path.abspath(args.root)
    config = checkpointing(root, args.every)
    if args.print_daemon_config:
        print(retention_toml(root, retention_table(config)), end="")
        return
    checkpointer = CheckpointManager(config)  # type: ignore[arg-type]
    say(event="started", uses_daemon=checkpointer.uses_daemon, run=checkpointer.run)
    workers = Workers()
    start = 0
    latest = checkpointer.get_latest_checkpoint_path()
    if latest is not None:
        info = checkpointer.load_training_info(latest) or {}
        weights, optimizer = CheckpointManager.get_resume_paths(latest)
        sums = workers.call("load", weights=str(weights), optimizer=str(optimizer))
        start = int(info["step"])
        same = all(abs(s["checksum"] - info["checksum"]) < 1e-9 for s in sums)
        say(event="resumed", step=start, path=latest, state_matches=same)
    with checkpointer:
        for step in range(start + 1, args.steps + 1):
            workers.call("train", step=step)
            if step % args.every:
                continue
            checkpointer.finalize_pending()
            checksum = workers.call("checksum")[0]["checksum"]
            info = {"step": step, "val:reward": reward(step), "checksum": checksum}
            tmp = Path(checkpointer.init_tmp_checkpoint(step, info))
            (tmp / "train_dataloader.pt").write_text(json.dumps({"consumed": step * 16}))
            workers.call("save", path=str(tmp), run=checkpointer.run, final=step == args.steps)
            say(event="saving", step=step)
            checkpointer.begin_finalization(tmp, wait_fn=workers.finalize_async_save)
    workers.close()
    best = checkpointer.get_best_checkpoint_path()
    steps = sorted(int(p.name[5:]) for p in Path(root).glob("step_*"))
    say(event="done", steps=steps, best=best, latest=checkpointer.get_latest_checkpoint_path())


if __name__ == "__main__":
    main()

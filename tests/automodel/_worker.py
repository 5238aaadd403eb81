"""One rank of a real 2-rank NeMo-RL-layout job using ``AutomodelCheckpointManager``.

Started once per rank by the tests (gloo, CPU), with RANK/WORLD_SIZE/MASTER_ADDR/
MASTER_PORT set, and CKPTD_SOCKET when a daemon runs. It prints one JSON object per line
on stdout. Scenarios:

- ``roundtrip``: no daemon. Save and load model, AdamW and scheduler in both formats,
  sync and async, renaming ``tmp_step_N`` itself after ``finalize_async_save`` as the
  reference loop does; a LoRA adapter through the PEFT path; master-weight dtype checks.
- ``loop``: a NeMo-RL training loop saving every step into ``ROOT/tmp_step_N`` for the
  daemon to promote. FIFO gates (``--gate-dir``, one FIFO per rank) let the test hold a
  rank before a step (to freeze its upload process) or before the caller's last file.
- ``refused``: step 1 saved and promoted, then (after a gate) saved again, which the
  daemon refuses.
- ``s3``: ``--steps`` saved into an ``s3://`` root (``--root``), each rank uploading its
  own files; once the daemon has settled them, a fresh manager loads
  ``orchestrator.latest``'s URL. ``--bad-secret-rank`` gives one rank a wrong secret
  key, so its uploads fail.

Async uploads run in a process spawned from this file, so everything runs under
``if __name__ == "__main__"`` and heavy imports stay inside functions.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import time
from typing import Any


def say(**fields: Any) -> None:
    """One JSON line for the test."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def gate(directory: str, rank: int, where: str, **fields: Any) -> None:
    """Wait until the test opens this rank's FIFO for writing."""
    say(event="held", rank=rank, at=where, **fields)
    with open(os.path.join(directory, f"gate{rank}"), "rb") as fh:
        fh.read(1)
    say(event="released", rank=rank, at=where)


def upload_process_pid() -> int | None:
    """The pid of this rank's DCP upload process (PROCESS-mode async), once started."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    process = executor._CHECKPOINT_PROCESS
    pid = None if process is None else process._save_process.pid
    return None if pid is None else int(pid)


def equal_states(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths where two nested state dicts differ (tensors compared exactly)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        same = same and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(map(str, a.keys() ^ b.keys()))[:5]}"]
        return [d for k in a for d in equal_states(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in equal_states(x, y, f"{path}[{i}]")
        ]
    return [] if a == b else [path]


class Job:
    """What every scenario shares: the process group, meshes, paths."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        torch.set_num_threads(1)
        self.args = args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh("cpu", (self.world, 1), mesh_dim_names=("dp", "tp"))
        self.dp_mesh, self.tp_mesh = mesh["dp"], mesh["tp"]
        self.root = args.root

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def manager(
        self,
        checkpoint: dict[str, Any],
        *,
        is_async: bool,
        is_peft: bool = False,
        local_world_size: int | None = None,
    ) -> Any:
        from orchestrator.automodel import AutomodelCheckpointManager, build_checkpoint_config

        config = build_checkpoint_config(
            {"checkpoint": checkpoint, "other": "ignored"},
            model_repo_id="tiny-llama",
            dequantize_base_checkpoint=False,
            is_peft=is_peft,
            is_async=is_async,
        )
        manager = AutomodelCheckpointManager(
            self.dp_mesh, self.tp_mesh, local_world_size=local_world_size
        )
        manager.init_checkpointer(config)
        return manager

    def init_tmp_checkpoint(self, step: int, info: dict[str, Any]) -> str:
        """NeMo-RL's ``CheckpointManager.init_tmp_checkpoint``, on rank 0 (the driver)."""
        tmp = os.path.join(self.root, f"tmp_step_{step}")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            with open(os.path.join(tmp, "training_info.json"), "w") as fh:
                json.dump(info, fh)
            with open(os.path.join(tmp, "config.yaml"), "w") as fh:
                fh.write("policy:\n  automodel_cfg:\n    checkpoint:\n      model_save_format: x\n")
        self.barrier()
        return tmp


def roundtrip(job: Job) -> None:
    """Save, rename (the reference way), load, compare: every format and mode."""
    import torch

    from tests.automodel._models import tiny_llama, tiny_tokenizer, train_step

    tokenizer = tiny_tokenizer()
    tokenizer.on_save = lambda path: say(event="tokenizer_saved", rank=job.rank, path=path)
    cases = [
        ("torch_save", False),
        ("safetensors", False),
        ("torch_save", True),
        ("safetensors", True),
    ]
    for step, (fmt, is_async) in enumerate(cases, start=1):
        manager = job.manager(
            {"model_save_format": fmt, "save_consolidated": False}, is_async=is_async
        )
        model = tiny_llama(seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        for i in range(2):
            train_step(model, optimizer, seed=100 + i)
            scheduler.step()
        expected = [copy.deepcopy(s.state_dict()) for s in (model, optimizer, scheduler)]
        tmp = job.init_tmp_checkpoint(step, {"step": step})
        policy = os.path.join(tmp, "policy")
        began = time.perf_counter()
        manager.save_checkpoint(
            model,
            os.path.join(policy, "weights"),
            optimizer,
            os.path.join(policy, "optimizer"),
            scheduler,
            tokenizer,
            os.path.join(policy, "tokenizer"),
            is_final_checkpoint=False,
        )
        stall = time.perf_counter() - began
        # Training goes on while the upload runs (only after staging: save returned).
        train_step(model, optimizer, seed=999)
        began = time.perf_counter()
        manager.finalize_async_save()
        finalize = time.perf_counter() - began
        job.barrier()
        final = os.path.join(job.root, f"step_{step}")
        if job.rank == 0:
            os.rename(tmp, final)  # the reference: the caller renames, after finalizing
        job.barrier()
        fresh = tiny_llama(seed=1)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_optimizer, step_size=1, gamma=0.5)
        weights = os.path.join(final, "policy", "weights")
        optim_path = os.path.join(final, "policy", "optimizer")
        manager.load_checkpoint(fresh, weights, fresh_optimizer, optim_path, fresh_scheduler)
        loaded = [s.state_dict() for s in (fresh, fresh_optimizer, fresh_scheduler)]
        mismatches = [m for e, g in zip(expected, loaded, strict=True) for m in equal_states(e, g)]
        say(
            event="roundtrip",
            rank=job.rank,
            format=fmt,
            mode="async" if is_async else "sync",
            uses_daemon=manager.uses_daemon,
            mismatches=mismatches[:10],
            optimizer_entries=len(loaded[1]["state"]),
            stall_s=stall,
            finalize_s=finalize,
            files=sorted(os.listdir(os.path.join(weights, "model"))),
        )
        manager.close()


def lora(job: Job) -> None:
    """A LoRA adapter saved through Automodel's PEFT path, resolved three ways, loaded."""
    import torch

    from orchestrator.automodel import _resolve_lora_adapter_dir
    from tests.automodel._models import import_nemo_lora, tiny_llama

    lora_module = import_nemo_lora()
    peft = lora_module.PeftConfig(target_modules=["*.q_proj", "*.v_proj"], dim=4, alpha=8)

    def adapted(seed: int) -> torch.nn.Module:
        model = tiny_llama(seed=seed)
        lora_module.apply_lora_to_linear_modules(model, peft)
        torch.manual_seed(seed + 7)
        for name, param in model.named_parameters():
            if "lora_" in name:
                torch.nn.init.normal_(param)
        return model

    manager = job.manager(
        {"model_save_format": "safetensors", "save_consolidated": False},
        is_async=False,
        is_peft=True,
    )
    model = adapted(seed=3)
    tmp = job.init_tmp_checkpoint(50, {"step": 50})
    weights = os.path.join(tmp, "policy", "weights")
    manager.save_checkpoint(model, weights, is_final_checkpoint=True, peft_config=peft)
    hf_dir = os.path.join(job.root, "hf_adapter")
    if job.rank == 0:
        os.makedirs(hf_dir)
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            shutil.copy(os.path.join(weights, "model", name), hf_dir)
    job.barrier()
    saved = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
    for layout, path in (
        ("weights", weights),
        ("model", os.path.join(weights, "model")),
        ("hf", hf_dir),
    ):
        fresh = adapted(seed=4)
        before = {k: v for k, v in fresh.state_dict().items() if "lora_" in k}
        differed = all(not torch.equal(before[k], saved[k]) for k in saved)
        manager.load_lora_adapter(fresh, path)
        after = {k: v for k, v in fresh.state_dict().items() if "lora_" in k}
        say(
            event="lora",
            rank=job.rank,
            layout=layout,
            resolved=os.path.relpath(_resolve_lora_adapter_dir(path), job.root),
            tensors=len(saved),
            differed_before=differed,
            equal=after.keys() == saved.keys()
            and all(torch.equal(after[k], saved[k]) for k in saved),
        )
    manager.close()


def dtypes(job: Job) -> None:
    """check_master_weight_dtypes: matching dtypes pass, each drift direction raises."""
    import torch

    from orchestrator.automodel import MasterWeightDtypeError
    from tests.automodel._models import MasterWeightAdamW, tiny_llama, train_step

    checkpoint = {"model_save_format": "torch_save", "save_consolidated": False}
    paths: dict[bool, str] = {}
    saved_state: dict[bool, Any] = {}
    for step, remainders in ((60, False), (61, True)):
        # One Checkpointer per saved layout: its DCP plan cache would otherwise reuse
        # the first save's metadata (dtypes included) for the second.
        manager = job.manager(checkpoint, is_async=False)
        model = tiny_llama(seed=5, dtype=torch.bfloat16)
        optimizer = MasterWeightAdamW(model.parameters(), store_param_remainders=remainders)
        train_step(model, optimizer, seed=5)
        tmp = job.init_tmp_checkpoint(step, {"step": step})
        policy = os.path.join(tmp, "policy")
        paths[remainders] = policy
        saved_state[remainders] = copy.deepcopy(optimizer.state_dict())
        manager.save_checkpoint(
            model,
            os.path.join(policy, "weights"),
            optimizer,
            os.path.join(policy, "optimizer"),
            is_final_checkpoint=False,
        )
        manager.close()
    manager = job.manager(checkpoint, is_async=False)
    cases = {
        "fp32_matches": (False, False),
        "remainders_match": (True, True),
        "fp32_saved_remainders_live": (False, True),
        "remainders_saved_fp32_live": (True, False),
    }
    for case, (saved_remainders, live_remainders) in cases.items():
        model = tiny_llama(seed=6, dtype=torch.bfloat16)
        optimizer = MasterWeightAdamW(model.parameters(), store_param_remainders=live_remainders)
        policy = paths[saved_remainders]
        error = None
        try:
            manager.load_checkpoint(
                model,
                os.path.join(policy, "weights"),
                optimizer,
                os.path.join(policy, "optimizer"),
            )
        except MasterWeightDtypeError as exc:
            error = str(exc)
        restored = None
        if error is None:
            restored = equal_states(saved_state[saved_remainders], optimizer.state_dict()) == []
        say(event="dtype", rank=job.rank, case=case, error=error, restored=restored)
    plain = tiny_llama(seed=6, dtype=torch.bfloat16)
    manager.check_master_weight_dtypes(
        plain, torch.optim.AdamW(plain.parameters()), os.path.join(paths[False], "optimizer")
    )
    say(event="dtype", rank=job.rank, case="no_master_weights_live", error=None)
    manager.close()


def loop(job: Job) -> None:
    """NeMo-RL's loop: every step saved into ROOT/tmp_step_N and promoted by the daemon."""
    import torch

    from tests.automodel._models import tiny_llama, tiny_tokenizer, train_step

    args = job.args
    manager = job.manager(
        {"model_save_format": args.format, "save_consolidated": False}, is_async=True
    )
    say(event="ready", rank=job.rank, uses_daemon=manager.uses_daemon)
    model = tiny_llama(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    tokenizer = tiny_tokenizer()
    steps = [int(s) for s in args.steps.split(",")]
    for step in steps:
        if job.rank == args.hold_rank and step == args.hold_before_step:
            gate(args.gate_dir, job.rank, "before_save", step=step, upload_pid=upload_process_pid())
        tokenizer.on_save = lambda path, step=step: say(
            event="tokenizer_saved", rank=job.rank, step=step
        )
        loss = train_step(model, optimizer, seed=step)  # the same batch on every rank: replicated
        scheduler.step()
        tmp = job.init_tmp_checkpoint(step, {"step": step, "loss": loss})
        if job.rank == 0:
            torch.save(model.state_dict(), os.path.join(args.side, f"model_step_{step}.pt"))
        policy = os.path.join(tmp, "policy")
        began = time.perf_counter()
        manager.save_checkpoint(
            model,
            os.path.join(policy, "weights"),
            optimizer,
            os.path.join(policy, "optimizer"),
            scheduler,
            tokenizer,
            os.path.join(policy, "tokenizer"),
            is_final_checkpoint=step == steps[-1],
            seal=False,
        )
        say(event="save_returned", rank=job.rank, step=step, stall_s=time.perf_counter() - began)
        if step == steps[0]:
            say(event="upload_process", rank=job.rank, upload_pid=upload_process_pid())
        if job.rank == 0:
            # The driver's files: training_info.json and config.yaml were written before
            # the save; train_dataloader.pt after it, so the step stays open until sealed.
            if step == args.hold_file_step:
                gate(args.gate_dir, job.rank, "before_last_file", step=step)
            torch.save({"epoch": 0, "consumed": step * 2}, os.path.join(tmp, "train_dataloader.pt"))
            manager.add_files(["training_info.json", "config.yaml", "train_dataloader.pt"])
        manager.seal()
        say(event="sealed", rank=job.rank, step=step)
        train_step(model, optimizer, seed=1000 + step)
        say(event="trained", rank=job.rank, after_step=step)
    try:
        manager.close()
        if args.final_step > 0:
            final_save(job, model, optimizer, scheduler)
    except BaseException as exc:  # CheckpointException derives from BaseException
        say(event="upload_failed", rank=job.rank, error=repr(exc)[:300])
        os._exit(3)  # the process group is broken: a barrier would hang
    job.barrier()
    say(event="finished", rank=job.rank)


def refused(job: Job) -> None:
    """Step 1 saved and promoted, then saved again: every rank is refused, nothing written."""
    import torch

    from orchestrator import SaveRefused, default_client
    from tests.automodel._models import tiny_llama, tiny_tokenizer, train_step

    args = job.args
    manager = job.manager(
        {"model_save_format": "torch_save", "save_consolidated": False}, is_async=True
    )
    say(event="ready", rank=job.rank, uses_daemon=manager.uses_daemon)
    model = tiny_llama(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokenizer = tiny_tokenizer()
    for again in (False, True):
        if again:
            gate(args.gate_dir, job.rank, "before_again")
        train_step(model, optimizer, seed=1)
        policy = os.path.join(job.init_tmp_checkpoint(1, {"step": 1, "again": again}), "policy")
        try:
            manager.save_checkpoint(
                model,
                os.path.join(policy, "weights"),
                optimizer,
                os.path.join(policy, "optimizer"),
                None,
                tokenizer,
                os.path.join(policy, "tokenizer"),
                is_final_checkpoint=False,
            )
        except SaveRefused as exc:
            say(event="refused", rank=job.rank, code=exc.code, error=str(exc))
        else:
            say(event="saved", rank=job.rank, again=again)
        manager.finalize_async_save()
        if not again and job.rank == 0:
            say(event="settled", state=default_client().wait(job.root, 1, 60.0).state)
        job.barrier()
    manager.close()


def nodes(job: Job) -> None:
    """One save against a daemon that refuses it: the begins say the node's ranks."""
    from orchestrator import SaveRefused
    from tests.automodel._models import tiny_llama

    local = job.args.local_world_size
    manager = job.manager(
        {"model_save_format": "torch_save", "save_consolidated": False},
        is_async=True,
        local_world_size=None if local < 0 else local,
    )
    say(event="ready", rank=job.rank, uses_daemon=manager.uses_daemon)
    policy = os.path.join(job.init_tmp_checkpoint(1, {"step": 1}), "policy")
    try:
        manager.save_checkpoint(
            tiny_llama(seed=0), os.path.join(policy, "weights"), is_final_checkpoint=False
        )
    except SaveRefused as exc:
        say(event="refused", rank=job.rank, code=exc.code)
    manager.close()


def s3(job: Job) -> None:
    """Save ``--steps`` into an s3:// root, wait for the verdicts, load the latest back."""
    import torch

    import orchestrator
    from tests.automodel._models import tiny_llama, tiny_tokenizer, train_step

    args = job.args
    if job.rank == args.bad_secret_rank:
        os.environ["AWS_SECRET_ACCESS_KEY"] = "not-the-secret"
    manager = job.manager(
        {"model_save_format": args.format, "save_consolidated": False}, is_async=True
    )
    say(event="ready", rank=job.rank, uses_daemon=manager.uses_daemon)
    model = tiny_llama(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    steps = [int(s) for s in args.steps.split(",")]
    expected: list[Any] = []
    for step in steps:
        train_step(model, optimizer, seed=200 + step)
        scheduler.step()
        expected = [copy.deepcopy(s.state_dict()) for s in (model, optimizer, scheduler)]
        policy = f"{job.root}/tmp_step_{step}/policy"
        began = time.perf_counter()
        manager.save_checkpoint(
            model,
            f"{policy}/weights",
            optimizer,
            f"{policy}/optimizer",
            scheduler,
            tiny_tokenizer(),
            f"{policy}/tokenizer",
            is_final_checkpoint=step == steps[-1],
            seal=False,
        )
        stall = time.perf_counter() - began
        say(event="save_returned", rank=job.rank, step=step, stall_s=stall)
        if job.rank == 0:  # a file of the caller's, written after the save
            data = os.path.join(manager.step_dir, "train_dataloader.pt")
            torch.save({"consumed": step * 2}, data)
            manager.add_files(["train_dataloader.pt"])
        manager.seal()
        train_step(model, optimizer, seed=999)  # training goes on while the rank uploads
    manager.close()  # waits until this rank's done (or fail) is sent
    client = orchestrator.default_client()
    states = {step: client.wait(job.root, step, 60.0).state for step in steps}
    say(event="settled", rank=job.rank, states={str(k): v for k, v in states.items()})
    if states[steps[-1]] == "promoted":
        url = orchestrator.latest(job.root)
        assert url is not None
        fresh_manager = job.manager(
            {"model_save_format": args.format, "save_consolidated": False}, is_async=False
        )
        fresh = tiny_llama(seed=1)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_optimizer, step_size=1, gamma=0.5)
        fresh_manager.load_checkpoint(
            fresh, f"{url}/policy/weights", fresh_optimizer, f"{url}/policy/optimizer",
            fresh_scheduler,
        )  # fmt: skip
        loaded = [s.state_dict() for s in (fresh, fresh_optimizer, fresh_scheduler)]
        mismatches = [m for e, g in zip(expected, loaded, strict=True) for m in equal_states(e, g)]
        say(
            event="loaded",
            rank=job.rank,
            url=url,
            mismatches=mismatches[:10],
            optimizer_entries=len(loaded[1]["state"]),
        )
        fresh_manager.close()
    job.barrier()


def final_save(job: Job, model: Any, optimizer: Any, scheduler: Any) -> None:
    """The run's final checkpoint: safetensors, consolidated to HF format after upload."""
    step = job.args.final_step
    manager = job.manager(
        {"model_save_format": "safetensors", "save_consolidated": "final"}, is_async=True
    )
    if job.rank == 0:
        import torch

        torch.save(model.state_dict(), os.path.join(job.args.side, f"model_step_{step}.pt"))
    policy = os.path.join(job.init_tmp_checkpoint(step, {"step": step}), "policy")
    began = time.perf_counter()
    manager.save_checkpoint(
        model,
        os.path.join(policy, "weights"),
        optimizer,
        os.path.join(policy, "optimizer"),
        scheduler,
        is_final_checkpoint=True,
    )
    say(event="save_returned", rank=job.rank, step=step, stall_s=time.perf_counter() - began)
    manager.close()


def metrics(job: Job) -> None:
    """Each step's validation loss passed through ``save_checkpoint(metrics=...)``."""
    import torch

    from tests.automodel._models import tiny_llama, train_step

    manager = job.manager(
        {"model_save_format": "torch_save", "save_consolidated": False}, is_async=True
    )
    say(event="ready", rank=job.rank, uses_daemon=manager.uses_daemon)
    model = tiny_llama(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = {int(k): float(v) for k, v in (pair.split("=") for pair in job.args.losses.split(","))}
    for step, val_loss in losses.items():
        train_step(model, optimizer, seed=step)
        tmp = job.init_tmp_checkpoint(step, {"step": step, "val_reward": -val_loss})
        policy = os.path.join(tmp, "policy")
        manager.save_checkpoint(
            model,
            os.path.join(policy, "weights"),
            optimizer,
            os.path.join(policy, "optimizer"),
            is_final_checkpoint=False,
            metrics={"val_loss": val_loss},
        )
        say(event="saved", rank=job.rank, step=step)
    manager.close()
    job.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "scenario", choices=["roundtrip", "loop", "refused", "nodes", "metrics", "s3"]
    )
    parser.add_argument("--root", required=True)
    parser.add_argument("--side", default="", help="directory for reference tensors")
    parser.add_argument("--format", default="torch_save")
    parser.add_argument("--steps", default="1,2,3")
    parser.add_argument("--gate-dir", default="")
    parser.add_argument("--hold-rank", type=int, default=-1)
    parser.add_argument("--hold-before-step", type=int, default=-1)
    parser.add_argument("--hold-file-step", type=int, default=-1)
    parser.add_argument("--final-step", type=int, default=-1, help="a final safetensors save")
    parser.add_argument("--local-world-size", type=int, default=-1, help="-1: from the env")
    parser.add_argument("--losses", default="", help="STEP=VAL_LOSS,... (the metrics scenario)")
    parser.add_argument("--bad-secret-rank", type=int, default=-1, help="s3: its upload fails")
    args = parser.parse_args()
    job = Job(args)
    if args.scenario == "roundtrip":
        roundtrip(job)
        lora(job)
        dtypes(job)
    elif args.scenario == "refused":
        refused(job)
    elif args.scenario == "nodes":
        nodes(job)
    elif args.scenario == "metrics":
        metrics(job)
    elif args.scenario == "s3":
        s3(job)
    else:
        loop(job)
    import torch.distributed as dist

    dist.destroy_process_group()
    say(event="exit", rank=job.rank)


if __name__ == "__main__":
    main()

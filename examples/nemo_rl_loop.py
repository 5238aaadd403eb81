"""A NeMo-RL-layout training loop whose checkpoints ckptd promotes.

Run one process per rank::

    torchrun --standalone --nproc-per-node 2 examples/nemo_rl_loop.py ROOT [--no-daemon]

A small Llama built from a config (no download) trains on random tokens with AdamW
(gloo, CPU; every rank sees the same batch, so the replicas stay identical). Every
``--every`` steps it checkpoints exactly as NeMo-RL lays a step out::

    ROOT/tmp_step_N/training_info.json        written by rank 0 before the save
    ROOT/tmp_step_N/config.yaml               written by rank 0 before the save
    ROOT/tmp_step_N/policy/weights/model/     the model (DCP, or sharded safetensors)
    ROOT/tmp_step_N/policy/optimizer/optim/   AdamW + scheduler state (DCP)
    ROOT/tmp_step_N/policy/tokenizer/         written by rank 0 only
    ROOT/tmp_step_N/train_dataloader.pt       written by rank 0 after the save

With a daemon on ``$CKPTD_SOCKET`` (``ckptd serve --root ROOT``), ``save_checkpoint``
returns after staging, the loop writes its last file, seals the step and trains on; the
daemon renames ``tmp_step_N`` to ``step_N`` once every rank's uploads have landed. With
``--no-daemon`` it does what NeMo-RL does today: ``finalize_async_save()`` (blocking on
the uploads), then rank 0 renames. Each save prints how long the trainer was stalled.
On start it resumes from the newest ``step_N``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import orchestrator
from orchestrator.automodel import AutomodelCheckpointManager, build_checkpoint_config

VOCAB = 4096


def build_model(hidden: int, layers: int) -> torch.nn.Module:
    """A Llama of ``layers`` layers of width ``hidden``, initialised from seed 0."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model: torch.nn.Module = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    return model


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer built in memory with the ``tokenizers`` library."""
    words = "the quick brown fox jumps over the lazy dog".split()
    vocab = {"[UNK]": 0, "[PAD]": 1, **{w: i + 2 for i, w in enumerate(dict.fromkeys(words))}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]"
    )


def newest_step(root: str) -> int | None:
    """The newest promoted ``step_N`` under ``root``, if any."""
    steps = [int(n[5:]) for n in os.listdir(root) if n.startswith("step_") and n[5:].isdigit()]
    return max(steps, default=None)


def init_tmp_checkpoint(root: str, step: int, info: dict[str, float]) -> str:
    """NeMo-RL's ``CheckpointManager.init_tmp_checkpoint``: rank 0 writes, all wait."""
    tmp = os.path.join(root, f"tmp_step_{step}")
    if dist.get_rank() == 0:
        os.makedirs(tmp, exist_ok=True)
        with open(os.path.join(tmp, "training_info.json"), "w") as fh:
            json.dump(info, fh)
        with open(os.path.join(tmp, "config.yaml"), "w") as fh:
            fh.write(
                "policy:\n  automodel_cfg:\n    checkpoint:\n      model_save_format: torch_save\n"
            )
    dist.barrier()
    return tmp


def main() -> None:
    """Train, checkpointing every ``--every`` steps in the NeMo-RL layout."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("root", help="checkpoint root (the daemon's --root)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5, help="checkpoint interval in steps")
    parser.add_argument("--format", choices=["torch_save", "safetensors"], default="torch_save")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--no-daemon", action="store_true", help="finalize and rename here")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp", "tp"))
    model = build_model(args.hidden, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
    tokenizer = build_tokenizer()
    manager = AutomodelCheckpointManager(
        mesh["dp"], mesh["tp"], use_daemon=False if args.no_daemon else None
    )
    automodel_cfg = {"checkpoint": {"model_save_format": args.format, "save_consolidated": False}}
    manager.init_checkpointer(
        build_checkpoint_config(
            automodel_cfg,
            model_repo_id="tiny-llama",
            dequantize_base_checkpoint=False,
            is_peft=False,
            is_async=True,
        )
    )
    mode = "ckptd promotes" if manager.uses_daemon else "this loop finalizes and renames"
    params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"[loop] {params / 1e6:.1f} M parameters, {args.format}; {mode}", flush=True)

    start = newest_step(args.root) or 0
    if start:
        policy = os.path.join(args.root, f"step_{start}", "policy")
        manager.load_checkpoint(
            model,
            os.path.join(policy, "weights"),
            optimizer,
            os.path.join(policy, "optimizer"),
            scheduler,
        )
        if rank == 0:
            print(f"[loop] resumed from step_{start}", flush=True)

    stalls: list[float] = []
    for step in range(start + 1, start + args.steps + 1):
        tokens = torch.randint(0, VOCAB, (4, 64), generator=torch.Generator().manual_seed(step))
        loss = model(input_ids=tokens, labels=tokens).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        if step % args.every:
            continue
        tmp = init_tmp_checkpoint(args.root, step, {"step": step, "loss": loss.item()})
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
            is_final_checkpoint=step == start + args.steps,
            seal=False,  # train_dataloader.pt is written after the save
        )
        stall = time.perf_counter() - began
        if rank == 0:
            dataloader = os.path.join(tmp, "train_dataloader.pt")
            torch.save({"consumed_samples": step * 4}, dataloader)
            manager.add_files([dataloader])
        manager.seal()
        if not manager.uses_daemon:
            # NeMo-RL without ckptd: block until every upload landed, then rename.
            began = time.perf_counter()
            manager.finalize_async_save()
            dist.barrier()
            stall += time.perf_counter() - began
            if rank == 0:
                os.rename(tmp, os.path.join(args.root, f"step_{step}"))
        stalls.append(stall)
        if rank == 0:
            print(f"[loop] step {step}: loss {loss.item():.3f}, stalled {stall * 1000:.0f} ms")

    manager.close()  # let the last uploads land (and be reported) before exiting
    if rank == 0 and stalls:
        later = stalls[1:] or stalls  # the first async save also starts the upload process
        print(
            f"[loop] stall per save: first {stalls[0] * 1000:.0f} ms, median of the other "
            f"{len(later)} {statistics.median(later) * 1000:.0f} ms ({mode})",
            flush=True,
        )
        if manager.uses_daemon:
            last = start + args.steps - (start + args.steps) % args.every
            outcome = orchestrator.default_client().wait(args.root, last, timeout=120)
            print(f"[loop] step {last}: {outcome.state} {outcome.path or outcome.reason}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

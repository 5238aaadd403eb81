"""A transformers ``Trainer`` job on ckptd, and the tiny model and data the tests use.

``python tests/_hf_worker.py rank OUTPUT_DIR --steps 8 [--die-at 6] [--resume]`` runs
one rank as a launcher started it (its environment set: ``RANK``, ``LOCAL_WORLD_SIZE``,
...): each of the ranks ``torchrun`` starts, or one rank of a job spread over simulated
nodes.

Each rank trains a 1-layer GPT-2 built from a config (no downloads) with
``orchestrator.transformers.with_ckptd`` applied to a ``Trainer`` subclass of the job's
own, exactly as a user switches TRL's ``SFTTrainer``: a save every step, an evaluation
every step whose score is best at step 3, ``save_total_limit = 2`` and
``load_best_model_at_end``. It prints JSON lines: ``loaded`` (the step and the
weights' digest once training starts), ``saved`` (each checkpoint's step and digest),
``dying`` and ``finished``. With ``--die-at N`` rank 1 SIGKILLs itself in the middle of
step N's save, after its RNG state is half written.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from typing import Any

BEST_STEP = 3
"""The step whose evaluation scores best."""


def emit(event: str, **fields: Any) -> None:
    """One JSON line on stdout, in one write."""
    rank = int(os.environ.get("RANK", "0"))
    os.write(1, (json.dumps({"event": event, "rank": rank, **fields}) + "\n").encode())


def tiny_model() -> Any:
    """A 1-layer GPT-2 from a config, seeded: the same weights in every process."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, use_cache=False
    )
    model_class: Any = transformers.GPT2LMHeadModel
    return model_class(config)


def tiny_data(n: int, seed: int = 1) -> list[dict[str, Any]]:
    """``n`` examples of 8 tokens (labels = inputs), the same in every process."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (n, 8), generator=generator)
    return [{"input_ids": row, "labels": row} for row in ids]


def digest(model: Any) -> str:
    """A digest of the model's weights."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def arguments(output_dir: str, steps: int, **overrides: Any) -> Any:
    """The job's ``TrainingArguments``: save and evaluate every step, keep 2 and the best."""
    import transformers

    options: dict[str, Any] = {
        "output_dir": output_dir,
        "max_steps": steps,
        "per_device_train_batch_size": 2,
        "per_device_eval_batch_size": 2,
        "learning_rate": 1e-2,
        "save_strategy": "steps",
        "save_steps": 1,
        "eval_strategy": "steps",
        "eval_steps": 1,
        "save_total_limit": 2,
        "metric_for_best_model": "score",
        "greater_is_better": True,
        "load_best_model_at_end": True,
        "report_to": [],
        "logging_strategy": "no",
        "disable_tqdm": True,
        "use_cpu": True,
        # gloo for a job's ranks; a single process (the in-process tests) has no group.
        "ddp_backend": "gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        "dataloader_num_workers": 0,
        "seed": 0,
    }
    options.update(overrides)
    return transformers.TrainingArguments(**options)


def train(output_dir: str, steps: int, die_at: int | None, resume: bool) -> None:
    """One rank of the job (see the module)."""
    import transformers

    from orchestrator.transformers import with_ckptd

    class JobTrainer(transformers.Trainer):  # the job's own subclass
        def _save_rng_state(self, output_dir: str) -> None:
            if die_at == self.state.global_step and self.args.process_index == 1:
                with open(os.path.join(output_dir, "rng_state_1.pth"), "wb") as fh:
                    fh.write(b"half")
                    fh.flush()
                emit("dying", step=self.state.global_step)
                os.kill(os.getpid(), signal.SIGKILL)
            super()._save_rng_state(output_dir)

    class Reporter(transformers.TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            emit("loaded", step=state.global_step, digest=digest(kw["model"]))

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            emit("saved", step=state.global_step, digest=digest(kw["model"]))

    switched = with_ckptd(JobTrainer)  # the one-line switch
    holder: dict[str, Any] = {}

    def score(_: Any) -> dict[str, float]:
        return {"score": -abs(holder["trainer"].state.global_step - BEST_STEP)}

    trainer = switched(
        model=tiny_model(),
        args=arguments(output_dir, steps),
        train_dataset=tiny_data(64),
        eval_dataset=tiny_data(4, seed=2),
        compute_metrics=score,
        callbacks=[Reporter()],
    )
    holder["trainer"] = trainer
    trainer.train(resume_from_checkpoint=True if resume else None)
    emit(
        "finished",
        step=trainer.state.global_step,
        best=trainer.state.best_model_checkpoint,
        daemon=trainer.uses_daemon,
        digest=digest(trainer.model),
    )


def _rank(argv: list[str]) -> None:
    train(*_options(argv))


def _options(argv: list[str]) -> tuple[str, int, int | None, bool]:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--die-at", type=int)
    parser.add_argument("--resume", action="store_true")
    ns = parser.parse_args(argv)
    return ns.output_dir, ns.steps, ns.die_at, ns.resume


def main() -> int:
    """``rank`` (see the module)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    command, *argv = sys.argv[1:]
    if command == "rank":
        _rank(argv)
        return 0
    raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    sys.exit(main())

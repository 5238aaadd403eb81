"""Small real things the Automodel tests train and checkpoint: no downloads.

A tiny Llama built from a config, a word-level tokenizer built with the ``tokenizers``
library, an AdamW that keeps master weights the way Transformer Engine's ``FusedAdam``
does, and nemo_automodel's LoRA module.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = "the quick brown fox jumps over lazy dog checkpoint promote rank step".split()


def tiny_llama(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A two-layer Llama (about 0.2 M parameters) with weights drawn from ``seed``."""
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(seed)
    model: torch.nn.Module = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    return model.to(dtype)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> float:
    """One optimizer step on a random batch drawn from ``seed`` (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (2, 16), generator=gen)
    loss = model(input_ids=tokens, labels=tokens).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.item())


class RecordingTokenizer(PreTrainedTokenizerFast):
    """A real fast tokenizer that tells ``on_save`` each time it is written."""

    on_save: Callable[[str], None] | None = None

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        """Report the write, then write as usual."""
        if self.on_save is not None:
            self.on_save(str(save_directory))
        return super().save_pretrained(save_directory, *args, **kwargs)


def tiny_tokenizer() -> RecordingTokenizer:
    """A word-level tokenizer over :data:`WORDS`, built in memory."""
    vocab = {"[UNK]": 0, "[PAD]": 1, "<s>": 2, "</s>": 3}
    vocab.update({word: 4 + i for i, word in enumerate(WORDS)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return RecordingTokenizer(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        unk_token="[UNK]",
        pad_token="[PAD]",
        bos_token="<s>",
        eos_token="</s>",
    )


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW over BF16 parameters with FP32 master weights, like TE's ``FusedAdam``.

    Each parameter's ``master_param`` state is its FP32 master copy, or, with
    ``store_param_remainders``, the low 16 bits of that FP32 value as ``int16``: the
    BF16 parameter holds the high 16 bits, so together they are the exact FP32 value.
    """

    master_weights = True

    def __init__(
        self, params: Any, lr: float = 1e-3, *, store_param_remainders: bool = False
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8})
        self.store_param_remainders = store_param_remainders

    def _master(self, param: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        if "master_param" not in state:
            return param.detach().float()
        stored: torch.Tensor = state["master_param"]
        if stored.dtype == torch.float32:
            return stored.clone()
        high = param.detach().view(torch.int16).to(torch.int32) << 16
        return (high | (stored.to(torch.int32) & 0xFFFF)).view(torch.float32)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load, keeping moments and masters in their own dtype (FP32 or int16).

        ``torch.optim.Optimizer.load_state_dict`` casts floating state to the parameter
        dtype (BF16 here); optimizers with master weights keep theirs, as TE's does.
        """
        super().load_state_dict(state_dict)
        # Saved parameter ids (positions, or FQNs from DCP) pair up with ours in order.
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        lookup = dict(zip(saved_ids, params, strict=True))
        for param_id, saved in state_dict["state"].items():
            for key, value in saved.items():
                if key != "step" and isinstance(value, torch.Tensor):
                    self.state[lookup[param_id]][key] = value.detach().clone()

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One AdamW update on the FP32 masters; parameters get their BF16 rounding."""
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                master = self._master(param, state)
                if "step" not in state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(master)
                    state["exp_avg_sq"] = torch.zeros_like(master)
                state["step"] += 1
                grad = param.grad.float()
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step = float(state["step"])
                denom = (state["exp_avg_sq"] / (1 - beta2**step)).sqrt_().add_(group["eps"])
                master.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1**step))
                bits = master.view(torch.int32)
                if self.store_param_remainders:
                    param.copy_((bits >> 16).to(torch.int16).view(torch.bfloat16))
                    state["master_param"] = (bits & 0xFFFF).to(torch.int16)
                else:
                    param.copy_(master.to(torch.bfloat16))
                    state["master_param"] = master


def import_nemo_lora() -> ModuleType:
    """``nemo_automodel.components._peft.lora``, even where triton rejects its kernels.

    nemo_automodel 0.7.0 decorates its LoRA Triton kernels with autotune keys (``S``)
    that triton 3.9 refuses when the module is imported (``ValueError: key contains
    names that are not kernel arguments``), and falls back to its no-Triton stubs only
    when triton is missing (or older than 3.4 without CUDA). These CPU tests never run
    those kernels, so the module is imported with triton hidden, then triton is put
    back for everything else.
    """
    name = "nemo_automodel.components._peft.lora"
    try:
        return importlib.import_module(name)
    except ValueError:
        pass
    hidden = {key: sys.modules.pop(key) for key in list(sys.modules) if _is_triton(key)}
    for key in [k for k in sys.modules if k.startswith("nemo_automodel.components._peft")]:
        del sys.modules[key]
    sys.modules["triton"] = None  # type: ignore[assignment]  # makes `import triton` fail
    try:
        return importlib.import_module(name)
    finally:
        del sys.modules["triton"]
        sys.modules.update(hidden)


def _is_triton(module: str) -> bool:
    return module == "triton" or module.startswith("triton.")

"""Refusing to resume optimizer master weights whose on-disk dtype has drifted.

Optimizers that keep master weights (Transformer Engine's ``FusedAdam`` with
``master_weights=True``, and the like) hold a ``master_param`` state per parameter: an
FP32 copy, or, with ``store_param_remainders=True``, the 16 low bits of the FP32 value as
``int16`` next to BF16 parameters. DCP loads into whatever buffers the live optimizer
has, casting on the way: FP32 masters loaded into int16 remainder buffers (or the other
way round) are silently turned into garbage. This check compares dtypes from the
checkpoint's DCP metadata (no tensor is read) with the live optimizer's state dict
before anything is loaded.
"""

from __future__ import annotations

import os
from typing import Any, Final

import torch
from nemo_automodel.components.checkpoint.stateful_wrappers import OptimizerState
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["MASTER_PARAM_KEY", "MasterWeightDtypeError", "describe_drift", "master_weight_drift"]

MASTER_PARAM_KEY: Final = "master_param"
"""Optimizer state key of a parameter's master weight (Transformer Engine's name)."""

OPTIM_SUBDIR: Final = "optim"
"""Where ``Checkpointer.save_optimizer`` writes inside ``optimizer_path``."""


class MasterWeightDtypeError(ValueError):
    """Raised when a checkpoint's master-weight dtype differs from the live optimizer's."""


def master_weight_drift(
    model: torch.nn.Module | list[torch.nn.Module],
    optimizer: torch.optim.Optimizer,
    optimizer_path: str,
    *,
    is_peft: bool = False,
    has_expert_parallelism: bool = False,
) -> list[tuple[str, torch.dtype, torch.dtype]]:
    """Master-weight entries whose checkpoint dtype differs from the live optimizer's.

    Args:
        model: The model the optimizer updates (as given to ``save_optimizer``).
        optimizer: The live optimizer about to be loaded into.
        optimizer_path: The optimizer checkpoint (``.../policy/optimizer``); its DCP
            metadata is read from ``optim/.metadata``.
        is_peft: As configured on the Checkpointer (changes the state-dict layout).
        has_expert_parallelism: Whether a MoE mesh is in use (likewise).

    Returns:
        ``(key, checkpoint dtype, live dtype)`` per drifted entry, sorted by key; empty
        when they match, or when either side has no master weights.

    Raises:
        FileNotFoundError: ``optimizer_path`` holds no DCP optimizer checkpoint.
    """
    meta_path = os.path.join(optimizer_path, OPTIM_SUBDIR)
    if not os.path.isfile(os.path.join(meta_path, ".metadata")):
        raise FileNotFoundError(f"no optimizer checkpoint at {meta_path} (no .metadata)")
    saved = {
        key: md.properties.dtype
        for key, md in FileSystemReader(meta_path).read_metadata().state_dict_metadata.items()
        if _is_master(key) and isinstance(md, TensorStorageMetadata)
    }
    if not saved:
        return []
    state: dict[str, Any] = OptimizerState(
        model, optimizer, is_peft=is_peft, has_expert_parallelism=has_expert_parallelism
    ).state_dict()
    flat, _ = flatten_state_dict(state)
    live = {k: v.dtype for k, v in flat.items() if _is_master(k) and isinstance(v, torch.Tensor)}
    return [
        (k, saved[k], live[k]) for k in sorted(saved.keys() & live.keys()) if saved[k] != live[k]
    ]


def describe_drift(drift: list[tuple[str, torch.dtype, torch.dtype]], optimizer_path: str) -> str:
    """The error message for :func:`master_weight_drift`'s findings."""
    key, on_disk, live = drift[0]
    more = f" (and {len(drift) - 1} more entries)" if len(drift) > 1 else ""
    return (
        f"cannot resume optimizer master weights from {optimizer_path}: {key} is stored as "
        f"{on_disk} in the checkpoint but the current optimizer keeps it as {live}{more}. "
        "Loading would silently cast one into the other (e.g. FP32 masters into int16 "
        "remainders of BF16 parameters). Restore the precision and the optimizer's "
        "master_weight_dtype / store_param_remainders settings the checkpoint was saved "
        "with, or start without restoring optimizer state."
    )


def _is_master(key: str) -> bool:
    return key.rsplit(".", 1)[-1] == MASTER_PARAM_KEY

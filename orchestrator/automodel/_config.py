"""``build_checkpoint_config``: NeMo-RL's YAML ``checkpoint`` block to Automodel fields.

The boundary between NeMo-RL's configuration and nemo_automodel's
``CheckpointingConfig``. Everything returned is checked against the fields of the
installed dataclass, so an Automodel upgrade that drops or renames a field fails here,
at configuration time, instead of as a ``TypeError`` deep inside a worker.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Final

from nemo_automodel.components.checkpoint.config import CheckpointingConfig

__all__ = ["ALLOWED_SAVE_FORMATS", "OPTIONAL_KEYS", "build_checkpoint_config"]

ALLOWED_SAVE_FORMATS: Final = ("torch_save", "safetensors")
"""Values ``checkpoint.model_save_format`` may take with the Automodel workers."""

OPTIONAL_KEYS: Final = ("single_rank_consolidation", "consolidation_timeout_minutes")
"""Keys of the ``checkpoint`` block forwarded only when the YAML sets them."""

_REQUIRED_KEYS: Final = ("model_save_format", "save_consolidated")


def accepted_fields() -> frozenset[str]:
    """Names of the fields the installed ``CheckpointingConfig`` dataclass accepts."""
    return frozenset(f.name for f in dataclasses.fields(CheckpointingConfig) if f.init)


def build_checkpoint_config(
    automodel_cfg: Mapping[str, Any],
    *,
    model_repo_id: str,
    dequantize_base_checkpoint: bool,
    is_peft: bool,
    is_async: bool,
    skip_task_head_prefixes_for_base_model: list[str] | None = None,
) -> dict[str, Any]:
    """Build the Automodel checkpoint config for a worker.

    Reads NeMo-RL's settings from the YAML-backed ``checkpoint`` block and forwards them
    to Automodel. Defaults belong in the exemplar configs, so the block must set
    ``model_save_format`` and ``save_consolidated``; ``single_rank_consolidation`` and
    ``consolidation_timeout_minutes`` are copied only when present.

    Args:
        automodel_cfg: The worker's ``policy.automodel_cfg`` / ``value.automodel_cfg``
            mapping. Only its nested ``checkpoint`` block is read; other keys are ignored.
        model_repo_id: Forwarded to ``CheckpointingConfig.model_repo_id``.
        dequantize_base_checkpoint: Forwarded to
            ``CheckpointingConfig.dequantize_base_checkpoint``; it only takes effect on a
            base-checkpoint init load, not on a resume load.
        is_peft: Forwarded to ``CheckpointingConfig.is_peft``.
        is_async: Forwarded to ``CheckpointingConfig.is_async``.
        skip_task_head_prefixes_for_base_model: Parameter prefixes skipped on base-model
            init loads (the value worker passes ``["score."]``); set on the result only
            when not None.

    Returns:
        Only fields the installed ``CheckpointingConfig`` accepts, meant to be splatted
        into ``CheckpointingConfig(enabled=True, checkpoint_dir="", **result)``.

    Raises:
        KeyError: the ``checkpoint`` block, or a required key in it, is missing.
        ValueError: ``model_save_format`` is not ``torch_save`` or ``safetensors``.
        TypeError: the installed nemo_automodel no longer accepts one of the fields
            (an upgrade dropped or renamed it); the message names the field.
    """
    if "checkpoint" not in automodel_cfg:
        raise KeyError(
            "automodel_cfg has no 'checkpoint' block; set checkpoint.model_save_format and "
            "checkpoint.save_consolidated in the exemplar config"
        )
    raw: Mapping[str, Any] = automodel_cfg["checkpoint"]
    missing = [key for key in _REQUIRED_KEYS if key not in raw]
    if missing:
        raise KeyError(
            f"automodel_cfg.checkpoint is missing {', '.join(missing)}; defaults belong in "
            "the exemplar configs, so set them there"
        )
    model_save_format = raw["model_save_format"]
    if model_save_format not in ALLOWED_SAVE_FORMATS:
        raise ValueError(
            f"automodel_cfg.checkpoint.model_save_format must be one of "
            f"{', '.join(repr(f) for f in ALLOWED_SAVE_FORMATS)}, got {model_save_format!r}"
        )
    config: dict[str, Any] = {
        "model_save_format": model_save_format,
        "save_consolidated": raw["save_consolidated"],
        "model_repo_id": model_repo_id,
        "dequantize_base_checkpoint": dequantize_base_checkpoint,
        "is_peft": is_peft,
        "is_async": is_async,
    }
    config.update({key: raw[key] for key in OPTIONAL_KEYS if key in raw})
    if skip_task_head_prefixes_for_base_model is not None:
        config["skip_task_head_prefixes_for_base_model"] = skip_task_head_prefixes_for_base_model
    unknown = sorted(config.keys() - accepted_fields())
    if unknown:
        raise TypeError(
            f"the installed nemo_automodel CheckpointingConfig does not accept "
            f"{', '.join(unknown)}; NeMo-RL's checkpoint block no longer matches this "
            "Automodel version"
        )
    return config

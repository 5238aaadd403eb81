"""The previous generation of NeMo-RL's Automodel checkpoint API, on the same manager.

NeMo-RL's main branch (and many users' pins) still call the manager as it was before
``build_checkpoint_config``: ``init_checkpointer(config_updates, checkpoint_root)``,
``save_checkpoint(..., checkpointing_cfg=..., lora_enabled=..., peft_config=...)`` with
the save's configuration re-applied on every call (``update_checkpointer_config``), and
loads that find the checkpoint's format on disk (``detect_checkpoint_format``). This
module holds what that generation needs beyond the current one; the manager accepts
both (``_manager.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Final

__all__ = [
    "LEGACY_SAVE_KEYS",
    "_infer_checkpoint_root",
    "apply_config_updates",
    "detect_checkpoint_format",
    "legacy_save_updates",
    "loading_config",
]

logger = logging.getLogger("orchestrator.automodel")

LEGACY_SAVE_KEYS: Final = frozenset(
    {
        "model_save_format",
        "save_consolidated",
        "is_peft",
        "peft_config",
        "model_cache_dir",
        "model_repo_id",
        "is_async",
        "dequantize_base_checkpoint",
    }
)
"""Keys of NeMo-RL's ``checkpointing`` block a previous-generation save forwards."""

_DCP_SUFFIX: Final = ".distcp"
_PICKLE_SUFFIXES: Final = (".bin", ".pt", ".pth")


def detect_checkpoint_format(weights_path: str) -> tuple[str, bool]:
    """The save format and PEFT-ness of the checkpoint under ``weights_path``.

    Every file below ``weights_path`` counts: DCP shards (``*.distcp``) or pickles
    (``.bin``, ``.pt``, ``.pth``) make it ``torch_save``, ``*.safetensors`` make it
    ``safetensors`` (DCP wins when both are there); a file whose name mentions
    ``adapter`` makes it PEFT. An empty, unreadable or missing directory is
    ``("safetensors", False)``.

    Args:
        weights_path: A checkpoint's weights directory (or its ``model`` subdirectory).

    Returns:
        ``(model_save_format, is_peft)``.
    """
    names: list[str] = []
    try:
        for _dir, _subdirs, files in os.walk(weights_path):
            names += files
    except OSError:
        names = []
    if any(n.endswith(_DCP_SUFFIX) for n in names):
        fmt = "torch_save"
    elif any(n.endswith(".safetensors") for n in names):
        fmt = "safetensors"
    elif any(n.endswith(_PICKLE_SUFFIXES) for n in names):
        fmt = "torch_save"
    else:
        fmt = "safetensors"
    return fmt, any("adapter" in n.lower() for n in names)


def _infer_checkpoint_root(weights_path: str) -> str:
    """The checkpoint's root for a weights path: above ``weights``, else the parent.

    ``/ckpt/step_3/policy/weights/model`` and ``/ckpt/step_3/policy/weights`` give
    ``/ckpt/step_3/policy``; any other path its parent directory.

    Args:
        weights_path: The path a save or load was given.

    Returns:
        The directory (``""`` for a one-level relative path such as ``weights/model``).
    """
    parent = os.path.dirname(weights_path)
    return os.path.dirname(parent) if parent.endswith("weights") else parent


def legacy_save_updates(
    checkpointing_cfg: Mapping[str, Any], lora_enabled: bool, peft_config: Any
) -> dict[str, Any]:
    """The Checkpointer fields a previous-generation save applies before saving.

    Args:
        checkpointing_cfg: NeMo-RL's ``checkpointing`` block as the worker got it.
        lora_enabled: The worker's LoRA switch: forces ``is_peft`` and ``peft_config``.
        peft_config: The worker's PEFT configuration.

    Returns:
        The keys of :data:`LEGACY_SAVE_KEYS` the block sets (and the LoRA overrides).
    """
    updates = {key: value for key, value in checkpointing_cfg.items() if key in LEGACY_SAVE_KEYS}
    if lora_enabled:
        updates["is_peft"] = True
        updates["peft_config"] = peft_config
    return updates


def apply_config_updates(
    checkpointer: Any, updates: Mapping[str, Any], checkpoint_root: str | None
) -> None:
    """Set fields of a live Checkpointer's config, and rebuild what depends on them.

    Values are coerced as ``CheckpointingConfig`` does at construction (a format name
    to its enum, a bool or alias to a consolidation mode); the addons chosen from the
    config at construction (HF metadata, PEFT) are chosen again. ``is_async`` cannot
    change once the Checkpointer exists (its stagers and upload groups are made by its
    constructor): a different value is ignored, with a warning.

    Args:
        checkpointer: The manager's Checkpointer.
        updates: ``CheckpointingConfig`` field names to values.
        checkpoint_root: A new ``checkpoint_dir``, if not None.
    """
    config = checkpointer.config
    if checkpoint_root is not None:
        config.checkpoint_dir = checkpoint_root
    for key, value in updates.items():
        if key == "is_async" and bool(value) != bool(config.is_async):
            logger.warning(
                "checkpointing is_async=%s ignored: the Checkpointer was built with "
                "is_async=%s, set it in init_checkpointer's config_updates",
                value,
                config.is_async,
            )
            continue
        setattr(config, key, _coerce(key, value))
    _rebuild_addons(checkpointer)


@contextmanager
def loading_config(checkpointer: Any, weights_path: str) -> Iterator[None]:
    """The Checkpointer configured for the checkpoint on disk, while loading it.

    A load reads the format and PEFT-ness the files have (:func:`detect_checkpoint_format`)
    and never dequantizes (a saved checkpoint already is); the save configuration is
    restored afterwards, so a load never changes how the next save writes.
    """
    config = checkpointer.config
    fmt, is_peft = detect_checkpoint_format(weights_path)
    keys = ("model_save_format", "is_peft", "dequantize_base_checkpoint")
    saved = {key: getattr(config, key) for key in keys}
    wanted = {"model_save_format": fmt, "is_peft": is_peft, "dequantize_base_checkpoint": False}
    changed = {k: v for k, v in wanted.items() if _coerce(k, v) != saved[k]}
    if changed:
        apply_config_updates(checkpointer, changed, None)
    try:
        yield
    finally:
        if changed:
            for key, value in saved.items():
                setattr(config, key, value)
            _rebuild_addons(checkpointer)


def _coerce(key: str, value: Any) -> Any:
    from nemo_automodel.components.checkpoint._backports.filesystem import SerializationFormat

    if key == "model_save_format" and isinstance(value, str):
        return SerializationFormat[value.upper()]
    if key == "save_consolidated":
        from nemo_automodel.components.checkpoint import config as am_config

        normalize = getattr(am_config, "_normalize_save_consolidated", None)
        return value if normalize is None else normalize(value)
    return value


def _rebuild_addons(checkpointer: Any) -> None:
    """Choose the Checkpointer's addons from its config, as its constructor does."""
    import nemo_automodel.components.checkpoint.checkpointing as am_checkpointing
    from nemo_automodel.components.checkpoint.addons import ConsolidatedHFAddon, PeftAddon

    writes_hf = getattr(am_checkpointing, "_should_write_hf_metadata", None)
    if writes_hf is not None:
        hf_metadata = bool(writes_hf(checkpointer.config))
    else:  # releases before 0.7 had it as a method
        hf_metadata = bool(checkpointer._should_write_hf_metadata())
    addons: list[Any] = [ConsolidatedHFAddon()] if hf_metadata else []
    if checkpointer.config.is_peft:
        addons.append(PeftAddon())
    checkpointer._addons = addons

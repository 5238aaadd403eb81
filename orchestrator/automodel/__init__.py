"""NeMo-RL's Automodel checkpoint API on nemo_automodel's Checkpointer, promoted by ckptd.

A drop-in for ``nemo_rl.models.automodel.checkpoint``, of both its generations (the
current reference API and NeMo-RL main's previous one, ``_generations.py``): the same
names, signatures and behaviour, built on nemo-automodel 0.7.0's real ``Checkpointer`` and
``CheckpointingConfig``. When the node's ckptd daemon is reachable, saves into
``ROOT/tmp_step_N/`` are promoted to ``ROOT/step_N/`` by the daemon once every rank's
writes have landed, so training never blocks on ``finalize_async_save`` to rename. See
``docs/nemo-rl.md``.

Importing this subpackage loads torch and nemo_automodel (``import orchestrator`` does
not), and applies :func:`_patch_qwen_vl_vision_key_mapping`, as NeMo-RL's module does; a
failure to apply it is logged, never raised.
"""

from __future__ import annotations

import logging

from ._config import build_checkpoint_config
from ._dtypes import MasterWeightDtypeError
from ._generations import _infer_checkpoint_root, detect_checkpoint_format
from ._loading import CheckpointerNotInitialized
from ._lora import _resolve_lora_adapter_dir
from ._manager import AutomodelCheckpointManager
from ._qwen_patch import _patch_qwen_vl_vision_key_mapping, apply_at_import

__all__ = [
    "AutomodelCheckpointManager",
    "CheckpointerNotInitialized",
    "MasterWeightDtypeError",
    "_infer_checkpoint_root",
    "_patch_qwen_vl_vision_key_mapping",
    "_resolve_lora_adapter_dir",
    "build_checkpoint_config",
    "detect_checkpoint_format",
    "logger",
]

logger = logging.getLogger(__name__)
"""This module's logger (``orchestrator.automodel``); every part logs through it."""

apply_at_import()

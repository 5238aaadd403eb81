"""NeMo-RL's ``checkpointing`` block, and the ckptd retention policy that keeps the same.

``CheckpointingConfig`` has NeMo-RL's keys, unchanged. :func:`retention_table` turns its
retention keys into the daemon's ``[roots.retention]`` table with NeMo-RL's semantics
(``docs/nemo-rl.md``): periodic steps (``step % save_period == 0``) are kept, only the
``keep_top_k`` best of them when that is set (a step without the metric counts as the
worst, ties go to the newer step; without a metric the newest win);
``ft_keep_latest_k`` keeps the newest k; the daemon always keeps the newest step.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Literal, NotRequired, TypedDict

__all__ = [
    "CheckpointingConfig",
    "PathLike",
    "describe_policy",
    "retention_table",
    "retention_toml",
]

PathLike = str | os.PathLike[Any]
"""A path, as NeMo-RL's config gives it."""


class PretrainedCheckpointConfig(TypedDict):
    """Initial weights from an existing Megatron checkpoint (NeMo-RL's key, unused here)."""

    path: str
    format: Literal["megatron_bridge", "megatron_lm"]


class CheckpointingConfig(TypedDict):
    """NeMo-RL's ``checkpointing`` configuration block (the same keys).

    Attributes:
        enabled: Whether checkpointing is on.
        checkpoint_dir: The root the steps are written under (the daemon's ``--root``).
        metric_name: The ``training_info.json`` key that ranks checkpoints
            (``"val:accuracy"``), or None to rank by recency.
        higher_is_better: Whether a higher metric is better.
        save_period: Steps between saves; a step that is a multiple is periodic.
        keep_top_k: Periodic checkpoints kept, the best by the metric (None: all).
        ft_keep_latest_k: The newest checkpoints kept for crash recovery (None: none).
        save_optimizer: Whether the optimizer is saved (default True).
    """

    enabled: bool
    checkpoint_dir: PathLike
    metric_name: str | None
    higher_is_better: bool
    save_period: int
    keep_top_k: NotRequired[int | None]
    ft_keep_latest_k: NotRequired[int | None]
    ft_save_period: NotRequired[int]
    checkpoint_must_save_by: NotRequired[str | None]
    pretrained_checkpoint: NotRequired[PretrainedCheckpointConfig]
    save_optimizer: NotRequired[bool]
    model_save_format: NotRequired[str | None]
    save_consolidated: NotRequired[bool]
    model_cache_dir: NotRequired[str]
    model_repo_id: NotRequired[str]
    is_peft: NotRequired[bool]
    peft_config: NotRequired[Any]
    is_async: NotRequired[bool]


def retention_table(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The daemon's ``[roots.retention]`` table that keeps what NeMo-RL would keep.

    Args:
        config: NeMo-RL's ``checkpointing`` block.

    Returns:
        The table (as TOML would parse it), or None when NeMo-RL deletes nothing
        (``keep_top_k`` and ``ft_keep_latest_k`` both None): the root needs no policy.
    """
    top_k = config.get("keep_top_k")
    latest_k = config.get("ft_keep_latest_k")
    if top_k is None and latest_k is None:
        return None
    period = int(config["save_period"])
    table: dict[str, Any] = {}
    if latest_k is not None:
        table["keep_last"] = int(latest_k)
    if top_k is None:
        table["keep_every_steps"] = period
    else:
        best: dict[str, Any] = {"k": int(top_k), "unscored": "worst", "every_steps": period}
        metric = config.get("metric_name")
        if metric is not None:
            best["metric"] = metric
            best["mode"] = "max" if config.get("higher_is_better") else "min"
        table["keep_best"] = best
    return table


def describe_policy(table: Mapping[str, Any] | None) -> str:
    """The policy as the daemon describes it (``RetentionInfo.policy``), "" for none."""
    if table is None:
        return ""
    parts = []
    if "keep_last" in table:
        parts.append(f"keep_last={table['keep_last']}")
    if "keep_every_steps" in table:
        parts.append(f"keep_every_steps={table['keep_every_steps']}")
    best = table.get("keep_best")
    if best is not None:
        text = f"keep_best={best['k']}:{best.get('metric') or '-'}:{best.get('mode', 'max')}"
        if best.get("every_steps") is not None:
            text += f",every={best['every_steps']}"
        if best.get("unscored", "grace") != "grace":
            text += f",unscored={best['unscored']}"
        parts.append(text)
    return " ".join(parts)


def retention_toml(root: str, table: Mapping[str, Any] | None) -> str:
    """The daemon configuration for ``root`` with ``table`` (``ckptd serve --config``)."""
    lines = ["[[roots]]", f"path = {json.dumps(root)}"]
    if table is not None:
        lines += ["", "[roots.retention]"]
        for key, value in table.items():
            if isinstance(value, Mapping):
                inner = ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items())
                lines.append(f"{key} = {{ {inner} }}")
            else:
                lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"

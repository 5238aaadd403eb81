"""NeMo-RL's checkpoint directory rules on the local filesystem, without a daemon.

What ``CheckpointManager`` does when no daemon promotes its steps (NeMo-RL's own
behaviour), and what it reads with one: the ``step_N`` directories of a root and their
``training_info.json``, the rename of ``tmp_step_N`` (replacing an existing
``step_N``), the union of keep rules, the best and the latest checkpoint, and the
weights and optimizer paths to resume from.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final, NamedTuple

__all__ = [
    "Checkpoint",
    "best_of",
    "history",
    "kept_steps",
    "latest_step_dir",
    "missing_metric_warnings",
    "rename_into_place",
    "resume_paths",
]

logger = logging.getLogger("orchestrator.nemo_rl")

_STEP_DIR: Final = re.compile(r"step_(\d+)")
_HINT: Final = "Consider enabling val_at_end or adjusting val_period to align with max_steps."


class Checkpoint(NamedTuple):
    """One ``step_N`` of a root with its training info."""

    step: int
    path: str
    info: dict[str, Any]


def _step_dirs(root: Path) -> list[str]:
    # One positional argument: NeMo-RL's tests replace glob.glob with a one-argument
    # function to fix the listing's order.
    return [p for p in glob.glob(str(root / "step_*")) if _STEP_DIR.fullmatch(Path(p).name)]


def history(root: Path) -> list[Checkpoint]:
    """Every ``step_N`` of ``root`` that holds a ``training_info.json``, in listing order."""
    found = []
    for path in _step_dirs(root):
        info = Path(path) / "training_info.json"
        if info.exists():
            with open(info) as fh:
                found.append(Checkpoint(int(Path(path).name[5:]), path, json.load(fh)))
    return found


def latest_step_dir(root: Path) -> str | None:
    """The ``step_N`` of ``root`` with the highest N, or None."""
    dirs = _step_dirs(root)
    return max(dirs, key=lambda p: int(Path(p).name[5:])) if dirs else None


def rename_into_place(tmp_dir: Path) -> None:
    """Rename ``tmp_step_N`` to ``step_N``; an existing ``step_N`` is replaced.

    The old one is first renamed to ``old_step_N`` and removed after the new one is in
    place, so a crash in between leaves one of the two under ``step_N``.
    """
    step = tmp_dir.name.split("_")[2]
    final = tmp_dir.parent / f"step_{step}"
    if not final.exists():
        os.rename(tmp_dir, final)
        return
    old = tmp_dir.parent / f"old_step_{step}"
    os.rename(final, old)
    os.rename(tmp_dir, final)
    shutil.rmtree(old, ignore_errors=True)


def _metric_key(metric: str, higher_is_better: bool) -> Callable[[Checkpoint], tuple[float, int]]:
    """Sort key, best first: by the metric (missing: the worst), ties the newer step."""
    if higher_is_better:
        return lambda c: (-c.info.get(metric, -float("inf")), -c.step)
    return lambda c: (c.info.get(metric, float("inf")), -c.step)


def kept_steps(
    checkpoints: list[Checkpoint], config: Mapping[str, Any], *, exclude_latest: bool
) -> set[int]:
    """The steps NeMo-RL's retention keeps (a union of its rules).

    Periodic steps (``step % save_period == 0``): all of them, or the ``keep_top_k``
    best when that is set (by the metric, a step without it the worst; by recency
    without a metric). ``ft_keep_latest_k``: the newest k. ``exclude_latest``: the
    newest step.
    """
    kept: set[int] = set()
    if exclude_latest and checkpoints:
        kept.add(max(c.step for c in checkpoints))
    periodic = [c for c in checkpoints if c.step % int(config["save_period"]) == 0]
    top_k = config.get("keep_top_k")
    if top_k is None:
        kept.update(c.step for c in periodic)
    else:
        metric = config.get("metric_name")
        if metric is None:
            ranked = sorted(periodic, key=lambda c: -c.step)
        else:
            ranked = sorted(periodic, key=_metric_key(metric, bool(config["higher_is_better"])))
        kept.update(c.step for c in ranked[:top_k])
    latest_k = config.get("ft_keep_latest_k")
    if latest_k is not None:
        kept.update(sorted((c.step for c in checkpoints), reverse=True)[:latest_k])
    return kept


def missing_metric_warnings(steps_without: list[int], total: int, metric: str | None) -> bool:
    """Warn as NeMo-RL does about checkpoints without the metric.

    Returns:
        Whether none has it (the caller then answers with the latest checkpoint).
    """
    if steps_without:
        warnings.warn(
            f"Ignoring {len(steps_without)} checkpoint(s) at step(s) {steps_without} that do "
            f"not have metric '{metric}'. {_HINT}",
            stacklevel=3,
        )
    if len(steps_without) == total:
        warnings.warn(
            f"No checkpoints contain metric '{metric}'. Returning latest checkpoint. {_HINT}",
            stacklevel=3,
        )
        return True
    return False


def best_of(checkpoints: list[Checkpoint], metric: str | None, higher: bool) -> str | None:
    """The best checkpoint's path by ``metric`` (ties: the newer), None for no scores."""
    scored = [c for c in checkpoints if metric is not None and metric in c.info]
    if metric is None or not scored:
        return None
    sign = -1.0 if higher else 1.0
    return min(scored, key=lambda c: (sign * c.info[metric], -c.step)).path


def resume_paths(
    checkpoint: str | os.PathLike[Any] | None,
    component: str,
    load_common_state: Callable[[Path], dict[str, Any]],
) -> tuple[Path | None, Path | None]:
    """NeMo-RL's weights and optimizer paths to resume ``component`` from.

    A physical ``optimizer`` directory (DTensor, Automodel) wins; otherwise a Megatron
    checkpoint (``weights/iter_0000000`` with ``common.pt`` or ``metadata.json``) whose
    common state has ``optimizer`` embeds it (the optimizer path is then only a flag).
    Without either the optimizer path is None, with a ``UserWarning``.
    """
    if not checkpoint:
        return None, None
    base = Path(checkpoint) / component
    weights, optimizer = base / "weights", base / "optimizer"
    if optimizer.exists():
        return weights, optimizer
    iteration = weights / "iter_0000000"
    if (iteration / "common.pt").exists() or (iteration / "metadata.json").exists():
        if "optimizer" in load_common_state(iteration):
            return weights, optimizer
    warnings.warn(
        f"Optimizer state not found at {optimizer} (DTensor path), and no embedded "
        f"optimizer state detected under {weights} (Megatron path). "
        "Optimizer will be freshly initialized.",
        stacklevel=3,
    )
    return weights, None

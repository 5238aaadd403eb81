"""Whether ckptd serves a Trainer's ``output_dir``, hiding saves in flight from it.

transformers finds checkpoints by listing ``output_dir``: ``get_last_checkpoint`` takes
the highest ``checkpoint-N`` directory (``checkpoint-`` and digits), and its rotation globs
``checkpoint-*``. So the root the daemon serves must promote to ``checkpoint-N``
(``final_prefix = "checkpoint-"``) and stage outside ``output_dir`` altogether (the
root's ``staging`` directory, on the same filesystem), under a name that never starts
with ``checkpoint-`` (the daemon refuses a ``tmp_prefix`` that starts with the
``final_prefix``). :func:`connect` asks the daemon once, when the trainer is built,
on every rank; the ranks agree (all of them use the daemon, or none does), so a save
never has ranks writing to two different directories.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Final

import msgspec

from .. import protocol as p
from .._client import CheckpointClient
from .._dropin import Daemon, agree, probe, read_layout

__all__ = [
    "FINAL_PREFIX",
    "STAGING_SUFFIX",
    "Daemon",
    "Retention",
    "connect",
    "retention_of",
    "root_toml",
]

logger = logging.getLogger("orchestrator.transformers")

FINAL_PREFIX: Final = "checkpoint-"
"""What transformers names a checkpoint (``PREFIX_CHECKPOINT_DIR`` and a dash): the
root's ``final_prefix``."""
STAGING_SUFFIX: Final = ".ckptd-staging"
"""The staging directory :func:`root_toml` proposes: ``output_dir`` with this suffix,
beside it."""


class Retention(msgspec.Struct, frozen=True):
    """transformers' rotation of one Trainer, as the daemon's retention policy.

    ``save_total_limit = K`` keeps the K newest checkpoints and, whatever K, the best
    one (``best_model_checkpoint``). The daemon's ``keep_last = K`` keeps the newest;
    ``keep_best`` with ``k = 1`` keeps the best by the metric the trainer reports for
    each checkpoint that was its best when saved (:attr:`metric`, ranked by
    :attr:`mode`; a checkpoint saved while not the best reports nothing and is ranked
    after every scored one). Each new best strictly improves on the one before, so the
    daemon's best is always the trainer's.
    """

    keep_last: int | None
    """``save_total_limit``; None (no limit, or 0): keep everything."""
    metric: str | None
    """The evaluation metric as the trainer logs it (``eval_loss``); None when the
    trainer tracks no best model."""
    mode: str = "min"
    """``max`` when ``greater_is_better``, else ``min``."""

    def policy(self) -> str:
        """The daemon's description of this policy (``RetentionInfo.policy``)."""
        if self.keep_last is None:
            return ""
        parts = [f"keep_last={self.keep_last}"]
        if self.metric is not None:
            parts.append(f"keep_best=1:{self.metric}:{self.mode},unscored=worst")
        return " ".join(parts)


def retention_of(args: Any) -> Retention:
    """The daemon's retention policy for a Trainer's ``TrainingArguments``."""
    limit = args.save_total_limit
    keep_last = limit if isinstance(limit, int) and limit > 0 else None
    metric = args.metric_for_best_model
    if metric is not None and not metric.startswith("eval_"):
        metric = f"eval_{metric}"
    return Retention(keep_last, metric, "max" if args.greater_is_better else "min")


def root_toml(output_dir: str, retention: Retention, staging: str | None = None) -> str:
    """The daemon's ``[[roots]]`` table for a Trainer's ``output_dir``.

    Args:
        output_dir: The Trainer's ``output_dir``, absolute.
        retention: :func:`retention_of` the Trainer's arguments.
        staging: The staging directory; default ``output_dir`` + ``.ckptd-staging``,
            beside it (create it before the daemon starts).

    Returns:
        TOML for ``ckptd serve --config``.
    """
    staging = staging or output_dir.rstrip(os.sep) + STAGING_SUFFIX
    lines = [
        "[[roots]]",
        f'path = "{output_dir}"',
        f'staging = "{staging}"',
        f'final_prefix = "{FINAL_PREFIX}"',
    ]
    if retention.keep_last is not None:
        lines += ["", "[roots.retention]", f"keep_last = {retention.keep_last}"]
        if retention.metric is not None:
            lines.append(
                f'keep_best = {{ k = 1, metric = "{retention.metric}", mode = '
                f'"{retention.mode}", unscored = "worst" }}'
            )
    return "\n".join(lines) + "\n"


def connect(
    output_dir: str, retention: Retention, client: CheckpointClient | None
) -> Daemon | None:
    """The daemon serving ``output_dir`` on every rank, or None (one warning says why).

    A collective when ``torch.distributed`` is initialized with more than one rank:
    every rank must call it, as every rank builds its Trainer.

    Raises:
        ValueError: a daemon serves the directory but names or stages its checkpoints
            so that transformers would not find them, or would find saves in flight;
            the message gives the root's table to use.
    """
    daemon, why = probe(
        output_dir,
        client,
        policy=retention.policy(),
        table=root_toml(os.path.abspath(output_dir), retention),
        logger=logger,
    )
    error = None if daemon is None else _layout_error(daemon.root, retention)
    without = "transformers' Trainer saves and rotates the checkpoints in"
    return agree(daemon, why, error, location=output_dir, without=without, logger=logger)


def _layout_error(root: str, retention: Retention) -> str | None:
    info = read_layout(root)
    fix = f"Configure the root as:\n{root_toml(root, retention)}"
    if info is None:
        return (
            f"ckptd serves {root} but its {p.LAYOUT_FILE} is missing or unreadable, so "
            f"the names of its checkpoints are unknown. {fix}"
        )
    if info.final_prefix != FINAL_PREFIX:
        return (
            f"ckptd promotes the checkpoints of {root} to {info.final_prefix}N, where "
            f"transformers looks for {FINAL_PREFIX}N. {fix}"
        )
    if not info.staging:
        return (
            f"ckptd stages the checkpoints of {root} inside it ({info.tmp_prefix}N), where "
            "transformers lists its checkpoints; give the root a staging directory "
            f"beside it. {fix}"
        )
    return None

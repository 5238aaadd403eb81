"""Whether ckptd serves a torchtitan checkpoint folder, and whether it is laid out for it.

torchtitan finds checkpoints by a ``re.search`` for ``step-`` and digits over the folder's
entries and resumes from the highest one holding ``.metadata`` (or an HF index). So the
root the daemon serves must promote to ``step-N`` (``final_prefix = "step-"``) and stage
under a name that search cannot match (the default ``tmp_step_N`` does not: an
underscore, not a dash). :func:`connect` asks the daemon once, when the manager is
built, on every rank; the ranks agree (all of them use the daemon, or none does), so a
save never has ranks writing to two different directories.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Final

from .. import protocol as p
from .._client import CheckpointClient
from .._dropin import Daemon, agree, probe, read_layout

__all__ = ["FINAL_PREFIX", "Daemon", "connect", "policy_for", "root_toml"]

logger = logging.getLogger("orchestrator.torchtitan")

FINAL_PREFIX: Final = "step-"
"""What torchtitan names a checkpoint (``_create_checkpoint_id``): the root's
``final_prefix``."""
STEP_SEARCH: Final = re.compile(r"step-(\d+)")
"""torchtitan's discovery pattern (``_find_load_step``, ``_purge_stale_checkpoints``),
applied with ``re.search``."""


def policy_for(keep_latest_k: int) -> str:
    """The daemon's description (``RetentionInfo.policy``) of ``keep_latest_k``'s rule."""
    return f"keep_last={keep_latest_k}" if keep_latest_k > 0 else ""


def root_toml(root: str, keep_latest_k: int) -> str:
    """The daemon's ``[[roots]]`` table for a torchtitan checkpoint folder.

    Args:
        root: The checkpoint folder (``dump_folder/checkpoint.folder``), absolute.
        keep_latest_k: torchtitan's ``checkpoint.keep_latest_k`` (0: keep every step).

    Returns:
        TOML for ``ckptd serve --config``.
    """
    lines = ["[[roots]]", f'path = "{root}"', f'final_prefix = "{FINAL_PREFIX}"']
    if keep_latest_k > 0:
        lines += ["", "[roots.retention]", f"keep_last = {keep_latest_k}"]
    return "\n".join(lines) + "\n"


def connect(folder: str, keep_latest_k: int, client: CheckpointClient | None) -> Daemon | None:
    """The daemon serving ``folder`` on every rank, or None (one warning says why).

    A collective when ``torch.distributed`` is initialized with more than one rank:
    every rank must call it, as every rank builds its checkpoint manager.

    Raises:
        ValueError: a daemon serves the folder but names its steps so that torchtitan
            would not find them, or would find staged ones; the message gives the
            root's table to use.
    """
    daemon, why = probe(
        folder,
        client,
        policy=policy_for(keep_latest_k),
        table=root_toml(os.path.abspath(folder), keep_latest_k),
        logger=logger,
    )
    error = None if daemon is None else _layout_error(daemon.root, keep_latest_k)
    without = "torchtitan's CheckpointManager saves and purges"
    return agree(daemon, why, error, location=folder, without=without, logger=logger)


def _layout_error(root: str, keep_latest_k: int) -> str | None:
    info = read_layout(root)
    fix = f"Configure the root as:\n{root_toml(root, keep_latest_k)}"
    if info is None:
        return (
            f"ckptd serves {root} but its {p.LAYOUT_FILE} is missing or unreadable, so "
            f"the names of its steps are unknown. {fix}"
        )
    if info.final_prefix != FINAL_PREFIX:
        return (
            f"ckptd promotes the steps of {root} to {info.final_prefix}N, where torchtitan "
            f"looks for {FINAL_PREFIX}N. {fix}"
        )
    if STEP_SEARCH.search(f"{info.tmp_prefix}0") is not None:
        return (
            f"ckptd stages the steps of {root} as {info.tmp_prefix}N, which torchtitan's "
            f"search for step-(\\d+) would take for a checkpoint. {fix}"
        )
    return None

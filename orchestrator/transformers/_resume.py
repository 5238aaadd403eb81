"""Which checkpoint a Trainer resumes from on a root with a fast tier.

transformers resumes from the highest ``checkpoint-N`` in ``output_dir``
(``get_last_checkpoint``, which ``resume_from_checkpoint=True`` calls). On a root with a
fast tier the newest checkpoints are in the fast tier (``FAST/checkpoint-N``), and the
durable root holds only the drained ones: the daemons decide which step every rank of
the run restores (``restore``, docs/tiers.md), and this module asks them. Without a
fast tier, or without a daemon answering, transformers' own search decides.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from .._errors import DaemonError
from .._tiers import decided, has_fast_tier

if TYPE_CHECKING:
    from .._ops import OpsClient

__all__ = ["decided_checkpoint", "get_last_checkpoint"]

logger = logging.getLogger("orchestrator.transformers")


def decided_checkpoint(
    output_dir: str, client: OpsClient | None, rank: int, world_size: int
) -> str | None:
    """The checkpoint the daemons decided this rank resumes from, or None.

    None: ``output_dir`` has no fast tier, no daemon could decide, or neither tier holds
    a checkpoint; the caller then does what transformers does.
    """
    root = os.path.abspath(output_dir)
    if not has_fast_tier(root):
        return None
    if client is None:
        from .._dcp import default_client

        client = default_client()
    try:
        found = decided(root, client, rank=rank, world_size=world_size)
    except DaemonError as exc:
        logger.warning(
            "ckptd: no restore decision for %s (%s); transformers' own search of it decides",
            root,
            exc,
        )
        return None
    return None if found is None else found.path


def get_last_checkpoint(folder: str, *, client: OpsClient | None = None) -> str | None:
    """The checkpoint to resume from: transformers' ``get_last_checkpoint``, tier-aware.

    A drop-in for ``transformers.trainer_utils.get_last_checkpoint`` in a training script
    (``last = get_last_checkpoint(args.output_dir)``): on a root with a fast tier it is
    the checkpoint the daemons decided for this rank's run (in this node's fast tier, or
    the durable root); otherwise, or without a daemon answering (``$CKPTD_SOCKET``),
    transformers' own answer. Call it on every rank, as such scripts do: the daemons
    decide once every rank asked. The rank and world size are torch.distributed's, else
    torchrun's ``RANK`` and ``WORLD_SIZE``.

    Args:
        folder: The Trainer's ``output_dir``.
        client: The daemon client to ask; default the process-wide one
            (``$CKPTD_SOCKET``).

    Returns:
        The checkpoint's directory, or None when there is none.
    """
    rank, world = _rank_world()
    found = decided_checkpoint(folder, client, rank, world)
    if found is not None:
        return found
    from transformers import trainer_utils

    upstream: Any = trainer_utils.get_last_checkpoint  # untyped
    last: Any = upstream(folder)
    return None if last is None else str(last)


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist  # the trainer's process has torch

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))

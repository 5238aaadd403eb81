"""``async_save``: ``torch.distributed.checkpoint.async_save`` tracked by the daemon."""

from __future__ import annotations

import os
import threading
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save

from ._client import CheckpointClient

__all__ = ["async_save", "checkpoint_group", "default_client"]

_lock = threading.Lock()
_client: CheckpointClient | None = None
_group: Any = None


def default_client() -> CheckpointClient:
    """The process-wide client, connected to ``$CKPTD_SOCKET`` (created on first use)."""
    global _client
    with _lock:
        if _client is None:
            _client = CheckpointClient()
        return _client


def checkpoint_group() -> Any:
    """A gloo process group over all ranks, used only for checkpoint traffic.

    DCP's collectives on the training group deadlock against training's own; a separate
    gloo group avoids that. Created on first call, which (like every group creation)
    must happen on every rank in the same order.
    """
    global _group
    with _lock:
        if _group is None:
            _group = dist.new_group(backend="gloo")
        return _group


def async_save(
    state_dict: dict[str, Any],
    *,
    root: str,
    step: int,
    subdir: str = "",
    client: CheckpointClient | None = None,
    process_group: Any = None,
    **kwargs: Any,
) -> Any:
    """Start ``dcp.async_save`` of ``state_dict`` into step ``step`` and let ckptd promote it.

    Begins the save with the daemon (acknowledged before writing starts), calls
    ``dcp.async_save`` on a separate gloo group, and reports ``done`` with this rank's
    shard files (or ``fail``) when the upload completes. The training thread never waits
    for the upload. All ranks of the group must call it.

    Args:
        state_dict: What to save, as for ``dcp.async_save``.
        root: The checkpoint root the daemon is configured with.
        step: The step; written into ``ROOT/tmp_step_{step}/{subdir}``.
        subdir: DCP directory inside the step (e.g. ``"model"``); default the step dir.
        client: The daemon client; default :func:`default_client`.
        process_group: Group for DCP's collectives; default :func:`checkpoint_group`.
        **kwargs: Passed to ``dcp.async_save`` (``async_stager``,
            ``async_checkpointer_type``, ``storage_writer``, ...).

    Returns:
        What ``dcp.async_save`` returned (a future or an ``AsyncSaveResponse``).

    Raises:
        BaseException: whatever ``dcp.async_save`` raises while starting; the daemon is
            told the save failed first.
    """
    group = checkpoint_group() if process_group is None else process_group
    rank, world_size = dist.get_rank(), dist.get_world_size()
    handle = (client or default_client()).save(root, step, rank, world_size)
    checkpoint_id = os.path.join(handle.path, subdir) if subdir else handle.path
    try:
        result = dcp_async_save(
            state_dict, checkpoint_id=checkpoint_id, process_group=group, **kwargs
        )
    except BaseException as exc:  # CheckpointException derives from BaseException
        handle.fail(f"async_save raised {type(exc).__name__}: {exc}")
        raise
    handle.add(result, dcp_dir=subdir or ".", group_rank=dist.get_rank(group))
    handle.seal()
    return result

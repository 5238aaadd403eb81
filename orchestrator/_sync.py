"""``save``: a synchronous ``dcp.save``, gated and reported as ``async_save`` is.

A trainer that saves synchronously (torchtitan's ``async_mode = "disabled"``, a last
checkpoint before exit) still writes into a directory the daemon promotes, so it is
gated the same way: the save's planner waits for the ``begin``'s acknowledgement
before DCP writes a byte (:class:`~orchestrator.AfterBeginPlanner`), and the files the
rank wrote are reported with its ``done`` once the call returns.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ._client import CheckpointClient
from ._dcp import AfterBeginPlanner, _refused, _RefusedPlanner, checkpoint_group, default_client
from ._objstore import is_object_url, storage_writer
from ._tracking import SaveHandle, describe

__all__ = ["save"]


def save(
    state_dict: dict[str, Any],
    *,
    root: str,
    step: int,
    subdir: str = "",
    client: CheckpointClient | None = None,
    handle: SaveHandle | None = None,
    process_group: Any = None,
    local_world_size: int | None = None,
    **kwargs: Any,
) -> Any:
    """Save ``state_dict`` into step ``step`` with ``dcp.save`` and let ckptd promote it.

    The synchronous counterpart of :func:`~orchestrator.async_save`: it sends ``begin``
    without waiting, runs ``dcp.save`` on a separate gloo group with a planner that
    waits for the acknowledgement before anything is written (bounded by the client's
    ``begin_timeout``), and reports ``done`` with the files this rank wrote when the
    save returned (or ``fail`` when it raised). If the daemon *refuses* the ``begin``,
    the planner raises :class:`~orchestrator.SaveRefused` when DCP sets it up: DCP's
    plan fails on every rank before any write, and this raises DCP's
    ``CheckpointException``. All ranks of the group must call it.

    A step written in several parts shares one handle, sealed by the caller::

        handle = client.save(root, step, rank, world_size, wait=False)
        orchestrator.save(model_sd, root=root, step=step, subdir="model", handle=handle)
        orchestrator.save(optim_sd, root=root, step=step, subdir="optim", handle=handle)
        handle.seal()

    Args:
        state_dict: What to save, as for ``dcp.save``.
        root: The checkpoint root the daemon is configured with (a directory, or
            ``s3://BUCKET/PREFIX``: written through DCP's ``FsspecWriter``).
        step: The step; written into ``ROOT/tmp_step_{step}/{subdir}``.
        subdir: DCP directory inside the step (e.g. ``"model"``); default the step dir.
        client: The daemon client; default :func:`~orchestrator.default_client`.
        handle: The step's :class:`SaveHandle` when it is written in several parts; the
            caller then seals it. Default: begin a handle and seal it after this part.
        process_group: Group for DCP's collectives; default
            :func:`~orchestrator.checkpoint_group`.
        local_world_size: How many of the job's ranks are on this node (see
            :func:`~orchestrator.async_save`).
        **kwargs: Passed to ``dcp.save`` (``storage_writer``, ``planner``,
            ``use_collectives``, ...). With a ``planner`` of the caller's, this waits for
            the acknowledgement before calling ``dcp.save``.

    Returns:
        What ``dcp.save`` returned: the save's ``Metadata``.

    Raises:
        ValueError: ``local_world_size`` (or the environment it is read from) does not
            fit the world size, or differs from ``handle``'s; raised before anything is
            sent or written.
        BaseException: whatever ``dcp.save`` raises (DCP's ``CheckpointException``
            derives from ``BaseException``); the daemon is told the save failed first,
            unless it refused the save.
    """
    client = client or default_client()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local = client.resolve_local_world_size(world_size, local_world_size)
    if handle is not None and local_world_size is not None and local != handle.local_world_size:
        raise ValueError(
            f"save(local_world_size={local}) was given the handle of a save begun "
            f"with local_world_size={handle.local_world_size}"
        )
    group = checkpoint_group(subdir) if process_group is None else process_group
    seal = handle is None
    if handle is None:
        handle = client.save(root, step, rank, world_size, wait=False, local_world_size=local)
    if "planner" not in kwargs:
        kwargs["planner"] = AfterBeginPlanner(handle)
    else:
        refusal = handle.refusal  # the caller's planner cannot wait: this thread does
        if refusal is not None:
            kwargs["planner"] = _RefusedPlanner(_refused(handle, refusal))
    checkpoint_id = os.path.join(handle.path, subdir) if subdir else handle.path
    if is_object_url(checkpoint_id) and "storage_writer" not in kwargs:
        kwargs["storage_writer"] = storage_writer(checkpoint_id)
    try:
        metadata = dcp_save(state_dict, checkpoint_id=checkpoint_id, process_group=group, **kwargs)
    except BaseException as exc:  # CheckpointException derives from BaseException
        handle.fail(f"save raised {describe(exc)}")  # nothing, if the daemon refused it
        raise
    handle.add(metadata, dcp_dir=subdir or ".", group_rank=dist.get_rank(group))
    if seal:
        handle.seal()
    return metadata

"""Restoring from a root with a fast tier: ask the daemon, fall back to the durable root.

A root with a fast tier (its layout file names it) is restored from the step its
daemons decided for the run (``restore``, docs/tiers.md): the fast tier's copy when
every node holds what its ranks read, else the durable root's newest. Without a
daemon, the durable root's ``latest`` is the answer, as for any root.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from ._errors import DaemonError
from ._layout import read_layout
from ._objstore import is_object_url
from ._objstore import latest as durable_latest
from ._steps import Found, find_pointer

if TYPE_CHECKING:
    from ._ops import OpsClient

__all__ = ["decided", "has_fast_tier", "latest", "restore_point"]

log = logging.getLogger("orchestrator")


def has_fast_tier(root: str) -> bool:
    """Whether ``root``'s layout file says its steps are written into a fast tier."""
    if is_object_url(root):
        return False
    info = read_layout(root)
    return info is not None and bool(info.fast)


def restore_point(
    root: str,
    client: OpsClient | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_world_size: int | None = None,
    timeout: float = 60.0,
) -> Found | None:
    """The step this rank restores and where: the daemon's decision for the run.

    ``rank`` and ``world_size`` default to torchrun's ``RANK`` and ``WORLD_SIZE`` (0 and
    1). An unreachable daemon, or one that cannot decide, leaves the durable root's
    ``latest`` (logged once per call).
    """
    if client is None:
        from ._dcp import default_client

        client = default_client()
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    try:
        return decided(
            root, client, rank=rank, world_size=world_size,
            local_world_size=local_world_size, timeout=timeout,
        )  # fmt: skip
    except DaemonError as exc:
        log.warning("ckptd: no restore decision for %s (%s); the durable root's latest", root, exc)
        return find_pointer(root)


def decided(
    root: str,
    client: OpsClient,
    *,
    rank: int,
    world_size: int,
    local_world_size: int | None = None,
    timeout: float = 60.0,
) -> Found | None:
    """The step the daemons decided this rank of the run restores, and where.

    The drop-ins' resume on a root with a fast tier: each asks with its own rank and
    falls back to its trainer's own discovery of the durable root when this raises.

    Returns:
        The step and its directory (in the fast tier or the durable root); None when
        neither tier holds a complete step.

    Raises:
        DaemonError: the daemon could not be reached, or could not decide.
    """
    reply = client.restore(
        root, rank, world_size, local_world_size=local_world_size, timeout=timeout
    )
    if reply.step is None or reply.path is None:
        return None
    log.info(
        "ckptd: resuming %s from step %s in the %s tier (%s)", root, reply.step, reply.tier,
        reply.path,
    )  # fmt: skip
    return Found(step=reply.step, path=reply.path)


def latest(root: str, pointer: str = "latest") -> str | None:
    """Where the checkpoint to resume from is: ``orchestrator.latest``.

    On a root with a fast tier, the step the daemons decided for this run
    (:func:`restore_point`: the fast tier's copy, or the durable root's); elsewhere the
    root's ``pointer`` read without the daemon (:func:`orchestrator._objstore.latest`).

    Raises:
        OSError: the object store could not be read.
    """
    if pointer == "latest" and has_fast_tier(root):
        found = restore_point(root)
        return None if found is None else found.path
    return durable_latest(root, pointer)

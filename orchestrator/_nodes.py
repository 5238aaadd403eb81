"""How many of the job's ranks are on this node: ``begin``'s ``local_world_size``.

A step whose ranks span nodes is written through one daemon per node; each node's
daemon must know how many of the step's ranks it serves (``docs/multinode.md``). The
client takes the number, in this order, from:

1. an explicit ``local_world_size`` argument (it always wins);
2. torchrun's ``LOCAL_WORLD_SIZE``;
3. Slurm's ``SLURM_NTASKS_PER_NODE`` (set with ``--ntasks-per-node``);
4. Slurm's ``SLURM_TASKS_PER_NODE``: one count for every node (``8`` or ``8(x4)`` or
   ``8,8``), or, when the counts differ (``8(x2),4``), this node's, the entry that
   ``SLURM_NODEID`` (this node's index in the allocation) names; without a usable
   ``SLURM_NODEID`` such a list is not used.

With none of them, nothing is sent: the daemon takes ``world_size``, one node. A
client reads the environment once, when it is created (:func:`read_environment`):
launchers set these variables before the process starts, and a ``begin`` on the
training thread then costs no lookups.

A value that cannot be right is an error, not a guess: a wrong count makes a node's
daemon wait for ranks that are elsewhere, or never learn of them. The explicit argument
must be an ``int`` (not a ``bool``) with ``1 <= local_world_size <= world_size``;
``LOCAL_WORLD_SIZE`` must be a positive integer (torchrun writes nothing else), and
neither it nor a Slurm value may exceed ``world_size``. Each raises :class:`ValueError`
naming the argument or the variable, before anything is sent. Slurm's variables are
written by Slurm for the allocation, so one that is not a plain positive integer (or an
unambiguous ``SLURM_TASKS_PER_NODE``) is ignored, as if unset.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

__all__ = ["ENV_VARS", "NodeEnv", "local_world_size", "read_environment"]

ENV_VARS: Final = (
    "LOCAL_WORLD_SIZE",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
    "SLURM_NODEID",
)
"""The environment variables read, in order of precedence."""

_PLAIN: Final = re.compile(r"[1-9][0-9]{0,9}")
_TASKS: Final = re.compile(r"([1-9][0-9]{0,9})(?:\(x[1-9][0-9]{0,9}\))?")


@dataclass(frozen=True, slots=True)
class NodeEnv:
    """The variable that says how many ranks are on this node, as it was read.

    Attributes:
        name: The variable (one of :data:`ENV_VARS`).
        raw: Its value.
        value: The count it gives; None for a ``LOCAL_WORLD_SIZE`` that is not a
            positive integer (an error once a ``begin`` needs it).
    """

    name: str
    raw: str
    value: int | None


def read_environment(environ: Mapping[str, str] | None = None) -> NodeEnv | None:
    """The first of :data:`ENV_VARS` that says something, or None.

    Args:
        environ: The environment to read (default ``os.environ``).
    """
    env = os.environ if environ is None else environ
    raw = env.get("LOCAL_WORLD_SIZE", "").strip()
    if raw:
        return NodeEnv("LOCAL_WORLD_SIZE", raw, int(raw) if _PLAIN.fullmatch(raw) else None)
    raw = env.get("SLURM_NTASKS_PER_NODE", "").strip()
    if _PLAIN.fullmatch(raw):
        return NodeEnv("SLURM_NTASKS_PER_NODE", raw, int(raw))
    raw = env.get("SLURM_TASKS_PER_NODE", "").strip()
    count = _tasks_here(raw, env.get("SLURM_NODEID", "").strip())
    if count is not None:
        return NodeEnv("SLURM_TASKS_PER_NODE", raw, count)
    return None


def local_world_size(
    world_size: int, explicit: int | None = None, env: NodeEnv | None = None
) -> int | None:
    """This node's share of ``world_size`` ranks, from ``explicit`` or the environment.

    Args:
        world_size: Ranks writing the step, over all nodes.
        explicit: The caller's ``local_world_size``; wins over the environment.
        env: What :func:`read_environment` found.

    Returns:
        The number of the step's ranks on this node, or None when nothing says (the
        daemon then takes ``world_size``).

    Raises:
        ValueError: ``explicit`` is not an ``int`` from 1 to ``world_size``, or the
            environment names a count that cannot be right (see the module).
    """
    if explicit is not None:
        if isinstance(explicit, bool) or not isinstance(explicit, int):
            raise ValueError(
                f"local_world_size must be an int from 1 to world_size ({world_size}), "
                f"got {explicit!r}"
            )
        if not 1 <= explicit <= world_size:
            raise ValueError(
                f"local_world_size={explicit} is outside 1..world_size ({world_size}): "
                "a node cannot hold more of the step's ranks than the step has"
            )
        return explicit
    if env is None:
        return None
    if env.value is None:
        raise ValueError(
            f"{env.name}={env.raw!r} is not a positive integer; torchrun sets it to the "
            "number of this node's ranks (unset it, or pass local_world_size)"
        )
    if env.value > world_size:
        raise ValueError(
            f"{env.name}={env.raw!r} says {env.value} ranks are on this node, more than "
            f"the step's world_size ({world_size}): the environment does not describe "
            "this job (fix it, or pass local_world_size)"
        )
    return env.value


def _tasks_here(raw: str, node_id: str) -> int | None:
    # Slurm's "8(x2),4": one count per node, "(xN)" repeating it. One count for every
    # node is this node's; otherwise SLURM_NODEID (this node's index) picks its entry.
    if not raw:
        return None
    counts: list[tuple[int, int]] = []  # (count, nodes)
    for part in raw.split(","):
        found = _TASKS.fullmatch(part.strip())
        if found is None:
            return None
        repeat = part.strip().partition("(x")[2].rstrip(")")
        counts.append((int(found[1]), int(repeat) if repeat else 1))
    if len({count for count, _ in counts}) == 1:
        return counts[0][0]
    if not node_id.isdigit() or not node_id.isascii():
        return None
    index = int(node_id)
    for count, nodes in counts:
        if index < nodes:
            return count
        index -= nodes
    return None  # an index beyond the list: not this allocation's

"""Which run of the job this process belongs to: ``begin``'s ``run``.

Every rank of one run must name the same run without asking a daemon, and a restarted
or requeued run must name another: a daemon that lost its state (a requeue on fresh
state directories) tells the run's own attempt of a step from another run's only by
this name. The client takes it, in this order, from:

1. an explicit ``run`` argument (it always wins);
2. torchelastic's ``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_RESTART_COUNT`` (torchrun
   sets both; ``--standalone``, and a one-node launch without a rendezvous endpoint,
   draw a new run id at each launch). torchrun's default id ``none`` (a static
   rendezvous across nodes without ``--rdzv-id``) is the same at every launch and names
   no run: give such jobs a ``--rdzv-id`` of their own per launch, or ``run=``;
3. Slurm's ``SLURM_JOB_ID`` and ``SLURM_RESTART_COUNT`` (a requeue keeps the job id and
   counts the restart).

With none of them the run is unnamed, as before: a node then cannot tell another run's
attempt of a step that spans nodes from its own, and the client says so once. An id
that does not fit the protocol's ``RunId`` (letters, digits, ``._:-``, at most 128) is
replaced by a digest of it, the same on every rank; a launcher's id alone is digested,
so its runs stay ``KIND:ID:COUNT`` and a later run still supersedes an earlier one
(``orchestrator.protocol.run_supersedes``).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from typing import Final

__all__ = ["RUN_VARS", "run_identity"]

RUN_VARS: Final = (
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "SLURM_JOB_ID",
    "SLURM_RESTART_COUNT",
)
"""The environment variables read."""

_ELASTIC_DEFAULT: Final = "none"
"""torchrun's ``--rdzv-id`` default: the same at every launch, so it names no run."""
_RUN_ID: Final = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_LAUNCH: Final = re.compile(r"^[A-Za-z0-9._:-]{1,100}$")


def run_identity(explicit: str | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """The run this process belongs to, or None when nothing names it.

    Args:
        explicit: A run id given by the caller (used as it is, if it fits).
        env: The environment (default ``os.environ``).

    Raises:
        ValueError: ``explicit`` does not fit the protocol's ``RunId``.
    """
    if explicit is not None:
        if not _RUN_ID.match(explicit):
            raise ValueError(
                f"run {explicit!r}: use 1 to 128 letters, digits, '.', '_', ':' or '-'"
            )
        return explicit
    env = os.environ if env is None else env
    elastic = env.get("TORCHELASTIC_RUN_ID")
    if elastic and elastic != _ELASTIC_DEFAULT:
        count = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        return _fit(f"torchelastic:{_launch(elastic)}:{count}")
    job = env.get("SLURM_JOB_ID")
    if job:
        return _fit(f"slurm:{_launch(job)}:{env.get('SLURM_RESTART_COUNT', '0')}")
    return None


def _launch(ident: str) -> str:
    """A launcher's id as it fits a run id, leaving room for the kind and the count."""
    if _LAUNCH.match(ident):
        return ident
    return "sha256-" + hashlib.sha256(ident.encode()).hexdigest()[:32]


def _fit(run: str) -> str:
    if _RUN_ID.match(run):
        return run
    return "sha256:" + hashlib.sha256(run.encode()).hexdigest()[:32]

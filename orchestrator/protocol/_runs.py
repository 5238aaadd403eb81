"""Which run of a launch comes later: the rule by which a dead run is superseded.

A ``begin`` names its run (``Begin.run``). The client (``orchestrator._run``) names a run
that torchelastic or Slurm launched ``KIND:ID:COUNT``: ``torchelastic:RUN_ID:RESTART_COUNT``
or ``slurm:JOB_ID:RESTART_COUNT``. Runs of one launch share ``KIND:ID``; a restarted or
requeued run counts one more. torchelastic restarts a job's workers only after stopping
all of them, and Slurm requeues a job only after it ended, so a ``begin`` of a later run
of the same launch proves every rank of the earlier runs dead: the daemon may take the
step from their open attempt at once instead of waiting for their leases.

Any other run id (a caller's own ``run=``, a digest) names no launch and supersedes
nothing: such runs only ever conflict. Pure and shared by the client and the daemon.
"""

from __future__ import annotations

from typing import Final, NamedTuple

__all__ = ["LaunchRun", "launch_run", "run_supersedes"]

LAUNCHERS: Final = ("torchelastic", "slurm")
"""The launchers whose restart counts order runs."""


class LaunchRun(NamedTuple):
    """A run id of the form ``KIND:ID:COUNT``, taken apart."""

    kind: str
    launch: str
    restarts: int


def launch_run(run: str | None) -> LaunchRun | None:
    """``run`` taken apart, if a launcher named it (see the module); else None."""
    if not run:
        return None
    kind, sep, rest = run.partition(":")
    if not sep or kind not in LAUNCHERS:
        return None
    launch, sep, count = rest.rpartition(":")
    if not sep or not launch or not count.isdigit() or len(count) > 9:
        return None
    return LaunchRun(kind, launch, int(count))


def run_supersedes(new: str | None, old: str | None) -> bool:
    """Whether run ``new`` is a later run of the same launch as run ``old``.

    True only when both are a launcher's ``KIND:ID:COUNT`` with the same kind and id,
    and ``new`` counts more restarts: ``torchelastic:abc:1`` supersedes
    ``torchelastic:abc:0``, never ``torchelastic:xyz:0`` nor ``slurm:abc:0``.
    """
    later, earlier = launch_run(new), launch_run(old)
    if later is None or earlier is None:
        return False
    return (later.kind, later.launch) == (earlier.kind, earlier.launch) and (
        later.restarts > earlier.restarts
    )

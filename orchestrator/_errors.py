"""The trainer side's exceptions: one hierarchy, each class saying when it is raised."""

from __future__ import annotations

from typing import Any

__all__ = ["DaemonError", "SaveRefused"]


class DaemonError(RuntimeError):
    """Raised by the blocking query calls when the daemon refuses or cannot be reached.

    Attributes:
        code: The daemon's error code, or one of the client's own: ``"unreachable"``,
            ``"timeout"``, ``"closed"`` (the client was closed), ``"dropped"`` (too
            much was left unacknowledged), ``"reply_too_long"`` (the reply line was
            longer than the client accepts; see ``CheckpointClient(max_reply=...)``).
        message: What went wrong, in words.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        # Raised inside DCP's upload process too: it must cross a pipe intact.
        return (type(self), (self.code, self.message))


class SaveRefused(DaemonError):
    """The daemon refused a save's ``begin``, so nothing of the save may be written.

    Raised where the save is stopped before its first byte: by
    :class:`~orchestrator.AfterBeginPlanner` when DCP sets it up (DCP's plan then fails
    on every rank, and the save's future fails with a ``CheckpointException`` holding
    this), and by the automodel manager's ``save_checkpoint`` on every rank.

    Attributes:
        code: The daemon's error code (``already_promoted``, ``step_closed``,
            ``step_failed``, ``stale_attempt``, ``world_size_mismatch``, ...).
        message: The daemon's explanation.
        root: The checkpoint root.
        step: The step.
        rank: The rank whose ``begin`` was refused.
        fix: What to do about it, in words (by ``code``).
    """

    def __init__(self, code: str, message: str, *, root: str, step: int, rank: int) -> None:
        super().__init__(code, message)
        self.root = root
        self.step = step
        self.rank = rank
        self.fix = FIXES.get(code, "see the daemon's message above")
        text = (
            f"ckptd refused the begin of step {step} of {root} for rank {rank} "
            f"({code}: {message}); nothing of this save is written. Fix: {self.fix}"
        )
        self.args = (text,)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_refused, (self.code, self.message, self.root, self.step, self.rank))


FIXES: dict[str, str] = {
    "root_not_configured": (
        "save under a root the daemon serves (ckptd status lists them), or add this one "
        "to its configuration ([[roots]] path) and reload it"
    ),
    "path_escape": "give the root as the daemon's configuration names it (an absolute path)",
    "already_promoted": (
        "the step is a checkpoint already: resume from it (orchestrator.latest) and save "
        "later steps, or remove it first"
    ),
    "step_closed": "the step is being promoted from another save: wait for it, then resume",
    "step_failed": "the step's attempt failed: save it again from a new run, or a later step",
    "run_conflict": (
        "another run is saving this step: stop it, or wait until its ranks' leases expire "
        "(a restart of the same torchrun or Slurm launch takes the step over at once)"
    ),
    "stale_attempt": "the attempt is gone: save the step again",
    "world_size_mismatch": "every rank of a save must pass the same world_size",
    "rank_out_of_range": "rank must be below world_size",
    "node_conflict": "set LOCAL_WORLD_SIZE the same way on every node (torchrun does)",
    "too_busy": "too many saves in flight: save less often, or raise max_open_saves",
    "shutting_down": "the daemon is stopping: save again once it is back",
    "unavailable": "the daemon could not make the save durable: check its state directory",
}
"""What to do about each refusal, by its code (``SaveRefused.fix``)."""


def _refused(code: str, message: str, root: str, step: int, rank: int) -> SaveRefused:
    return SaveRefused(code, message, root=root, step=step, rank=rank)

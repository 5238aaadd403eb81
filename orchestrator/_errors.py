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
    """

    def __init__(self, code: str, message: str, *, root: str, step: int, rank: int) -> None:
        super().__init__(code, message)
        self.root = root
        self.step = step
        self.rank = rank
        text = (
            f"ckptd refused the begin of step {step} of {root} for rank {rank} "
            f"({code}: {message}); nothing of this save is written"
        )
        self.args = (text,)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_refused, (self.code, self.message, self.root, self.step, self.rank))


def _refused(code: str, message: str, root: str, step: int, rank: int) -> SaveRefused:
    return SaveRefused(code, message, root=root, step=step, rank=rank)

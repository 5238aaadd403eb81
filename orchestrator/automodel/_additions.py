"""What ckptd adds to NeMo-RL's Automodel checkpoint manager, beyond its reference API.

A mixin of :class:`~orchestrator.automodel.AutomodelCheckpointManager`: the mode the
manager chose, the files and metrics a rank adds to a step left open, sealing it, and
closing the manager before the process exits. The reference's save and load methods
are in ``_manager.py`` and ``_loading.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from ._promotion import StepTracker

if TYPE_CHECKING:
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer

__all__ = ["DaemonMixin"]


class DaemonMixin:
    """The manager's ckptd-only methods (a mixin: the manager sets both attributes).

    Attributes:
        checkpointer: The underlying nemo_automodel ``Checkpointer`` (None until
            ``init_checkpointer``).
    """

    checkpointer: Checkpointer | None
    _tracker: StepTracker | None

    if TYPE_CHECKING:

        def finalize_async_save(self) -> None:
            """Block until in-flight async writes have landed (the manager's)."""

    @property
    def uses_daemon(self) -> bool:
        """Whether saves are promoted by the daemon (else the caller renames, as before)."""
        return self._tracker is not None

    @property
    def step_dir(self) -> str | None:
        """Where the open step's files are written (``save_checkpoint(seal=False)``).

        ``ROOT/tmp_step_N`` on a filesystem root. On an ``s3://`` root, this rank's
        local stand-in for it: a file written here and named to :meth:`add_files` is
        uploaded with the rank's part of the step when it is sealed. None when no
        step is open or not using the daemon.
        """
        tracker = self._tracker
        if tracker is None or tracker.open is None:
            return None
        return tracker.open.location.tmp_dir

    def add_files(self, paths: Iterable[str]) -> None:
        """Report files this rank wrote into the open step (``save_checkpoint(seal=False)``).

        The daemon checks each exists with at least its current size before promoting.
        Call once the files are completely written, before :meth:`seal`. A directory
        reports every file under it. Without the daemon this does nothing.

        Args:
            paths: Absolute paths, or paths relative to the step's tmp directory
                (``"train_dataloader.pt"``); on an ``s3://`` root, files in
                :attr:`step_dir` (a URL in ``ROOT/tmp_step_N`` names its stand-in there).

        Raises:
            RuntimeError: no step is open on this rank.
            ValueError: a path is outside the step's tmp directory.
            FileNotFoundError: a file does not exist.
        """
        if self._tracker is not None:
            self._tracker.add_files(paths)

    def add_metrics(self, metrics: Mapping[str, float]) -> None:
        """Add metrics to the open step, with the daemon (``save_checkpoint(seal=False)``).

        For metrics known only after the save started (an evaluation run meanwhile);
        sent with the step's ``done`` when it is sealed.

        Raises:
            RuntimeError: no step is open, or not using the daemon.
            ValueError: a value is not a finite number.
        """
        tracker = self._tracker
        if tracker is None or tracker.open is None:
            raise RuntimeError(
                "no open step: call save_checkpoint(..., seal=False) before add_metrics()"
            )
        tracker.open.handle.add_metrics(metrics)

    def seal(self) -> None:
        """Declare this rank's part of the open step complete.

        The daemon is told once every tracked upload has landed, and promotes the step
        when every rank has sealed and reported. Does nothing if no step is open.
        """
        if self._tracker is not None:
            self._tracker.seal()

    def close(self) -> None:
        """Finish this rank's checkpointing before the process exits.

        Waits for in-flight uploads and their reports (:meth:`finalize_async_save`),
        tells the daemon that a step still open was abandoned (it is never promoted: the
        caller's files may be missing), waits for the daemon's acknowledgements (at most
        5 s) and closes the Checkpointer. A process that exits with uploads in flight
        loses them.
        """
        if self.checkpointer is None:
            return
        try:
            self.finalize_async_save()
        finally:
            if self._tracker is not None:
                self._tracker.abandon()
                self._tracker.finish(5.0)
            self.checkpointer.close()
            self.checkpointer = None

    # -- plumbing -------------------------------------------------------------------------

    def _complete_uploads(self) -> None:
        if self._tracker is not None:
            self._tracker.before_next_save()
        if self.checkpointer is not None:
            self.checkpointer.async_wait()

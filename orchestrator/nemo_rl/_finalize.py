"""Finishing a checkpoint: NeMo-RL's synchronous and background finalization.

``finalize_checkpoint`` does it at once; ``begin_finalization`` hands it to a thread and
returns, ``finalize_pending`` waits for that thread and raises what it raised,
``shutdown`` also waits for the pruning queued after it; the manager is a context
manager that shuts down on exit. What "finishing" is comes from the manager
(``_finalize_step``): waiting for the daemon's verdict, or NeMo-RL's own wait and rename.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

__all__ = ["Finalizer"]


class Finalizer:
    """NeMo-RL's finalization API, over the manager's ``_finalize_step``."""

    def __init__(self) -> None:
        self._finalize_thread: threading.Thread | None = None
        self._pending_checkpoint_path: Path | None = None
        self._finalize_error: Exception | None = None
        self._delete_executor = ThreadPoolExecutor(max_workers=1)

    # -- what the manager provides ----------------------------------------------------

    def _finalize_step(self, path: Path, wait_fn: Callable[[], None] | None) -> None:
        raise NotImplementedError

    def remove_old_checkpoints(self, exclude_latest: bool = True) -> None:
        """Prune (the manager's)."""
        raise NotImplementedError

    @staticmethod
    def _warn_on_delete_failure(future: Future[None]) -> None:
        raise NotImplementedError

    # -- NeMo-RL's API ------------------------------------------------------------------

    def finalize_checkpoint(self, checkpoint_path: Any) -> None:
        """Complete a checkpoint synchronously, then prune.

        Without the daemon: rename ``tmp_step_N`` to ``step_N`` (replacing an existing
        one). With it: wait until the daemon promoted the step.

        Args:
            checkpoint_path: ``tmp_step_N``, as :meth:`init_tmp_checkpoint` returned it.

        Raises:
            StepFailed: with the daemon, it failed the step (a ``RuntimeError``).
        """
        self._finalize_step(Path(checkpoint_path), None)
        self.remove_old_checkpoints()

    def begin_finalization(
        self, checkpoint_path: Any, wait_fn: Callable[[], None] | None = None
    ) -> None:
        """Finish a checkpoint in the background; returns at once.

        Waits first for a previous finalization still running. Every write into the
        step must be complete. Without the daemon, a thread calls ``wait_fn`` (until
        the workers' async writes have landed), renames, and queues the pruning. With
        it, the thread only waits for the daemon's verdict (the daemon tracks the
        workers' writes, so ``wait_fn`` is not called and the workers never block in
        it), then queues the pruning pass.

        Args:
            checkpoint_path: ``tmp_step_N``, as :meth:`init_tmp_checkpoint` returned it.
            wait_fn: Blocks until the workers' writes have landed (e.g.
                ``policy.finalize_async_save``); None to rename at once.

        Raises:
            RuntimeError: the previous finalization failed (see :meth:`finalize_pending`).
        """
        self.finalize_pending()
        path = Path(checkpoint_path)
        self._pending_checkpoint_path = path
        self._finalize_error = None

        def finalize() -> None:
            try:
                self._finalize_step(path, wait_fn)
                pruned = self._delete_executor.submit(self.remove_old_checkpoints)
                pruned.add_done_callback(self._warn_on_delete_failure)
            except Exception as exc:  # a thread boundary: finalize_pending raises it
                self._finalize_error = exc
            finally:
                self._pending_checkpoint_path = None

        self._finalize_thread = threading.Thread(target=finalize, name="nemo-rl-finalize")
        self._finalize_thread.daemon = True
        self._finalize_thread.start()

    def finalize_pending(self) -> None:
        """Block until the background finalization is done (not the pruning after it).

        A no-op when nothing is pending; safe to call again.

        Raises:
            RuntimeError: ``Background checkpoint finalization failed``, from what the
                thread raised (``wait_fn``'s error, the rename's, or the daemon's
                ``StepFailed``).
        """
        if self._finalize_thread is not None:
            self._finalize_thread.join()
            self._finalize_thread = None
        if self._finalize_error is not None:
            error, self._finalize_error = self._finalize_error, None
            raise RuntimeError("Background checkpoint finalization failed") from error

    def shutdown(self) -> None:
        """Block until the finalization and every queued pruning are done (at exit).

        Safe to call again; the manager stays usable.

        Raises:
            RuntimeError: as :meth:`finalize_pending`.
        """
        self.finalize_pending()
        self._delete_executor.shutdown(wait=True)
        self._delete_executor = ThreadPoolExecutor(max_workers=1)

    @property
    def has_pending_finalization(self) -> bool:
        """Whether a background finalization is in flight, or done but not yet collected.

        True from :meth:`begin_finalization` until :meth:`finalize_pending` (or
        :meth:`shutdown`) has collected its outcome, however fast the thread was.
        """
        return self._finalize_thread is not None

    def __enter__(self) -> Any:
        """The manager itself; leaving the block shuts it down."""
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> Literal[False]:
        """Shut down; never masks an exception already leaving the block.

        On a clean exit a finalization failure is raised; while another exception
        propagates, it is a warning instead. Returns False: exceptions propagate.
        """
        if exc_type is None:
            self.shutdown()
            return False
        try:
            self.shutdown()
        except Exception:  # the exception leaving the block is the one that matters
            warnings.warn(
                "Checkpoint finalization failed while handling an exception; "
                "the original exception will be re-raised.",
                stacklevel=2,
            )
        return False

"""transformers' just-in-time checkpoint on SIGTERM (``enable_jit_checkpoint``), through ckptd.

transformers' ``CheckpointManager.execute_jit_checkpoint`` creates
``output_dir/checkpoint-N`` and a ``checkpoint-is-incomplete.txt`` sentinel in it before
it calls ``_save_checkpoint``, and removes the sentinel afterwards. With the daemon that
directory would be a partial checkpoint in ``output_dir`` (``get_last_checkpoint`` does
not read the sentinel) and would stand in the promotion's way. :func:`take_over` gives
the trainer's JIT callback a manager that saves through ``_save_checkpoint`` alone: the
checkpoint is staged outside ``output_dir`` and appears there only once promoted, so no
sentinel is needed. SIGTERM's handling (the grace period, then stopping the loop) is
transformers' own.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

from transformers.trainer_jit_checkpoint import CheckpointManager, JITCheckpointCallback

__all__ = ["StagedJITManager", "take_over"]

logger = logging.getLogger("orchestrator.transformers")


class StagedJITManager(CheckpointManager):
    """transformers' JIT ``CheckpointManager`` whose checkpoint is staged and promoted."""

    def execute_jit_checkpoint(self) -> None:
        """Save the current step through the trainer's ``_save_checkpoint``, nothing else.

        Raises:
            Exception: what the save raises (transformers logs it and raises it too).
        """
        self.is_checkpoint_requested = False  # one checkpoint, whichever callback asks
        step = self.trainer.state.global_step
        logger.info("ckptd: JIT checkpoint of step %s, staged for the daemon", step)
        try:
            self.trainer._save_checkpoint(self.trainer.model, trial=None)
        except Exception:
            logger.exception("ckptd: the JIT checkpoint of step %s failed", step)
            raise


def take_over(trainer: Any) -> None:
    """Give the trainer's JIT callback, if it has an active one, a :class:`StagedJITManager`.

    The new manager takes over SIGTERM (in the main thread, as transformers' did) and
    keeps the handler transformers' manager replaced, which the callback restores when
    training ends.
    """
    for callback in trainer.callback_handler.callbacks:
        old = getattr(callback, "jit_manager", None)
        if not isinstance(callback, JITCheckpointCallback) or old is None:
            continue
        manager = StagedJITManager(trainer, kill_wait=old.kill_wait)
        manager._original_sigterm_handler = old._original_sigterm_handler
        signal.signal(signal.SIGTERM, manager._sigterm_handler)
        callback.jit_manager = manager

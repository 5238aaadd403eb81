"""Process-mode uploads that never block the caller, in the same order on every rank.

nemo_automodel's Checkpointer saves asynchronously with
``AsyncCheckpointerType.PROCESS``: every upload of the process goes to one background
process (``_async_process_executor._CHECKPOINT_PROCESS``) over one pipe, and that
process runs the DCP collectives on its own gloo group. Whatever gloo groups the
Checkpointer created for its model and optimizer contexts only carry the one-off
group-initialisation broadcast; the model and optimizer uploads share the background
process and its group, so they must reach it one at a time and in the same order on
every rank, or the ranks' DCP collectives pair a model save with an optimizer save.

nemo_automodel 0.7.0 (``_torch_backports.apply_async_checkpoint_patch``) serialises
them with one lock held for each whole upload, and also takes that lock in the caller's
thread on every ``dcp.async_save`` to see whether the process exists. The second
``async_save`` of a save (the optimizer's) therefore waits in the training thread until
the first (the model's) upload has finished: ``save_checkpoint`` blocks on the model
upload. Measured on two CPU ranks: ``save_optimizer`` returning after 1.0 s, exactly
when the model upload ended. The order between the two worker threads is also left to
whichever takes the lock first.

:func:`install_ordered_uploads` replaces ``execute_save`` of torch's
``_ProcessBasedAsyncCheckpointExecutor`` (process-wide, idempotent) with one that:

- creates the background process synchronously in the caller on first use, under the
  same creation lock (what nemo_automodel's patch is for);
- takes a ticket in the caller's thread, so uploads are numbered in call order, which
  is the same on every rank (model before optimizer in every ``save_checkpoint``);
- runs each upload on its worker thread only when every earlier ticket has finished,
  one at a time (the pipe carries one request and one reply at a time);
- returns at once: the caller never waits for another upload.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Final, TypeVar

__all__ = ["Turns", "install_ordered_uploads"]

logger = logging.getLogger("orchestrator.automodel")

_MARKER: Final = "_ckptd_ordered_uploads"
_install_lock = threading.Lock()

T = TypeVar("T")


class Turns:
    """Runs jobs one at a time, in the order their tickets were taken."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next_ticket = 0
        self._serving = 0
        self._finished: set[int] = set()

    def take(self) -> int:
        """A ticket: the job that takes it runs after every earlier ticket's job."""
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            return ticket

    def run(self, ticket: int, job: Callable[[], T]) -> T:
        """Wait for ``ticket``'s turn, run ``job``, then let the next ticket run."""
        with self._cond:
            self._cond.wait_for(lambda: self._serving == ticket)
        try:
            return job()
        finally:
            self.release(ticket)

    def release(self, ticket: int) -> None:
        """Mark ``ticket`` finished (also for a job that will never run)."""
        with self._cond:
            self._finished.add(ticket)
            while self._serving in self._finished:
                self._finished.discard(self._serving)
                self._serving += 1
            self._cond.notify_all()


def install_ordered_uploads() -> bool:
    """Make process-mode ``dcp.async_save`` calls ordered and non-blocking (see module).

    Returns:
        Whether the ordered dispatch is in place; False (with a warning) if this torch
        lacks the internals it replaces, in which case nothing is changed.
    """
    from torch.distributed.checkpoint import _async_process_executor as ape

    executor_cls = getattr(ape, "_ProcessBasedAsyncCheckpointExecutor", None)
    process_cls = getattr(ape, "_AsyncCheckpointProcess", None)
    init_info_cls = getattr(ape, "_ProcessGroupInitInfo", None)
    if executor_cls is None or process_cls is None or init_info_cls is None:
        logger.warning(
            "ckptd: this torch has no process-based DCP executor to order; the optimizer "
            "upload may wait for the model upload in the training thread"
        )
        return False
    with _install_lock:
        if getattr(executor_cls.execute_save, _MARKER, False):
            return True
        # torch's own upload body: nemo_automodel keeps it when it wraps it in its lock.
        upload: Callable[..., Any] = getattr(
            executor_cls, "_nemo_orig_execute_save_impl", executor_cls._execute_save_impl
        )
        create_lock = getattr(ape, "_NEMO_CREATE_LOCK", None) or threading.Lock()
        turns = Turns()

        def execute_save(
            self: Any,
            staging_future_or_state_dict: Any,
            *,
            process_group: Any = None,
            **kwargs: Any,
        ) -> Future[Any]:
            with create_lock:
                if ape._CHECKPOINT_PROCESS is None:
                    ape._CHECKPOINT_PROCESS = process_cls(pg_init_info=init_info_cls(process_group))
                ticket = turns.take()

            def job() -> Any:
                return upload(
                    pg_init_info=None,
                    staging_future_or_state_dict=staging_future_or_state_dict,
                    process_group=process_group,
                    **kwargs,
                )

            try:
                future: Future[Any] = self._executor.submit(turns.run, ticket, job)
            except BaseException:
                turns.release(ticket)
                raise
            future.add_done_callback(lambda _f: self._executor.shutdown(wait=False))
            return future

        setattr(execute_save, _MARKER, True)
        executor_cls.execute_save = execute_save
    return True

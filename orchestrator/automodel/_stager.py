"""Async staging that works on a host without an accelerator.

With ``is_async=True`` nemo_automodel 0.7.0's ``Checkpointer`` builds
``DefaultStager()`` with torch's default ``StagingOptions`` in its constructor, and again
in ``_do_save`` after ``async_wait`` has released the previous one. Those defaults ask
for pinned memory and non-blocking device copies, and ``DefaultStager.__init__`` raises
``AssertionError: Non-blocking copy requires that the current accelerator is available``
on a CPU-only host: async checkpointing cannot even be configured there.

:func:`install_cpu_safe_stager` replaces the name ``DefaultStager`` inside
``nemo_automodel.components.checkpoint.checkpointing`` with a factory that, when called
without options on a host with no accelerator, builds the real ``DefaultStager`` with
:func:`cpu_staging_options` instead; explicit options are passed through unchanged. On a
host with an accelerator nothing is installed, so no call that could succeed before
behaves differently after. It is process-wide and idempotent.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Final

import torch
from torch.distributed.checkpoint.staging import StagingOptions

__all__ = [
    "accelerator_available",
    "cpu_staging_options",
    "install_cpu_safe_stager",
    "use_prefix_store",
]

_MARKER: Final = "_ckptd_cpu_safe_stager"
_lock = threading.Lock()


def accelerator_available() -> bool:
    """Whether torch sees an accelerator (CUDA, XPU, MPS, ...) on this host."""
    return bool(torch.accelerator.is_available())


def cpu_staging_options() -> StagingOptions:
    """Staging options that work without an accelerator, for process-based uploads.

    - ``use_pinned_memory=False``: pinning needs an accelerator runtime.
    - ``use_shared_memory=True``: the staged copy lives in shared memory, so the upload
      process Automodel uses (``AsyncCheckpointerType.PROCESS``) maps it instead of
      receiving every tensor pickled through a pipe.
    - ``use_async_staging=True``: the copy runs on the stager's thread; the save returns
      a ``staging_completion`` future that ``Checkpointer.maybe_wait_for_staging`` waits on.
    - ``use_non_blocking_copy=False``: non-blocking copies need an accelerator stream.
    """
    return StagingOptions(
        use_pinned_memory=False,
        use_shared_memory=True,
        use_async_staging=True,
        use_non_blocking_copy=False,
    )


def install_cpu_safe_stager() -> bool:
    """Let nemo_automodel's Checkpointer build its async stagers on a CPU-only host.

    Returns:
        Whether the CPU-safe factory is in place (False on a host with an accelerator,
        where nothing is changed).
    """
    if accelerator_available():
        return False
    import nemo_automodel.components.checkpoint.checkpointing as am_checkpointing

    with _lock:
        current = am_checkpointing.DefaultStager
        if getattr(current, _MARKER, False):
            return True

        def cpu_safe_default_stager(config: StagingOptions | None = None) -> Any:
            # Automodel only ever calls DefaultStager(); explicit options pass through.
            return current(cpu_staging_options() if config is None else config)

        setattr(cpu_safe_default_stager, _MARKER, True)
        am_checkpointing.DefaultStager = cpu_safe_default_stager
    return True


def use_prefix_store() -> None:
    """Let DCP's upload processes join the job's TCPStore instead of binding a new port.

    With ``AsyncCheckpointerType.PROCESS``, rank 0 otherwise probes a free port and every
    rank's upload process binds to it later; another process can take the port in
    between (EADDRINUSE on the first save). ``DCP_USE_PREFIX_STORE=1`` makes them use the
    store at ``MASTER_ADDR:MASTER_PORT`` under a prefix. torch asserts both variables are
    set, so it is only turned on when they are, and never overrides an explicit value.
    """
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        os.environ.setdefault("DCP_USE_PREFIX_STORE", "1")

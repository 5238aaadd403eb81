"""The end of a training script: saves in flight outlive ``destroy_process_group`` and exit.

Training scripts commonly end in one of three ways after their last save: they call
``dist.destroy_process_group()`` at once, they simply return (the interpreter exits), or
they close ckptd's client (or a :class:`~orchestrator.CheckpointManager`) first. Only
the last was safe: DCP's upload of the last step still runs collectives on its gloo
group, and ``destroy_process_group()`` unregisters every group under it (the upload
fails, "Group ... is not registered"); and at a plain exit the client's reports, sent
by a daemon thread, may never leave the process.

So, once a client of this process has begun a save:

- ``torch.distributed.destroy_process_group`` is wrapped (once, process-wide): before
  the groups go, it waits for the uploads ``orchestrator.async_save`` and
  ``orchestrator.save`` started and for the saves every client was given (sealed
  handles), then for the daemon to acknowledge their reports. If they are still running
  after :data:`EXIT_TIMEOUT` seconds (``CKPTD_EXIT_TIMEOUT``), it raises before
  destroying anything, saying what to call first. The wrapper passes every argument on,
  and ``destroy_process_group(group)`` of another group than the checkpoint groups does
  not wait.
- At interpreter exit (``atexit``, which runs after DCP's upload threads were joined)
  every client that began a save and was not closed is closed: its last reports are
  sent and acknowledged.

Call ``dist.destroy_process_group`` through the module (``dist.destroy_process_group()``)
or import it after ``orchestrator``: a reference taken earlier is torch's own function.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import threading
import time
import weakref
from concurrent.futures import Future, wait
from typing import Any, Final, Protocol

__all__ = ["EXIT_TIMEOUT", "watch"]

log = logging.getLogger("orchestrator")

EXIT_TIMEOUT: Final = 600.0
"""Default seconds ``destroy_process_group`` waits for uploads in flight."""
_REPORT_TIMEOUT: Final = 5.0

_lock = threading.Lock()
_clients: weakref.WeakSet[_Closable] = weakref.WeakSet()
_atexit_registered = False
_guarded = False


class _Closable(Protocol):
    """What this module needs of a client (``CheckpointClient``)."""

    _closed: bool

    def wait_saves(self, timeout: float | None = None) -> bool: ...

    def flush(self, timeout: float = 5.0) -> bool: ...

    def close(self, timeout: float | None = ..., *, report_timeout: float = ...) -> None: ...


def watch(client: _Closable) -> None:
    """Remember ``client`` (it began a save) for the end of the script; never raises.

    Cheap after the first call: a set insertion. Wraps ``destroy_process_group`` if
    ``torch.distributed`` is loaded (a save needs it; this module never imports torch).
    """
    global _atexit_registered
    if client not in _clients:
        with _lock:
            _clients.add(client)
            if not _atexit_registered:
                _atexit_registered = True
                atexit.register(_at_exit)
    if not _guarded:
        _guard_destroy()


def _timeout() -> float:
    raw = os.environ.get("CKPTD_EXIT_TIMEOUT", "")
    try:
        value = float(raw) if raw else EXIT_TIMEOUT
    except ValueError:
        log.warning("ckptd: CKPTD_EXIT_TIMEOUT=%r is not a number; using %s", raw, EXIT_TIMEOUT)
        return EXIT_TIMEOUT
    return max(0.0, value)


def _guard_destroy() -> None:
    global _guarded
    dist = sys.modules.get("torch.distributed")
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if dist is None or c10d is None:
        return
    with _lock:
        if _guarded:
            return
        _guarded = True
        original = c10d.destroy_process_group
        if getattr(original, "__ckptd_guarded__", False):
            return

        @functools.wraps(original)
        def destroy_process_group(group: Any = None, *args: Any, **kwargs: Any) -> Any:
            checkpoint_groups = _checkpoint_groups()
            if group is None or any(group is g for g in checkpoint_groups):
                _finish_saves(_timeout())
            result = original(group, *args, **kwargs)
            if group is None:
                _forget_groups()  # unregistered now: a new world creates its own
            return result

        destroy_process_group.__ckptd_guarded__ = True  # type: ignore[attr-defined]
        # torch's own function, replaced where trainers call it (module attributes).
        setattr(c10d, "destroy_process_group", destroy_process_group)  # noqa: B010
        if getattr(dist, "destroy_process_group", None) is original:
            setattr(dist, "destroy_process_group", destroy_process_group)  # noqa: B010


def _dcp_state() -> Any:
    # Only if async_save or save was used: then _dcp is loaded (it imports torch).
    return sys.modules.get(f"{__package__}._dcp")


def _checkpoint_groups() -> list[Any]:
    dcp = _dcp_state()
    if dcp is None:
        return []
    with dcp._lock:
        return list(dcp._groups.values())


def _forget_groups() -> None:
    dcp = _dcp_state()
    if dcp is not None:
        with dcp._lock:
            dcp._groups.clear()
            dcp._inflight.clear()


def _uploads() -> list[Future[Any]]:
    dcp = _dcp_state()
    if dcp is None:
        return []
    with dcp._lock:
        return [f for f in dcp._inflight.values() if not f.done()]


def _finish_saves(timeout: float) -> None:
    """Wait for every upload and sealed save, then for their reports; raise if too slow.

    Raises:
        RuntimeError: uploads still in flight after ``timeout`` seconds; nothing was
            destroyed.
    """
    deadline = time.monotonic() + timeout
    uploads = _uploads()
    if uploads:
        log.info("ckptd: waiting for %d checkpoint upload(s) before the group goes", len(uploads))
    _, running = wait(uploads, timeout=timeout)
    with _lock:
        clients = [c for c in _clients if not c._closed]
    late = len(running)
    for client in clients:
        # False for a save never sealed too (it cannot finish; wait_saves says which).
        if not client.wait_saves(max(0.0, deadline - time.monotonic())):
            late += time.monotonic() >= deadline
    if late:
        raise RuntimeError(
            f"ckptd: checkpoint saves still in flight after {timeout:g}s; the process group "
            "was not destroyed (it would fail them). Wait for them first: "
            "manager.wait_until_finished() or client.close(); CKPTD_EXIT_TIMEOUT sets "
            "this wait"
        )
    for client in clients:
        if not client.flush(_REPORT_TIMEOUT):
            log.warning(
                "ckptd: the daemon did not acknowledge the last reports within %ss",
                _REPORT_TIMEOUT,
            )


def _at_exit() -> None:
    with _lock:
        clients = [c for c in _clients if not c._closed]
    for client in clients:
        try:
            client.close(_timeout(), report_timeout=_REPORT_TIMEOUT)
        except Exception as exc:  # at exit: one client's trouble must not stop the others
            log.warning("ckptd: closing the client at exit failed: %s", exc)

"""The trainer-side connection to the node's ckptd daemon: the public client.

A save is begun through a :class:`SaveHandle` that its futures are added to and that is
then sealed; the client keeps every handle until its save reported ``done`` or ``fail``,
so that :meth:`CheckpointClient.wait_saves` and :meth:`CheckpointClient.close` can wait
for the uploads still in flight. The step's directory exists when
:meth:`CheckpointClient.save` returns (``_layout.py``). The ops themselves, and what each
costs the training thread, are in ``_ops.py``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Final

from . import _exit
from . import protocol as p
from ._layout import make_step_dir
from ._objstore import is_object_url
from ._ops import OpsClient
from ._pending import PendingBegin
from ._strict import absolute_root, remove_made
from ._tracking import SaveHandle

__all__ = ["CheckpointClient"]

log = logging.getLogger("orchestrator")

_CLOSE_TIMEOUT: Final = 600.0
_REPORT_TIMEOUT: Final = 5.0


class CheckpointClient(OpsClient):
    """Connection from one training process to its node's daemon.

    Thread-safe. Create one per process and share it. Nothing here blocks the caller for
    longer than ``begin_timeout``; if the daemon is down, calls return at once, the client
    logs one warning, keeps trying to reconnect in the background, and re-sends every
    save it was told about once the daemon is back.

    Args:
        socket_path: The daemon's socket; default :func:`default_socket_path`.
        begin_timeout: Longest wait for a ``begin`` acknowledgement, in seconds.
        reconnect_max: Longest pause between reconnection attempts, in seconds.
        max_reply: Longest reply line accepted, in bytes (default
            :data:`~orchestrator.protocol.MAX_REPLY`). A longer reply fails only the call
            it answers, with :class:`DaemonError` ``reply_too_long``.
        run: The run of the job this process belongs to, the same on every rank of
            the run and another on a restarted or requeued run. Default: from
            torchelastic's or Slurm's environment (``orchestrator._run``), else unnamed.
        strict: Make mistakes loud: a ``begin`` the daemon refuses raises
            :class:`~orchestrator.SaveRefused` in the trainer (from :meth:`save` and
            :meth:`begin` when they wait for the answer, else from the next
            :meth:`save`, :meth:`track`, :meth:`wait_saves` or :meth:`close`) instead of
            a logged warning. Default: ``CKPTD_STRICT=1`` in the environment, else off.

    A relative ``root`` is made absolute (against the current directory) before it is
    sent, and a save the daemon refuses leaves no directory behind.

    The environment that says how many ranks are on this node (``LOCAL_WORLD_SIZE``,
    ``SLURM_NTASKS_PER_NODE``; see :meth:`begin_nowait`) and which run this is are
    read here, once.

    Raises:
        ValueError: ``run`` is not 1 to 128 letters, digits, ``.``, ``_``, ``:`` or ``-``.
    """

    def __init__(
        self,
        socket_path: str | None = None,
        *,
        begin_timeout: float = 2.0,
        reconnect_max: float = 2.0,
        max_reply: int = p.MAX_REPLY,
        run: str | None = None,
        strict: bool | None = None,
    ) -> None:
        self._lock = threading.Lock()  # guards _handles (touched from callers' threads)
        self._handles: set[SaveHandle] = set()
        self._closed = False
        super().__init__(
            socket_path,
            begin_timeout=begin_timeout,
            reconnect_max=reconnect_max,
            max_reply=max_reply,
            run=run,
            strict=strict,
        )

    # -- saves: handles over the uploads' futures --------------------------------------

    def save(
        self,
        root: str,
        step: int,
        rank: int,
        world_size: int,
        *,
        wait: bool = True,
        local_world_size: int | None = None,
    ) -> SaveHandle:
        """Begin a save and return the handle its futures are added to.

        Call this before the save starts writing; add each future with
        :meth:`SaveHandle.add`, then :meth:`SaveHandle.seal`. The directory
        :attr:`SaveHandle.path` names exists when this returns, daemon or no daemon
        (unless the daemon refused the save and ``wait`` is True: nothing of a refused
        save is created). The client names it without the daemon when it can (a layout
        learned from an earlier ``begin`` of the root, or the root's layout file);
        otherwise the first save of a root waits for the acknowledgement to learn it,
        as long as the daemon is reachable.

        Args:
            root: The checkpoint root.
            step: The step.
            rank: This rank.
            world_size: Number of ranks writing the step, over all nodes.
            wait: Wait for the daemon's acknowledgement before returning. With False,
                the caller overlaps the wait with its own work and gates its writes on
                it (``orchestrator.AfterBeginPlanner(handle)``).
            local_world_size: How many of the step's ranks write on this node; default
                from the environment (see :meth:`begin_nowait`).

        Returns:
            The handle, not yet sealed.

        Raises:
            ValueError: ``local_world_size``, or the environment it is read from, does
                not fit ``world_size``; nothing is sent and nothing is created.
            SaveRefused: ``strict``, and the daemon refused this save (``wait``) or an
                earlier one after its call returned.
        """
        handle, pending = self._open(root, step, rank, world_size, local_world_size)
        if wait:
            pending.result()
            self._refusals.raise_for(handle)
        if is_object_url(root):
            return handle  # no directories there; the attempt's prefix is the reply's
        path = pending.path  # waits only for a root whose layout is unknown (see above)
        answer = pending.known()
        if answer is None or answer.error is None:  # nothing of a known refusal is made
            made = make_step_dir(path)
            if made:  # a refusal still to come takes them away again
                pending.when_refused(lambda: remove_made(made))
        return handle

    def _open(
        self, root: str, step: int, rank: int, world_size: int, local_world_size: int | None
    ) -> tuple[SaveHandle, PendingBegin]:
        self._refusals.raise_late()
        root = absolute_root(root)
        pending = self.begin_nowait(root, step, rank, world_size, local_world_size=local_world_size)
        handle = SaveHandle(root, step, rank, pending, self._forget)
        self._refusals.watch(handle, pending.when_refused)
        _exit.watch(self)  # the end of the script must not lose it (``_exit.py``)
        with self._lock:
            self._handles.add(handle)
        if handle.wait_local(0):  # refused before it was added: already forgotten
            self._forget(handle)
        return handle, pending

    def _forget(self, handle: SaveHandle) -> None:
        with self._lock:
            self._handles.discard(handle)

    def wait_saves(self, timeout: float | None = None) -> bool:
        """Block until every sealed save of this client has reported done or fail.

        What a trainer calls before it exits (``close`` does it too): a process that
        exits with uploads in flight loses them, and the daemon fails the step once the
        rank's lease runs out. A save that is not sealed cannot finish, so it is not
        waited for: it makes the result False, with a warning.

        Args:
            timeout: Longest wait in seconds; None waits as long as the uploads take.

        Returns:
            Whether every save was reported in time.

        Raises:
            SaveRefused: ``strict``, and the daemon refused a save after its call returned.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            pending = list(self._handles)
        unsealed = [h for h in pending if not h.sealed]
        for handle in pending:
            if handle.sealed:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not handle.wait_local(left):
                    return False
        unsealed = [h for h in unsealed if not h.wait_local(0)]
        for handle in unsealed:
            log.warning(
                "ckptd: step %s of %s was never sealed; nothing waits for it",
                handle.step,
                handle.root,
            )
        self._refusals.raise_late()
        return not unsealed

    def track(
        self,
        root: str,
        step: int,
        rank: int,
        world_size: int,
        futures: Any,
        *,
        dcp_dir: str | None = None,
        group_rank: int | None = None,
        handle: SaveHandle | None = None,
        local_world_size: int | None = None,
    ) -> SaveHandle:
        """Track every future of one rank's save of a step, and seal it.

        The save call the futures came from has returned, so only a gate set up before
        it can keep its writes behind the ``begin``: begin the handle first, gate the
        save on it and pass it here::

            handle = client.save(root, step, rank, world_size, wait=False)
            future = dcp.async_save(sd, checkpoint_id=handle.path,
                                    planner=orchestrator.AfterBeginPlanner(handle))
            client.track(root, step, rank, world_size, future, handle=handle)

        A refused ``begin`` then fails the DCP save on every rank before any write.
        Without ``handle``, the ``begin`` is sent now, not awaited: the save's writes
        are already under way and nothing can stop them; a refusal is logged when it
        arrives, and the save reports neither ``done`` nor ``fail``.

        Args:
            root: The checkpoint root.
            step: The step.
            rank: This rank.
            world_size: Number of ranks writing the step, over all nodes.
            futures: A future, an ``AsyncSaveResponse``, or a list of them; ``done`` is
                sent once all of them succeeded, ``fail`` as soon as one fails.
            dcp_dir: DCP directory of the futures, relative to the tmp dir, to report
                the shard files from the save's metadata.
            group_rank: This rank in the checkpoint process group (default ``rank``).
            handle: The save's handle, begun before the save call (see above).
            local_world_size: How many of the step's ranks write on this node; default
                from the environment (see :meth:`begin_nowait`). With ``handle``, its
                ``begin`` already said it: an explicit value must be the same.

        Returns:
            The sealed handle.

        Raises:
            ValueError: ``handle`` is for another root, step or rank, or was begun with
                another ``local_world_size``; or ``local_world_size`` (or the
                environment it is read from) does not fit ``world_size``.
        """
        root = absolute_root(root)
        if handle is None:
            handle, _ = self._open(root, step, rank, world_size, local_world_size)
        elif (handle.root, handle.step, handle.rank) != (root, step, rank):
            raise ValueError(
                f"track({root!r}, {step}, {rank}) was given the handle of step "
                f"{handle.step} of {handle.root!r}, rank {handle.rank}"
            )
        elif local_world_size is not None:
            local = self.resolve_local_world_size(world_size, local_world_size)
            if local != handle.local_world_size:
                raise ValueError(
                    f"track(..., local_world_size={local}) was given the handle of a save "
                    f"begun with local_world_size={handle.local_world_size}"
                )
        for future in futures if isinstance(futures, list | tuple) else [futures]:
            handle.add(future, dcp_dir=dcp_dir, group_rank=group_rank)
        handle.seal()
        return handle

    # -- lifecycle ---------------------------------------------------------------------

    def close(
        self, timeout: float | None = _CLOSE_TIMEOUT, *, report_timeout: float = _REPORT_TIMEOUT
    ) -> None:
        """Finish reporting, then close the connection and stop the background threads.

        A save never sealed cannot finish: it is reported failed at once, with a
        warning. Sealed saves still uploading are waited for (see :meth:`wait_saves`)
        up to ``timeout``; those still in flight then are reported failed (nothing
        could report them later), with a warning. Then the client waits for the daemon's
        acknowledgements, reconnecting if it must, up to ``report_timeout``. Every wait
        is bounded unless ``timeout`` is None.

        Args:
            timeout: Longest wait for in-flight uploads, in seconds (default 600); None
                waits as long as they take.
            report_timeout: Longest wait for the daemon to acknowledge what was sent, in
                seconds (default 5): a daemon that restarted just before this process
                exits still gets the last reports, and one that is down costs this much.

        Raises:
            SaveRefused: ``strict``, and the daemon refused a save after its call
                returned (raised once everything above is done).
        """
        if self._closed:
            return
        self._closed = True
        with self._lock:
            handles = list(self._handles)
        for handle in handles:
            if not handle.sealed:
                log.warning(
                    "ckptd: step %s of %s was never sealed; reporting it failed",
                    handle.step,
                    handle.root,
                )
                handle.fail(f"the client was closed before step {handle.step} was sealed")
        if not self.wait_saves(timeout):
            with self._lock:
                handles = list(self._handles)
            for handle in handles:
                log.warning(
                    "ckptd: closing with the upload of step %s of %s still in flight after "
                    "%ss; reporting it failed",
                    handle.step,
                    handle.root,
                    timeout,
                )
                handle.fail(
                    f"the client was closed with the upload of step {handle.step} still in "
                    f"flight after {timeout}s"
                )
        # Also while reconnecting: a daemon that restarted just before this process
        # exits still gets the last reports (and a daemon that is down costs the wait).
        self.flush(report_timeout)
        self._channel.close()
        self._refusals.raise_late()

    def __enter__(self) -> CheckpointClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

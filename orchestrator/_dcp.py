"""``async_save``: ``torch.distributed.checkpoint.async_save`` tracked by the daemon."""

from __future__ import annotations

import copyreg
import logging
import os
import threading
from concurrent.futures import Future, wait
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save

from ._client import CheckpointClient
from ._errors import SaveRefused
from ._objstore import attempt_writer, is_object_url, storage_writer
from ._tracking import SaveHandle, describe
from .protocol import ErrorInfo

__all__ = ["AfterBeginPlanner", "async_save", "checkpoint_group", "default_client"]

log = logging.getLogger("orchestrator")

_lock = threading.Lock()
_client: CheckpointClient | None = None
_groups: dict[str, Any] = {}
_inflight: dict[str, Future[Any]] = {}


def default_client() -> CheckpointClient:
    """The process-wide client, connected to ``$CKPTD_SOCKET`` (created on first use)."""
    global _client
    with _lock:
        if _client is None:
            _client = CheckpointClient()
        return _client


def checkpoint_group(name: str = "") -> Any:
    """A gloo process group over all ranks, used only for checkpoint traffic.

    DCP's collectives on the training group deadlock against training's own, and two
    uploads in flight on one group interleave their collectives; so each DCP directory
    name (``"model"``, ``"optim"``) gets its own group. Created on first use, which (like
    every group creation) must happen on every rank in the same order.

    Args:
        name: The DCP directory the group carries.
    """
    with _lock:
        if name not in _groups:
            _groups[name] = dist.new_group(backend="gloo")
        return _groups[name]


def async_save(
    state_dict: dict[str, Any],
    *,
    root: str,
    step: int,
    subdir: str = "",
    client: CheckpointClient | None = None,
    handle: SaveHandle | None = None,
    process_group: Any = None,
    local_world_size: int | None = None,
    **kwargs: Any,
) -> Any:
    """Start ``dcp.async_save`` of ``state_dict`` into step ``step`` and let ckptd promote it.

    Calls ``dcp.async_save`` on a separate gloo group and sends ``begin`` to the daemon.
    The training thread does not wait for the daemon: DCP's upload thread does, before
    it creates the directory or writes a byte (:class:`AfterBeginPlanner`), so the
    daemon has journaled the save before anything of it lands. Once the client can name
    the step's directory without the daemon (from an earlier acknowledged ``begin`` of
    the root, or the root's layout file), ``begin`` is sent after DCP's call returns, so
    nothing of the client or the daemon runs during the call; before that, the first
    save of a root waits for the acknowledgement to learn where the root's steps go.
    ``done`` with this rank's shard files (or ``fail``) is reported when the upload
    completes; the training thread never waits for the upload. All ranks of the group
    must call it.

    The directory of the step (``handle.path``) exists when this returns, daemon or no
    daemon. If the daemon *refuses* the ``begin`` (the step is already promoted, being
    verified, failed, or of another attempt), the save writes nothing: its planner
    raises :class:`SaveRefused` when DCP sets it up, DCP's plan then fails on every rank,
    and the returned future fails with a ``CheckpointException`` (the handle reports
    neither ``done`` nor ``fail``; :attr:`SaveHandle.refusal` says why). If the daemon is
    merely unreachable or slow (no answer within ``begin_timeout``), the save goes on,
    unpromoted unless the daemon acknowledges it later.

    A strict client (``CKPTD_STRICT=1``, or ``CheckpointClient(strict=True)``) raises
    the refusal in the trainer: this call then waits for the ``begin``'s answer once
    DCP's call returned (at most ``begin_timeout``; not at all while the daemon is
    unreachable) and raises :class:`SaveRefused`. A refused save leaves no directory
    behind, strict or not. A relative ``root`` is taken from the current directory.

    A step written by several calls (model and optimizer in their own DCP directories)
    must share one handle, or the daemon could promote the step after the first part
    (``client.save`` waits for the acknowledgement; ``wait=False`` leaves that to the
    upload threads here too)::

        handle = client.save(root, step, rank, world_size)
        async_save(model_sd, root=root, step=step, subdir="model", handle=handle)
        async_save(optim_sd, root=root, step=step, subdir="optim", handle=handle)
        handle.seal()  # done is sent once both uploads have landed

    Args:
        state_dict: What to save, as for ``dcp.async_save``.
        root: The checkpoint root the daemon is configured with: a directory, or
            ``s3://BUCKET/PREFIX`` (each rank then uploads its shards straight to the
            store through DCP's ``FsspecWriter``, under the prefix of the attempt the
            daemon's ``begin`` reply names; DCP's upload thread waits for that reply,
            at most the client's ``begin_timeout``, not the training thread).
        step: The step; written into ``ROOT/tmp_step_{step}/{subdir}`` (on an object
            store, ``ROOT/step_{step}/ATTEMPT/{subdir}``).
        subdir: DCP directory inside the step (e.g. ``"model"``); default the step dir.
        client: The daemon client; default :func:`default_client`.
        handle: The step's :class:`SaveHandle` when it is written in several parts; the
            caller then seals it. Default: begin a handle and seal it after this part.
        process_group: Group for DCP's collectives; default :func:`checkpoint_group`.
        local_world_size: How many of the job's ranks are on this node; default
            torchrun's ``LOCAL_WORLD_SIZE``, else Slurm's ``SLURM_NTASKS_PER_NODE``
            (see :meth:`CheckpointClient.begin_nowait`). With ``handle``, the handle's
            ``begin`` already said it: an explicit value must be the same.
        **kwargs: Passed to ``dcp.async_save`` (``async_stager``,
            ``async_checkpointer_type``, ``storage_writer``, ``use_collectives``, ...).
            DCP points a ``storage_writer`` at the step's directory, but a consolidating
            ``HuggingFaceStorageWriter`` keeps writing its consolidated files where it
            was built: build it on ``handle.path``.

    Returns:
        What ``dcp.async_save`` returned (a future or an ``AsyncSaveResponse``).

    Raises:
        ValueError: ``local_world_size`` (or the environment it is read from) does not
            fit the world size, or differs from ``handle``'s; raised before anything is
            sent or written.
        SaveRefused: the client is strict and the daemon refused this save (or an
            earlier one, after its call returned).
        BaseException: whatever ``dcp.async_save`` raises while starting; the daemon is
            told the save failed first.
    """
    client = client or default_client()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # Checked before anything starts: a bad count found after DCP's call would leave
    # its upload waiting for a begin that is never sent.
    local = client.resolve_local_world_size(world_size, local_world_size)
    if handle is not None and local_world_size is not None and local != handle.local_world_size:
        raise ValueError(
            f"async_save(local_world_size={local}) was given the handle of a save begun "
            f"with local_world_size={handle.local_world_size}"
        )
    group = checkpoint_group(subdir) if process_group is None else process_group
    previous = _inflight.get(subdir)
    if previous is not None and not previous.done():
        # Backpressure: the last upload of this directory is still running on the same
        # group. Waiting is the only safe order (as torchtitan and NeMo-RL do).
        log.warning("ckptd: previous %r upload still running; waiting for it", subdir or ".")
        _wait_quietly(previous)
    # The upload waits for the begin's acknowledgement, not the training thread: a
    # planner that waits first keeps every write after it (in an upload process, it
    # waits as DCP pickles it on its way there). A caller's own planner gets the plain
    # order: the training thread waits, then saves.
    process = kwargs.get("async_checkpointer_type") == AsyncCheckpointerType.PROCESS
    planner = AfterBeginPlanner(handle) if "planner" not in kwargs else None
    if planner is not None:
        kwargs["planner"] = planner
    seal = handle is None
    # Where the step goes is known once the client can name it without the daemon; the
    # begin is then sent after DCP's call, so that neither the client's threads nor the
    # daemon compete with the call for the CPU and the GIL.
    path = client.step_path(root, step) if handle is None and planner is not None else None
    if handle is None and path is None:
        handle = client.save(
            root, step, rank, world_size, wait=planner is None, local_world_size=local
        )
        if planner is not None:
            planner.bind(handle)
    if planner is None:
        assert handle is not None
        client.raise_if_refused(handle)  # strict: nothing is written, nothing runs
        refusal = handle.refusal  # the training thread waits here (bounded)
        if refusal is not None:
            # Nothing may be written: DCP's plan fails on every rank instead.
            kwargs["planner"] = _RefusedPlanner(_refused(handle, refusal))
    checkpoint_id: str | None
    lazy = planner is not None and not process and "storage_writer" not in kwargs
    if is_object_url(root) and lazy and handle is not None:
        # Straight to the store, under the attempt's own prefix, which the begin's reply
        # names: the upload thread learns it, the training thread does not wait for it.
        begun = handle
        kwargs["storage_writer"] = attempt_writer(
            root, lambda: f"{begun.path}/{subdir}" if subdir else begun.path
        )
        checkpoint_id = None
    else:
        base = handle.path if handle is not None else path
        assert base is not None
        checkpoint_id = os.path.join(base, subdir) if subdir else base
        if is_object_url(checkpoint_id) and "storage_writer" not in kwargs:
            kwargs["storage_writer"] = storage_writer(checkpoint_id)
    try:
        result = dcp_async_save(
            state_dict, checkpoint_id=checkpoint_id, process_group=group, **kwargs
        )
    except BaseException as exc:  # CheckpointException derives from BaseException
        if handle is not None:
            handle.fail(f"async_save raised {describe(exc)}")
        elif planner is not None:
            planner.bind(None)  # never begun: an upload DCP started must not write
        raise
    if handle is None:
        # creates the dir
        handle = client.save(root, step, rank, world_size, wait=False, local_world_size=local)
        if planner is not None:
            planner.bind(handle)
    _inflight[subdir] = _upload_future(result)
    handle.add(result, dcp_dir=subdir or ".", group_rank=dist.get_rank(group))
    if seal:
        handle.seal()
    # Strict: the refusal raises here, once DCP's call returned (its planner stops the
    # upload before any write); the wait overlaps DCP's own start.
    client.raise_if_refused(handle)
    return result


class AfterBeginPlanner(DefaultSavePlanner):
    """DCP's default save planner, waiting first for the step's ``begin`` acknowledgement.

    DCP sets the planner up on the upload thread before it creates the directory or
    writes anything, so no byte of the save lands before the daemon has recorded it
    (and, for a retried step, moved the failed attempt's files aside). If the daemon
    refused the ``begin``, setting up raises :class:`SaveRefused`: DCP's plan is a
    collective, so the save fails on every rank before any of them writes. If the
    daemon does not answer within the client's ``begin_timeout``, the save goes on.

    For a save started with ``dcp.async_save`` (or ``dcp.save``) directly, begin the
    handle first and pass both to :meth:`CheckpointClient.track`::

        handle = client.save(root, step, rank, world_size, wait=False)
        future = dcp.async_save(sd, checkpoint_id=handle.path,
                                planner=AfterBeginPlanner(handle))
        client.track(root, step, rank, world_size, future, dcp_dir=".", handle=handle)

    With ``async_checkpointer_type=AsyncCheckpointerType.PROCESS`` DCP pickles the
    planner into its upload process; it does so on its executor's thread, after staging
    and before the process receives the save. The planner waits for the
    acknowledgement there, as it is pickled, and what crosses is a plain
    ``DefaultSavePlanner`` with its settings (or one whose setting up raises, if the
    daemon refused). So in either mode no byte lands before the ``begin`` is
    acknowledged, and the training thread never waits. Copying the planner
    (``copy.deepcopy``) waits and copies the same way.

    Args:
        handle: The save whose ``begin`` must be acknowledged first; None to name it
            later with :meth:`bind` (the upload waits for that too).
    """

    def __init__(self, handle: SaveHandle | None = None) -> None:
        super().__init__()
        self._handle = handle
        self._bound = threading.Event()
        if handle is not None:
            self._bound.set()

    def bind(self, handle: SaveHandle | None) -> None:
        """Name the save to wait for; None: the save never began, and must not write."""
        self._handle = handle
        self._bound.set()

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """Wait for the acknowledgement (bounded by the client), then set up as DCP does.

        Raises:
            SaveRefused: the daemon refused the save's ``begin``.
            RuntimeError: the save was never begun (its save call failed).
        """
        error = self._gate()
        if error is not None:
            raise error
        super().set_up_planner(state_dict, storage_meta, is_coordinator)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as the planner the upload process may run, once the gate opened.

        DCP's process writer pickles the planner on the trainer's side of the process
        boundary, on its executor's thread: waiting here (bounded by the client's
        ``begin_timeout``) keeps the save behind the ``begin``, as :meth:`set_up_planner`
        does in a thread. Locks and the handle stay on this side.

        Returns:
            A plain ``DefaultSavePlanner`` with this planner's settings; or, if the
            daemon refused the save (or it was never begun), a planner whose setting up
            raises, so that DCP's plan fails on every rank before any write.
        """
        error = self._gate()
        if error is not None:
            return (_RefusedPlanner, (error,))
        state = {k: v for k, v in vars(self).items() if k not in ("_handle", "_bound")}
        # copyreg's own helper (what protocols 0 and 1 use): the upload process needs
        # only torch to rebuild a DefaultSavePlanner from it; typeshed omits it.
        rebuild = copyreg._reconstructor  # type: ignore[attr-defined]
        return (rebuild, (DefaultSavePlanner, object, None), state)

    def _gate(self) -> Exception | None:
        """Wait until the save may write; what to raise instead if it may not."""
        self._bound.wait()
        if self._handle is None:
            return RuntimeError("ckptd: the save call failed before the save was begun")
        refusal = self._handle.refusal
        return None if refusal is None else _refused(self._handle, refusal)


class _RefusedPlanner(DefaultSavePlanner):
    """A planner for a save whose ``begin`` the daemon refused: setting it up raises.

    What :func:`async_save` passes in place of the caller's planner (or in an upload
    process, where :class:`AfterBeginPlanner` cannot wait) once the refusal is known:
    DCP's plan then fails on every rank before any write. Picklable.

    Args:
        error: What setting up raises.
    """

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """Refuse to plan.

        Raises:
            SaveRefused: always (a ``RuntimeError`` for a save never begun).
        """
        raise self.error


def _refused(handle: SaveHandle, refusal: ErrorInfo) -> SaveRefused:
    return SaveRefused(
        refusal.code, refusal.message, root=handle.root, step=handle.step, rank=handle.rank
    )


def _wait_quietly(future: Future[Any]) -> None:
    # Its outcome was already reported to the daemon by its own handle.
    wait([future])


def _upload_future(result: Any) -> Future[Any]:
    upload: Future[Any] = getattr(result, "upload_completion", result)
    return upload

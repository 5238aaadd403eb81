"""Registering a rank's Checkpointer saves with ckptd, part by part.

:class:`StepTracker` is the manager's link to the daemon. For each save it begins the
step for this rank, adds every part the Checkpointer produced to the step's
``SaveHandle`` (upload futures, the consolidation thread, files already written) and
seals the handle when the caller says the step is complete. The handle reports ``done``
only once it is sealed and every part has landed, so the daemon never promotes a step
while an upload, a consolidation or the caller's last file is still being written.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, Final

import torch.distributed as dist
from nemo_automodel.components.checkpoint._backports.filesystem import SerializationFormat

from .._client import CheckpointClient
from .._errors import SaveRefused
from .._objstore import is_object_url
from .._tracking import SaveHandle, describe
from ..protocol import FileEntry, default_socket_path
from ._lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from ._staging import StagedStep
from ._steps import (
    StepLocation,
    consolidation_future,
    dcp_rank_files,
    locate_step,
    plain_files,
    safetensors_rank_files,
)

__all__ = ["StepTracker", "TrackedStep", "connect"]

logger = logging.getLogger("orchestrator.automodel")

_PROBE_TIMEOUT: Final = 2.0


def connect(use_daemon: bool | None, client: CheckpointClient | None) -> CheckpointClient | None:
    """The client saves are registered through, or None for the reference behaviour.

    Local to this rank, with no collective and no world size: the ranks that left the
    choice to this probe (``use_daemon`` None) agree later, with :func:`agree`, at their
    first save into a step directory.

    Args:
        use_daemon: True: always (the client re-sends when a daemon comes up); False:
            never; None: only if this rank reaches a daemon now.
        client: The client to use; default the process-wide ``default_client()``.
    """
    if use_daemon is False:
        return None
    if use_daemon is None and not _probe(client):
        logger.info("ckptd: no daemon reachable; the caller renames steps")
        return None
    if client is None:
        from .._dcp import default_client

        client = default_client()
    logger.info("ckptd: steps are promoted by the daemon at %s", client.socket_path)
    return client


def agree(reachable: bool) -> bool:
    """Whether every rank reached a daemon (one ``all_gather_object``; collective).

    A step some ranks never begin is never promoted, so the ranks use the daemon only
    if all of them do. Called once, at the first save into a step directory, which
    every rank makes.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return reachable
    votes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(votes, reachable)
    if reachable and not all(votes):
        logger.warning(
            "ckptd: a daemon answered this rank but not every rank; the caller renames steps"
        )
    return all(votes)


def _probe(client: CheckpointClient | None) -> bool:
    if client is not None:
        return client.ping(_PROBE_TIMEOUT)
    path = default_socket_path()
    if not os.path.exists(path):
        return False
    probe = CheckpointClient(path)
    try:
        return probe.ping(_PROBE_TIMEOUT)
    finally:
        probe.close(timeout=0)


@dataclass(slots=True)
class TrackedStep:
    """This rank's save of one step, registered with the daemon."""

    location: StepLocation
    handle: SaveHandle
    rank: int
    staged: StagedStep | None = None
    """On an object-store root: the local stand-in this rank uploads when sealed."""


class StepTracker:
    """This rank's open and sealed steps, and what each is waiting for.

    Args:
        client: The daemon client.
        tmp_prefix: The root's ``tmp_prefix`` as configured in the daemon.
        local_world_size: The job's ranks on this node, sent with every ``begin``
            (None: as the environment says, see ``CheckpointClient.begin_nowait``).
    """

    def __init__(
        self, client: CheckpointClient, tmp_prefix: str, *, local_world_size: int | None = None
    ) -> None:
        self.client = client
        self._clients = {client.run: client}
        self.tmp_prefix = tmp_prefix
        self.local_world_size = local_world_size
        self.open: TrackedStep | None = None
        self._sealed: list[SaveHandle] = []
        self._consolidation: Future[None] | None = None
        self._uploading: Future[None] | None = None

    def client_for(self, run: str | None) -> CheckpointClient:
        """The client whose ``begin`` names ``run`` (None: the client's own run).

        A client names one run, read when it is created; a save that names another
        (NeMo-RL's Ray workers have no launcher's run: the driver chooses one) gets a
        client of its own on the same socket, kept for the next saves.
        """
        if run is None:
            return self.client
        if run not in self._clients:
            self._clients[run] = CheckpointClient(self.client.socket_path, run=run)
        return self._clients[run]

    def begin(
        self,
        weights_path: str,
        optimizer_path: str | None,
        tokenizer_path: str | None,
        run: str | None = None,
        staged: StagedStep | None = None,
    ) -> TrackedStep | None:
        """Register this rank's save of the step ``weights_path`` is in.

        Collective when more than one rank runs: the ranks exchange the daemon's answers
        (one ``all_gather_object``), so that a ``begin`` the daemon refused on any rank
        stops the save on every rank before the Checkpointer writes anything (it writes
        metadata, scripts and adapters before DCP runs, so failing DCP's plan would be
        too late). Ranks the daemon acknowledged report the step failed.

        Returns:
            The tracked step, or None when ``weights_path`` is not in a step directory.

        Args:
            weights_path: The model's path, inside ``<tmp_prefix>N``.
            optimizer_path: The optimizer's path, if saved.
            tokenizer_path: The tokenizer's path, if saved.
            run: The run the ``begin`` names (see :meth:`client_for`).
            staged: On an object-store root, the step's local stand-in (the paths are
                inside it); the step is then the staged step's, not the paths'.

        Raises:
            SaveRefused: the daemon refused the ``begin`` of some rank (on every rank).
            ValueError: a path is outside the step, the daemon writes it elsewhere, or
                ``run`` does not fit the protocol.
        """
        location = staged.location if staged else locate_step(weights_path, self.tmp_prefix)
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        handle = None
        if location is None:
            logger.warning(
                "ckptd: %s is not inside a %sN directory; this save is not tracked and "
                "nothing promotes it (call finalize_async_save before using it)",
                weights_path,
                self.tmp_prefix,
            )
        else:
            for path in (weights_path, optimizer_path, tokenizer_path):
                if path:
                    location.relative(path)
            handle = self.client_for(run).save(
                location.root, location.step, rank, world, local_world_size=self.local_world_size
            )
        refused = _refusals(handle, rank, world)
        if refused:
            mine = [error for error in refused if error.rank == rank]
            if handle is not None:  # if acknowledged here, the step can never complete
                handle.fail(f"the save stopped on every rank: {refused[0]}")
            raise (mine or refused)[0]
        if location is None or handle is None:
            return None
        if staged is not None:
            return TrackedStep(location, handle, rank, staged)
        if handle.begun.acknowledged and os.path.abspath(handle.path) != location.tmp_dir:
            handle.fail(f"the trainer writes {location.tmp_dir}, not {handle.path}")
            raise ValueError(
                f"ckptd writes step {location.step} into {handle.path}, but the checkpoint "
                f"paths are in {location.tmp_dir}; pass the root's tmp_prefix to "
                "AutomodelCheckpointManager(tmp_prefix=...)"
            )
        return TrackedStep(location, handle, rank)

    def model_saved(self, step: TrackedStep, checkpointer: Any, model_dir: str) -> None:
        """Track what ``Checkpointer.save_model`` just wrote or started writing."""
        rel = step.location.relative(model_dir)
        config = checkpointer.config
        rank, handle = step.rank, step.handle
        safetensors = config.model_save_format == SerializationFormat.SAFETENSORS
        # nemo_automodel 0.7.0 keeps the upload's AsyncSaveResponse here; None when the
        # save was synchronous or a PEFT adapter (written by rank 0 before returning).
        upload = checkpointer._model_ctx.future
        if step.staged is not None:
            # Uploaded and reported as a whole once sealed (a PEFT adapter is written
            # before save_model returns; consolidation is refused on a store).
            if upload is not None:
                handle.add(step.staged.after(upload))
            return
        if config.is_peft:
            if rank == 0:
                names = (ADAPTER_WEIGHTS, ADAPTER_CONFIG)
                entries = plain_files(model_dir, rel)
                handle.add_files(e for e in entries if os.path.basename(e.path) in names)
        elif upload is not None and safetensors:
            handle.add(
                _then_report(upload, handle, lambda: safetensors_rank_files(model_dir, rel, rank))
            )
        elif upload is not None:
            handle.add(upload, dcp_dir=rel, group_rank=rank)
        elif safetensors:
            handle.add_files(safetensors_rank_files(model_dir, rel, rank))
        else:
            handle.add_files(dcp_rank_files(model_dir, rel, rank))
        consolidating = consolidation_future(checkpointer)
        if consolidating is not None:
            self._consolidation = consolidating
            handle.add(consolidating)

    def optimizer_saved(self, step: TrackedStep, checkpointer: Any, optim_dir: str) -> None:
        """Track what ``Checkpointer.save_optimizer`` just wrote or started writing."""
        rel = step.location.relative(optim_dir)
        upload = checkpointer._optim_ctx.future
        if step.staged is not None:
            if upload is not None:
                step.handle.add(step.staged.after(upload))
            return
        if upload is not None:
            step.handle.add(upload, dcp_dir=rel, group_rank=step.rank)
        else:
            step.handle.add_files(dcp_rank_files(optim_dir, rel, step.rank))

    def directory_written(self, step: TrackedStep, directory: str) -> None:
        """Report every file of a directory this rank has finished writing."""
        if step.staged is not None:
            return  # its upload reports it
        step.handle.add_files(plain_files(directory, step.location.relative(directory)))

    def failed(self, step: TrackedStep, exc: BaseException) -> None:
        """The save call raised: the step fails for every rank."""
        step.handle.fail(f"save_checkpoint raised {describe(exc)}")
        if step.staged is not None:
            step.staged.discard()

    def add_files(self, paths: Iterable[str]) -> None:
        """Report files the caller wrote into the open step (see the manager)."""
        if self.open is None:
            raise RuntimeError(
                "no open step: call save_checkpoint(..., seal=False) before add_files()"
            )
        location = self.open.location
        entries: list[FileEntry] = []
        staged = self.open.staged
        for path in paths:
            if staged is not None and is_object_url(path):
                path = staged.local_path(path)
            full = path if os.path.isabs(path) else os.path.join(location.tmp_dir, path)
            rel = location.relative(full)
            if os.path.isdir(full):
                entries += plain_files(full, rel)
            else:
                entries.append(FileEntry(os.path.normpath(rel), os.stat(full).st_size))
        if self.open.staged is None:  # else its upload reports them, once sealed
            self.open.handle.add_files(entries)

    def seal(self) -> None:
        """Close the open step: ``done`` follows once every part has landed."""
        if self.open is None:
            return
        step, self.open = self.open, None
        if step.staged is not None:
            self._uploading = step.staged.upload_when_landed(step.handle)
            step.handle.add(self._uploading)
        step.handle.seal()
        self._sealed.append(step.handle)

    def before_next_save(self) -> None:
        """Let a consolidation report its outcome, and an object-store upload finish.

        The consolidation watcher must read the thread's error before
        ``Checkpointer.async_wait`` joins the thread and clears it, so this runs before
        every ``async_wait``. The last upload to an object store is waited for too (its
        outcome is the handle's), as DCP's is: a rank stages one save at a time.
        """
        pending = [f for f in (self._consolidation, self._uploading) if f is not None]
        wait(pending)
        self._consolidation = self._uploading = None

    def wait_reported(self) -> None:
        """Block until every sealed step has been reported ``done`` or ``fail``."""
        for handle in self._sealed:
            handle.wait_local()
        self._sealed.clear()

    def abandon(self) -> None:
        """Fail the open step: the trainer stops before sealing it."""
        if self.open is not None:
            self.open.handle.fail(
                f"the trainer closed its checkpoint manager before sealing step "
                f"{self.open.location.step}"
            )
            if self.open.staged is not None:
                self.open.staged.discard()
            self.open = None

    def finish(self, timeout: float) -> None:
        """Wait for every client's reports (``timeout`` each); close those made here."""
        for client in self._clients.values():
            client.flush(timeout)
            if client is not self.client:
                client.close(timeout)
        self._clients = {self.client.run: self.client}


def _refusals(handle: SaveHandle | None, rank: int, world: int) -> list[SaveRefused]:
    """Every rank's refused ``begin``, in rank order (a collective when distributed)."""
    mine = None
    if handle is not None and (refusal := handle.refusal) is not None:
        mine = SaveRefused(
            refusal.code, refusal.message, root=handle.root, step=handle.step, rank=rank
        )
    if world == 1 or not dist.is_initialized():
        return [] if mine is None else [mine]
    votes: list[Any] = [None] * world
    dist.all_gather_object(votes, mine)
    return [vote for vote in votes if isinstance(vote, SaveRefused)]


def _then_report(
    response: Any, handle: SaveHandle, files: Callable[[], list[FileEntry]]
) -> Future[None]:
    """A future that resolves after ``response``'s upload, once its files are reported."""
    upload: Future[Any] = getattr(response, "upload_completion", response)
    reported: Future[None] = Future()

    def on_upload(done: Future[Any]) -> None:
        if done.cancelled():
            reported.cancel()
            return
        error = done.exception()
        if error is None:
            try:
                handle.add_files(files())
            except Exception as exc:  # a callback boundary: never leave the step hanging
                error = exc
        if error is None:
            reported.set_result(None)
        else:
            reported.set_exception(error)

    upload.add_done_callback(on_upload)
    return reported

"""``CheckpointManager``: save, restore, wait and close, for a plain-PyTorch trainer.

The shape of the other trainers' managers (Orbax's, torchtitan's, NeMo-RL's): ask
whether to save now, save, restore the newest complete checkpoint into the model and
optimizer, wait, close. Under it, each save is ``orchestrator.async_save`` of every
object's state into one DCP directory per name, one handle per step, sealed after the
last part: the node's ckptd promotes the step once every rank's parts landed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any, Final

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from . import _states
from ._client import CheckpointClient
from ._dcp import async_save, checkpoint_group
from ._errors import SaveRefused
from ._objstore import is_object_url, storage_reader
from ._steps import find_pointer, find_step
from ._tiers import has_fast_tier, restore_point
from ._tracking import SaveHandle, describe

__all__ = ["CheckpointManager"]

log = logging.getLogger("orchestrator")

_CONTROL: Final = "/control"
"""The checkpoint group the manager's own collectives use (no directory has this name)."""


class CheckpointManager:
    """Checkpoints of a plain-PyTorch training job, promoted by the node's ckptd.

    Every rank creates one with the same arguments, after
    ``torch.distributed.init_process_group``, and calls :meth:`save` and :meth:`restore`
    with the same steps (both are collective). ``state`` maps names to what is saved:
    models (plain, DDP or FSDP2), optimizers, objects with ``state_dict()`` and
    ``load_state_dict()``, and dicts; each name is one DCP directory of the step
    (``model/``, ``optim/``). Models and optimizers go through torch's
    ``get_state_dict``/``set_state_dict``, so a checkpoint loads on any number of ranks.

    ::

        with orchestrator.CheckpointManager("/ckpt/run-42", interval=100) as manager:
            state = {"model": model, "optim": optimizer}
            start = manager.restore(state) or 0
            for step in range(start + 1, steps + 1):
                train_step()
                manager.save(step, state)  # at each multiple of 100; returns once staged
        dist.destroy_process_group()       # after the manager closed: uploads landed

    Args:
        root: The checkpoint root the daemon serves: a directory (made absolute) or
            ``s3://BUCKET/PREFIX``.
        interval: Save every ``interval`` steps (:meth:`should_save`); None saves only
            when :meth:`save` is called with ``force=True``.
        run: The run of the job, the same on every rank (see
            :class:`~orchestrator.CheckpointClient`); default from torchelastic or Slurm.
        strict: A save the daemon refuses raises :class:`~orchestrator.SaveRefused` in
            :meth:`save` on the ranks it was refused to (the training thread waits for
            the daemon's answer to ``begin``, at most the client's ``begin_timeout``; an
            unreachable daemon is not a refusal: training goes on); and a save whose
            upload failed raises ``RuntimeError`` from the next :meth:`save`,
            :meth:`wait_until_finished` or :meth:`close`. Without it, both are logged.
        client: The daemon client; default a client of the manager's own, closed by
            :meth:`close`.
        socket_path: The daemon's socket, for the manager's own client.
        best_pointer: The name of the root's best pointer (retention's ``best_pointer``).

    Raises:
        ValueError: ``interval`` is not a positive integer, or ``run`` is not a run id.
    """

    def __init__(
        self,
        root: str,
        *,
        interval: int | None = None,
        run: str | None = None,
        strict: bool = True,
        client: CheckpointClient | None = None,
        socket_path: str | None = None,
        best_pointer: str = "best",
    ) -> None:
        if interval is not None and (not isinstance(interval, int) or interval < 1):
            raise ValueError(f"interval={interval!r}: give a positive number of steps, or None")
        self.root = root if is_object_url(root) else os.path.abspath(root)
        """The checkpoint root (a local one made absolute)."""
        self.interval = interval
        self.strict = strict
        self.best_pointer = best_pointer
        self._owns_client = client is None
        # The manager applies ``strict`` itself, after every rank's DCP plan has failed
        # on a refusal: a client raising at ``begin`` (CKPTD_STRICT) would leave the
        # ranks the daemon did not refuse waiting in DCP's collective for this one.
        self._client = client or CheckpointClient(socket_path, run=run, strict=False)
        self._saves: list[tuple[int, SaveHandle, list[Future[Any]]]] = []
        self._last: int | None = None
        self._closed = False
        self._tiered: bool | None = None  # whether the root has a fast tier (first save)

    @property
    def client(self) -> CheckpointClient:
        """The daemon client the manager saves through."""
        return self._client

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` of ``step`` would save: a multiple of ``interval``, new.

        Args:
            step: The training step just finished.

        Returns:
            False without an ``interval``, and for a step not after the last one this
            manager saved or restored.
        """
        if self.interval is None or step % self.interval:
            return False
        return self._last is None or step > self._last

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metrics: Mapping[str, float] | None = None,
        force: bool = False,
    ) -> bool:
        """Save ``state`` as step ``step`` if :meth:`should_save` (or ``force``). Collective.

        Returns once every object's state is staged (copied): training may change the
        model at once. The uploads run in the background, and the daemon promotes
        the step when every rank's uploads landed and verified.

        Args:
            step: The step.
            state: Names to models, optimizers, stateful objects and dicts (see the class).
            metrics: Numbers kept with the step for the root's retention (``keep_best``)
                and its ``best`` pointer, e.g. ``{"val_loss": 2.1}``.
            force: Save even if :meth:`should_save` says no.

        Returns:
            Whether a save was started.

        Raises:
            SaveRefused: under ``strict``, the daemon refused this save (nothing of it
                is written: on every rank, DCP's plan fails before any write).
            RuntimeError: under ``strict``, an earlier save's upload failed; or the
                manager is closed.
            ValueError: a name of ``state`` is not a plain directory name, or a metric
                is not finite.
            TypeError: a value of ``state`` cannot be saved.
        """
        self._check_open()
        self._reap(block=False)
        if not force and not self.should_save(step):
            return False
        states = _states.capture(state)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        handle = self._client.save(self.root, step, rank, world_size, wait=self.strict)
        refusal = handle.refusal if self.strict else None  # answered by now, or never
        if metrics:
            handle.add_metrics(metrics)
        futures: list[Future[Any]] = []
        extra: dict[str, Any] = {}
        if self._tiered is None:
            self._tiered = has_fast_tier(self.root)  # once: the layout file, one read
        if self._tiered and self._client.resolve_local_world_size(world_size) not in (
            None,
            world_size,
        ):
            # Per-rank metadata: each node keeps what its own ranks read (docs/tiers.md).
            extra["use_collectives"] = False
        for name, values in states.items():
            result = async_save(
                {name: values},
                root=self.root,
                step=step,
                subdir=name,
                client=self._client,
                handle=handle,
                **extra,
            )
            futures.append(getattr(result, "upload_completion", result))
        handle.seal()
        # A refusal is raised here; its futures' failure says the same: not again.
        self._saves.append((step, handle, [] if refusal is not None else futures))
        self._last = step
        if refusal is not None:
            raise SaveRefused(refusal.code, refusal.message, root=self.root, step=step, rank=rank)
        return True

    def restore(self, state: Mapping[str, Any], *, step: int | None = None) -> int | None:
        """Load a promoted checkpoint into ``state``, in place. Collective.

        Rank 0 chooses the step and every rank loads that one: the newest complete
        checkpoint (the root's ``latest`` pointer), or ``step``. Saves still uploading
        are waited for first.

        Args:
            state: The objects to load into (as for :meth:`save`).
            step: The step to load; default the newest complete one.

        Returns:
            The step loaded, or None when the root has no checkpoint yet (nothing is
            changed).

        Raises:
            FileNotFoundError: ``step`` is not a promoted checkpoint of the root.
            OSError: the object store could not be read.
        """
        self._check_open()
        self.wait_until_finished()
        states = _states.capture(state)
        chosen: list[Any] = [None]
        if step is None and has_fast_tier(self.root):
            # Every rank asks its node's daemon; one daemon decided for the whole run.
            found = restore_point(
                self.root, self._client, rank=dist.get_rank(), world_size=dist.get_world_size()
            )
            chosen[0] = None if found is None else (found.step, found.path)
        elif dist.get_rank() == 0:
            found = find_pointer(self.root) if step is None else find_step(self.root, step)
            chosen[0] = None if found is None else (found.step, found.path)
        if dist.get_world_size() > 1 and not (step is None and has_fast_tier(self.root)):
            dist.broadcast_object_list(chosen, src=0, group=checkpoint_group(_CONTROL))
        if chosen[0] is None:
            if step is not None:
                raise FileNotFoundError(f"step {step} of {self.root} is not a promoted checkpoint")
            return None
        loaded, where = chosen[0]
        for name, values in states.items():
            directory = f"{where}/{name}"
            reader = storage_reader(directory) if is_object_url(directory) else None
            dcp_load(
                {name: values},
                checkpoint_id=directory,
                storage_reader=reader,
                process_group=checkpoint_group(name),
            )
        _states.apply(state, states)
        self._last = int(loaded)
        return int(loaded)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step (the root's ``latest``), or None.

        Read from the root by this rank alone (not collective).
        """
        found = find_pointer(self.root)
        return None if found is None else found.step

    def best_step(self) -> int | None:
        """The step the root's ``best`` pointer names (retention's ``keep_best``), or None.

        Read from the root by this rank alone (not collective).
        """
        found = find_pointer(self.root, self.best_pointer)
        return None if found is None else found.step

    def wait_until_finished(self, timeout: float | None = None) -> None:
        """Block until every save of this manager has landed and been reported.

        Args:
            timeout: Longest wait in seconds; None waits as long as the uploads take.

        Raises:
            TimeoutError: saves still in flight after ``timeout``.
            RuntimeError: under ``strict``, a save's upload failed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for _, handle, _ in list(self._saves):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not handle.wait_local(left):
                raise TimeoutError(
                    f"step {handle.step} of {self.root} still uploading after {timeout}s"
                )
        self._reap(block=True)

    def close(self) -> None:
        """Wait for the saves in flight (:meth:`wait_until_finished`), then close.

        The manager's own client is closed too (its last reports acknowledged). Call it
        before ``dist.destroy_process_group()``, or use the manager as a context manager.

        Raises:
            RuntimeError: under ``strict``, a save's upload failed (the manager is
                closed all the same).
        """
        if self._closed:
            return
        try:
            self.wait_until_finished()
        finally:
            self._closed = True
            if self._owns_client:
                self._client.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is None:
            self.close()
            return
        try:  # an error is already on its way: closing must not replace it
            self.close()
        except Exception as exc:
            log.error("ckptd: closing the checkpoint manager failed: %s", exc)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the checkpoint manager of {self.root} is closed")

    def _reap(self, *, block: bool) -> None:
        """Forget settled saves; report a failed upload (raise under ``strict``)."""
        kept: list[tuple[int, SaveHandle, list[Future[Any]]]] = []
        failed: tuple[int, BaseException] | None = None
        for step, handle, futures in self._saves:
            if not (block or handle.wait_local(0)):
                kept.append((step, handle, futures))
                continue
            for future in futures:
                error = future.exception() if future.done() and not future.cancelled() else None
                if error is not None and failed is None:
                    failed = (step, error)
        self._saves = kept
        if failed is None:
            return
        step, error = failed
        message = f"ckptd: the save of step {step} to {self.root} failed: {describe(error)}"
        if self.strict:
            raise RuntimeError(message) from error
        log.error("%s", message)

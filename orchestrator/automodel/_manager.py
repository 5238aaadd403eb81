"""``AutomodelCheckpointManager``: NeMo-RL's checkpoint manager, promoted by ckptd.

The same API and behaviour as ``nemo_rl.models.automodel.checkpoint``, on nemo_automodel
0.7.0's real ``Checkpointer``, with one addition: when the node's ckptd daemon is
reachable, each save of ``ROOT/tmp_step_N/...`` is registered with it and every upload
(model, optimizer, consolidation) and synchronously written file (tokenizer, the caller's
extra files) is tracked; the daemon renames ``tmp_step_N`` to ``step_N`` once every rank
has reported its parts landed. The trainer never blocks on the upload and never renames.
Without a daemon it behaves exactly like the reference: the caller blocks on
:meth:`~AutomodelCheckpointManager.finalize_async_save` and renames itself. The load
methods, which ckptd leaves as they are, come from ``_loading.py``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from nemo_automodel.components.checkpoint.config import CheckpointingConfig
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._client import CheckpointClient
from .._nodes import local_world_size, read_environment
from ._loading import LoadingMixin
from ._promotion import StepTracker, connect
from ._stager import install_cpu_safe_stager, use_prefix_store
from ._uploads import install_ordered_uploads

if TYPE_CHECKING:
    from nemo_automodel.components._peft.lora import PeftConfig
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer

__all__ = ["AutomodelCheckpointManager"]

logger = logging.getLogger("orchestrator.automodel")


class AutomodelCheckpointManager(LoadingMixin):
    """Manages checkpointing for Automodel models using nemo_automodel's Checkpointer.

    A drop-in for NeMo-RL's ``AutomodelCheckpointManager``: same constructor, methods
    and behaviour. When the node's ckptd daemon is reachable from every rank (checked
    once, in :meth:`init_checkpointer`), saves into ``ROOT/tmp_step_N/...`` are promoted
    by the daemon: the caller must not rename ``tmp_step_N`` itself, and need not call
    :meth:`finalize_async_save` before moving on. :attr:`uses_daemon` says which mode is
    in force.

    Attributes:
        checkpointer: The underlying nemo_automodel ``Checkpointer`` (None until
            :meth:`init_checkpointer`).

    Args:
        dp_mesh: The data-parallel device mesh.
        tp_mesh: The tensor-parallel device mesh.
        moe_mesh: Optional MoE device mesh.
        client: The daemon client to use (default: the process-wide
            ``orchestrator.default_client()``, on ``$CKPTD_SOCKET``).
        use_daemon: True: always register saves with the daemon (if it is down, the
            client re-sends when it is back); False: never (the reference behaviour);
            None (default): only if every rank reaches a daemon at
            :meth:`init_checkpointer`.
        tmp_prefix: The root's ``tmp_prefix`` as configured in the daemon.
        local_world_size: How many of the job's ranks run on this node, for a job
            across nodes. Default: torchrun's ``LOCAL_WORLD_SIZE``, else Slurm's
            ``SLURM_NTASKS_PER_NODE`` (see ``CheckpointClient.begin_nowait``); checked
            against the world size in :meth:`init_checkpointer`.
    """

    def __init__(
        self,
        dp_mesh: DeviceMesh,
        tp_mesh: DeviceMesh,
        moe_mesh: DeviceMesh | None = None,
        *,
        client: CheckpointClient | None = None,
        use_daemon: bool | None = None,
        tmp_prefix: str = "tmp_step_",
        local_world_size: int | None = None,
    ) -> None:
        self.checkpointer: Checkpointer | None = None
        self.dp_mesh = dp_mesh
        self.tp_mesh = tp_mesh
        self.moe_mesh = moe_mesh
        self._client = client
        self._use_daemon = use_daemon
        self._tmp_prefix = tmp_prefix
        self._local_world_size = local_world_size
        self._tracker: StepTracker | None = None

    # -- the reference API (its load methods: _loading.py) --------------------------------

    def _get_dp_rank(self) -> int:
        """Get the data parallel rank."""
        return int(dist.get_rank(self.dp_mesh.get_group()))

    def _get_tp_rank(self) -> int:
        """Get the tensor parallel rank."""
        return int(dist.get_rank(self.tp_mesh.get_group()))

    def init_checkpointer(self, config_updates: dict[str, Any] | None = None) -> None:
        """Initialize the Automodel Checkpointer if not already created.

        Creates the ``Checkpointer`` from ``config_updates`` (``save_consolidated``
        defaults to ``"false"``; NeMo-RL passes explicit paths to every save and load, so
        the configured root is unused). Does nothing if a checkpointer exists. Like the
        constructor it calls, it is collective: every rank must call it, in the same
        order relative to other process-group creation.

        With ``is_async=True``, three process-wide adjustments are made first: on a host
        without an accelerator the async stagers are built with CPU-safe options
        (``_stager.py``); uploads are dispatched in call order without the training
        thread ever waiting for one (``_uploads.py``); and with ``MASTER_ADDR`` and
        ``MASTER_PORT`` set, ``DCP_USE_PREFIX_STORE=1`` (unless set) lets the upload
        processes reuse the job's store.

        Args:
            config_updates: Automodel checkpoint fields to set during initialization
                (e.g. :func:`build_checkpoint_config`'s result).

        Raises:
            ValueError: the constructor's ``local_world_size`` (or the environment it is
                read from) does not fit the world size; raised before anything else.
        """
        if self.checkpointer is not None:
            return
        world = dist.get_world_size() if dist.is_initialized() else 1
        local = local_world_size(world, self._local_world_size, read_environment())
        updates = dict(config_updates or {})
        updates.setdefault("save_consolidated", "false")
        config = CheckpointingConfig(enabled=True, checkpoint_dir="", **updates)
        if config.is_async:
            use_prefix_store()
            install_cpu_safe_stager()
            install_ordered_uploads()
        self.checkpointer = config.build(
            dp_rank=self._get_dp_rank(),
            tp_rank=self._get_tp_rank(),
            pp_rank=0,
            moe_mesh=self.moe_mesh,
        )
        client = connect(self._use_daemon, self._client)
        if client is not None:
            self._tracker = StepTracker(client, self._tmp_prefix, local_world_size=local)

    def finalize_async_save(self) -> None:
        """Block until in-flight async checkpoint writes have landed on disk.

        With ``is_async=True`` the Checkpointer hands model and optimizer state to
        ``dcp.async_save``, which stages them and uploads from a separate process. Those
        writes address files by path, so without a daemon the caller must not rename
        ``tmp_step_N`` to ``step_N`` until this returns; otherwise the writer re-creates
        ``tmp_step_N`` and the promoted checkpoint lacks its optimizer shards and
        ``.metadata``. With a daemon there is no need to call it between saves: the
        daemon renames when the writes have landed. It also waits until this rank's
        sealed steps have been reported to the daemon.

        Safe to call when async saving is off or no save is in flight.

        Raises:
            BaseException: the failure of an upload, as ``Checkpointer.async_wait``
                raises it (``CheckpointException`` derives from ``BaseException``).
        """
        if self.checkpointer is None:
            return
        self.checkpointer.maybe_wait_for_staging()
        self._complete_uploads()
        if self._tracker is not None:
            self._tracker.wait_reported()

    @staticmethod
    def _save_tokenizer_on_rank0(tokenizer: Any, tokenizer_path: str) -> None:
        """Save a tokenizer (or processor) to ``tokenizer_path`` from rank 0 only.

        The tokenizer is replicated, not sharded: every rank holds the same copy, and
        ``save_pretrained`` writes rank-independent file names. It is not atomic (it opens
        with ``O_TRUNC``, writes, and may read back), so concurrent writers from several
        ranks race on the same files and, on a hard-mounted NFS share, can deadlock on the
        inode lock: ranks stuck in uninterruptible sleep, the whole job hung at checkpoint
        time. This mirrors the rank-0 guard of nemo_automodel's
        ``ConsolidatedHFAddon.pre_save``.

        Every rank waits (a barrier) until rank 0 has written, so the directory is
        complete on every rank when this returns. Not for ``dcp.save``-based state: those
        saves are collective and already rank-disjoint; guarding them would deadlock.

        Args:
            tokenizer: The tokenizer or processor to save.
            tokenizer_path: Directory to save it into.
        """
        distributed = dist.is_initialized()
        if not distributed or dist.get_rank() == 0:
            logger.info("saving tokenizer (or processor) to %s", tokenizer_path)
            tokenizer.save_pretrained(tokenizer_path)
        if distributed:
            dist.barrier()

    def save_checkpoint(
        self,
        model: nn.Module,
        weights_path: str,
        optimizer: torch.optim.Optimizer | None = None,
        optimizer_path: str | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        tokenizer: Any = None,
        tokenizer_path: str | None = None,
        *,
        is_final_checkpoint: bool,
        peft_config: PeftConfig | None = None,
        seal: bool = True,
        metrics: Mapping[str, float] | None = None,
    ) -> None:
        """Save a checkpoint of the model.

        The model goes to ``weights_path/model``; the optimizer (and scheduler) state to
        ``optimizer_path/optim``, only if ``optimizer`` and ``optimizer_path`` are given;
        the tokenizer to ``tokenizer_path`` from rank 0 only, if both are given (without
        a ``tokenizer_path`` it is handed to the Checkpointer's HF metadata / PEFT
        addons). Any previous async save is completed first. With async saving this
        returns once model and optimizer staging is complete; uploads (and consolidation)
        go on in the background.

        With the daemon (:attr:`uses_daemon`), the step is found from ``weights_path``
        (its nearest ancestor ``<tmp_prefix>N``, whose parent is the root), registered
        for this rank, and every part of it is tracked; once this rank's handle is sealed
        and every part has landed, the daemon is told, and it promotes the step when all
        ranks have. Files the caller writes into the step *after* this call must be
        written before the step is sealed: pass ``seal=False``, write them, report them
        with :meth:`add_files`, then call :meth:`seal`. Files written before this call
        are already in the directory and are promoted with it.

        Args:
            model: The model to save.
            weights_path: Where the weights go (NeMo-RL: ``tmp_step_N/policy/weights``).
            optimizer: Optional optimizer to save.
            optimizer_path: Optional optimizer path (``tmp_step_N/policy/optimizer``).
            scheduler: Optional learning-rate scheduler, saved with the optimizer.
            tokenizer: Optional tokenizer (or processor: anything with
                ``save_pretrained``) to save with the checkpoint.
            tokenizer_path: Optional separate tokenizer directory.
            is_final_checkpoint: Whether this checkpoint completes the run (at the final
                step or after a deliberate early stop); Automodel's
                ``save_consolidated="final"`` consolidates these. Timeout recovery
                checkpoints are resumable and not final.
            peft_config: Optional PEFT configuration (adapter-only saves).
            seal: ckptd only: seal the step when this returns (default). False keeps it
                open for :meth:`add_files` until :meth:`seal`.
            metrics: ckptd only: this checkpoint's metrics (e.g. ``{"val_loss": 1.3}``),
                sent with this rank's ``done``; the daemon's retention (``keep_best``,
                the ``best`` pointer) judges by them. See also :meth:`add_metrics`.

        Raises:
            SaveRefused: with the daemon, it refused the step's ``begin`` on some rank
                (e.g. ``already_promoted``): raised on every rank, before anything of
                the save is written.
            ValueError: with the daemon, ``optimizer_path`` or ``tokenizer_path`` is not
                inside the step's tmp directory, or the daemon writes the step elsewhere.
            BaseException: whatever the Checkpointer raises, including the previous
                upload's failure; the daemon is told this step failed first.
        """
        logger.info("saving checkpoint to %s", weights_path)
        checkpointer = self._require("saving a checkpoint")
        tracker = self._tracker
        if tracker is not None and tracker.open is not None:
            logger.warning(
                "ckptd: step %s was left open (save_checkpoint(seal=False) without seal()); "
                "sealing it before saving the next one",
                tracker.open.location.step,
            )
            tracker.seal()
        # Automodel keeps one future each for model and optimizer: finish the previous
        # save before they are replaced (the daemon already has its outcome).
        self._complete_uploads()
        step = tracker.begin(weights_path, optimizer_path, tokenizer_path) if tracker else None
        if step is not None and metrics:
            step.handle.add_metrics(metrics)
        try:
            checkpointer.save_model(
                model=model,
                weights_path=weights_path,
                peft_config=peft_config,
                tokenizer=tokenizer if tokenizer_path is None else None,
                is_final_checkpoint=is_final_checkpoint,
            )
            if tracker is not None and step is not None:
                tracker.model_saved(step, checkpointer, os.path.join(weights_path, "model"))
            if optimizer_path and optimizer is not None:
                checkpointer.save_optimizer(
                    optimizer=optimizer,
                    model=model,
                    weights_path=optimizer_path,
                    scheduler=scheduler,
                )
                if tracker is not None and step is not None:
                    optim_dir = os.path.join(optimizer_path, "optim")
                    tracker.optimizer_saved(step, checkpointer, optim_dir)
            if tokenizer_path and tokenizer is not None:
                # Passing tokenizer_path bypasses the addons' own rank-0 guard (the
                # tokenizer is not handed to save_model above), so apply it here.
                self._save_tokenizer_on_rank0(tokenizer, tokenizer_path)
                if tracker is not None and step is not None and step.rank == 0:
                    tracker.directory_written(step, tokenizer_path)
            # Staging reads the live tensors: only return once they have been copied.
            checkpointer.maybe_wait_for_staging()
        except BaseException as exc:  # CheckpointException derives from BaseException
            if tracker is not None and step is not None:
                tracker.failed(step, exc)
            raise
        if tracker is not None and step is not None:
            tracker.open = step
            if seal:
                tracker.seal()

    # -- what ckptd adds -------------------------------------------------------------------

    @property
    def uses_daemon(self) -> bool:
        """Whether saves are promoted by the daemon (else the caller renames, as before)."""
        return self._tracker is not None

    def add_files(self, paths: Iterable[str]) -> None:
        """Report files this rank wrote into the open step (``save_checkpoint(seal=False)``).

        The daemon checks each exists with at least its current size before promoting.
        Call once the files are completely written, before :meth:`seal`. A directory
        reports every file under it. Without the daemon this does nothing.

        Args:
            paths: Absolute paths, or paths relative to the step's tmp directory
                (``"train_dataloader.pt"``).

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
                self._tracker.client.flush(5.0)
            self.checkpointer.close()
            self.checkpointer = None

    # -- plumbing -------------------------------------------------------------------------

    def _complete_uploads(self) -> None:
        if self._tracker is not None:
            self._tracker.before_next_save()
        if self.checkpointer is not None:
            self.checkpointer.async_wait()

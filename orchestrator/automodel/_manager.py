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
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from nemo_automodel.components.checkpoint.checkpointing import Checkpointer
from nemo_automodel.components.checkpoint.config import CheckpointingConfig
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._client import CheckpointClient
from .._nodes import local_world_size, read_environment
from .._objstore import is_object_url
from ._additions import DaemonMixin
from ._config import build_checkpoint_config
from ._generations import (
    _infer_checkpoint_root,
    apply_config_updates,
    detect_checkpoint_format,
    legacy_save_updates,
)
from ._loading import LoadingMixin
from ._lora import _resolve_lora_adapter_dir
from ._promotion import StepTracker, agree, connect
from ._qwen_patch import _patch_qwen_vl_vision_key_mapping
from ._stager import install_cpu_safe_stager, use_prefix_store
from ._staging import prepare_staged, stage_save
from ._steps import locate_step
from ._uploads import install_ordered_uploads

if TYPE_CHECKING:
    from nemo_automodel.components._peft.lora import PeftConfig

# Every name of NeMo-RL's module (both generations) is found here too, so this one module
# stands in for ``nemo_rl.models.automodel.checkpoint``: the manager looks its names up
# here, and an alias of the upstream name to this module serves both its imports and the
# names its tests patch (docs/nemo-rl.md, "NeMo-RL's own tests").
__all__ = [
    "AutomodelCheckpointManager",
    "_infer_checkpoint_root",
    "_patch_qwen_vl_vision_key_mapping",
    "_resolve_lora_adapter_dir",
    "build_checkpoint_config",
    "detect_checkpoint_format",
    "logger",
]

_UNSET: Any = object()
"""``save_checkpoint``'s ``checkpointing_cfg`` when not given: the current generation."""

logger = logging.getLogger("orchestrator.automodel")
"""The package's logger (``orchestrator.automodel``), the seed module's ``logger``."""


class AutomodelCheckpointManager(DaemonMixin, LoadingMixin):
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
            against the world size in :meth:`init_checkpointer` when a daemon answers.
        run: The run every save names (default: the launcher's, see
            ``orchestrator._run``). NeMo-RL's Ray workers have none: pass the driver's
            ``CheckpointManager.run`` here or to each :meth:`save_checkpoint`.
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
        run: str | None = None,
    ) -> None:
        self.checkpointer: Checkpointer | None = None
        self.checkpoint_config: CheckpointingConfig | None = None
        """The Checkpointer's configuration (the previous generation's attribute)."""
        self.dp_mesh = dp_mesh
        self.tp_mesh = tp_mesh
        self.moe_mesh = moe_mesh
        self._client = client
        self._use_daemon = use_daemon
        self._tmp_prefix = tmp_prefix
        self._local_world_size = local_world_size
        self._run = run
        self._tracker: StepTracker | None = None
        self._agreed = use_daemon is not None  # else the ranks vote at the first step

    # -- the reference API (its load methods: _loading.py) --------------------------------

    def _get_dp_rank(self) -> int:
        """Get the data parallel rank."""
        return int(dist.get_rank(self.dp_mesh.get_group()))

    def _get_tp_rank(self) -> int:
        """Get the tensor parallel rank."""
        return int(dist.get_rank(self.tp_mesh.get_group()))

    def init_checkpointer(
        self, config_updates: dict[str, Any] | None = None, checkpoint_root: str | None = None
    ) -> None:
        """Initialize the Automodel Checkpointer if not already created.

        Creates the ``Checkpointer`` from ``config_updates`` (``save_consolidated``
        defaults to ``"false"``; NeMo-RL passes explicit paths to every save and load, so
        the configured root is only ``checkpoint_root``, if given). Does nothing if a
        checkpointer exists. Like the constructor it calls, it is collective: every rank
        must call it, in the same order relative to other process-group creation.

        With ``is_async=True``, three process-wide adjustments are made first: on a host
        without an accelerator the async stagers are built with CPU-safe options
        (``_stager.py``); uploads are dispatched in call order without the training
        thread ever waiting for one (``_uploads.py``); and with ``MASTER_ADDR`` and
        ``MASTER_PORT`` set, ``DCP_USE_PREFIX_STORE=1`` (unless set) lets the upload
        processes reuse the job's store.

        Whether a daemon answers is asked here, of this rank only; the world size is
        read only then (for ``local_world_size``). The ranks agree at their first save
        into a step directory (one ``all_gather_object``).

        Args:
            config_updates: Automodel checkpoint fields to set during initialization
                (e.g. :func:`build_checkpoint_config`'s result).
            checkpoint_root: The Checkpointer's ``checkpoint_dir`` (the previous
                generation's argument; default ``""``).

        Raises:
            ValueError: with a daemon, the constructor's ``local_world_size`` (or the
                environment it is read from) does not fit the world size; raised
                before the Checkpointer is built.
        """
        if self.checkpointer is not None:
            return
        client = connect(self._use_daemon, self._client)
        local = None
        if client is not None:
            world = dist.get_world_size() if dist.is_initialized() else 1
            local = local_world_size(world, self._local_world_size, read_environment())
        updates = dict(config_updates or {})
        updates.setdefault("save_consolidated", "false")
        config = CheckpointingConfig(enabled=True, checkpoint_dir=checkpoint_root or "", **updates)
        if config.is_async:
            use_prefix_store()
            install_cpu_safe_stager()
            install_ordered_uploads()
        self.checkpoint_config = config
        self.checkpointer = Checkpointer(
            config=config,
            dp_rank=self._get_dp_rank(),
            tp_rank=self._get_tp_rank(),
            pp_rank=0,
            moe_mesh=self.moe_mesh,
        )
        if client is not None:
            self._tracker = StepTracker(client, self._tmp_prefix, local_world_size=local)

    def update_checkpointer_config(
        self, config_updates: dict[str, Any] | None = None, checkpoint_root: str | None = None
    ) -> None:
        """Update the configuration of the existing Checkpointer (previous generation).

        Sets each field (a format name becomes its enum, a bool its consolidation mode)
        and chooses the Checkpointer's addons again, as its constructor does from the
        config. ``is_async`` cannot change after :meth:`init_checkpointer` (a different
        value is ignored, with a warning). Does nothing before it.

        Args:
            config_updates: ``CheckpointingConfig`` fields to update.
            checkpoint_root: A new ``checkpoint_dir``, if given.
        """
        if self.checkpointer is not None:
            apply_config_updates(self.checkpointer, config_updates or {}, checkpoint_root)

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
        checkpointing_cfg: Mapping[str, Any] | None = _UNSET,
        lora_enabled: bool = False,
        peft_config: PeftConfig | None = None,
        *,
        is_final_checkpoint: bool | None = None,
        seal: bool = True,
        metrics: Mapping[str, float] | None = None,
        run: str | None = None,
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

        On an ``s3://`` root the paths are URLs in the same layout
        (``s3://BUCKET/PREFIX/tmp_step_N/policy/weights``). The Checkpointer writes into
        this rank's local stand-in for the step (:attr:`step_dir`); once sealed and
        landed, the rank uploads its own files under the attempt's prefix and reports
        them (``_staging.py``). That needs the daemon, and no HF consolidation.

        Two generations of NeMo-RL call this. The current one passes
        ``is_final_checkpoint`` (required then) and no ``checkpointing_cfg``; the
        previous one passes ``checkpointing_cfg`` (NeMo-RL's ``checkpointing`` block),
        ``lora_enabled`` and ``peft_config``, and each save first re-applies the block's
        Automodel fields (:meth:`update_checkpointer_config`, with the root inferred
        from ``weights_path``); ``is_final_checkpoint`` is then False unless given.

        Args:
            model: The model to save.
            weights_path: Where the weights go (NeMo-RL: ``tmp_step_N/policy/weights``).
            optimizer: Optional optimizer to save.
            optimizer_path: Optional optimizer path (``tmp_step_N/policy/optimizer``).
            scheduler: Optional learning-rate scheduler, saved with the optimizer.
            tokenizer: Optional tokenizer (or processor: anything with
                ``save_pretrained``) to save with the checkpoint.
            tokenizer_path: Optional separate tokenizer directory.
            checkpointing_cfg: Previous generation: NeMo-RL's ``checkpointing`` block.
            lora_enabled: Previous generation: save as PEFT with ``peft_config``.
            peft_config: Optional PEFT configuration (adapter-only saves).
            is_final_checkpoint: Whether this checkpoint completes the run (at the final
                step or after a deliberate early stop); Automodel's
                ``save_consolidated="final"`` consolidates these. Timeout recovery
                checkpoints are resumable and not final.
            seal: ckptd only: seal the step when this returns (default). False keeps it
                open for :meth:`add_files` until :meth:`seal`.
            metrics: ckptd only: this checkpoint's metrics (e.g. ``{"val_loss": 1.3}``),
                sent with this rank's ``done``; the daemon's retention (``keep_best``,
                the ``best`` pointer) judges by them. See also :meth:`add_metrics`.
            run: ckptd only: the run this save's ``begin`` names, over the
                constructor's ``run`` (NeMo-RL: the driver's ``CheckpointManager.run``).

        Raises:
            CheckpointerNotInitialized: before :meth:`init_checkpointer` (an
                ``AssertionError`` and a ``RuntimeError``).
            ValueError: ``checkpointing_cfg`` is None.
            TypeError: neither ``checkpointing_cfg`` nor ``is_final_checkpoint`` given.
            SaveRefused: with the daemon, it refused the step's ``begin`` on some rank
                (e.g. ``already_promoted``): raised on every rank, before anything of
                the save is written.
            ValueError: with the daemon, ``optimizer_path`` or ``tokenizer_path`` is not
                inside the step's tmp directory, or the daemon writes the step elsewhere;
                on an ``s3://`` root, no daemon, or a save that would consolidate.
            BaseException: whatever the Checkpointer raises, including the previous
                upload's failure; the daemon is told this step failed first.
        """
        logger.info("saving checkpoint to %s", weights_path)
        checkpointer = self._require("saving checkpoint")
        if checkpointing_cfg is not _UNSET:
            if checkpointing_cfg is None:
                raise ValueError("checkpointing_cfg must be provided when saving checkpoint")
            updates = legacy_save_updates(checkpointing_cfg, lora_enabled, peft_config)
            peft_config = updates.get("peft_config")
            self.update_checkpointer_config(updates, _infer_checkpoint_root(weights_path))
        elif is_final_checkpoint is None:
            raise TypeError(
                "save_checkpoint() needs is_final_checkpoint=... (or, as NeMo-RL's previous "
                "API, checkpointing_cfg=...)"
            )
        staged = None
        if is_object_url(weights_path):  # the Checkpointer writes the rank's stand-in
            staged, weights_path, optimizer_path, tokenizer_path = stage_save(
                weights_path, optimizer_path, tokenizer_path, self._tmp_prefix
            )
        if not self._agreed and locate_step(weights_path, self._tmp_prefix) is not None:
            self._agreed = True
            if not agree(self._tracker is not None):
                self._tracker = None
        tracker = self._tracker
        if staged is not None:
            saving_optimizer = optimizer_path is not None and optimizer is not None
            dirs = (weights_path, optimizer_path if saving_optimizer else None)
            prepare_staged(staged, checkpointer, tracker, is_final_checkpoint, dirs)
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
        paths = (weights_path, optimizer_path, tokenizer_path)
        try:
            step = tracker.begin(*paths, run or self._run, staged=staged) if tracker else None
        except BaseException:
            if staged is not None:
                staged.discard()  # refused on some rank: nothing of it is uploaded
            raise
        if step is not None and metrics:
            step.handle.add_metrics(metrics)
        try:
            checkpointer.save_model(
                model=model,
                weights_path=weights_path,
                peft_config=peft_config,
                tokenizer=tokenizer if tokenizer_path is None else None,
                is_final_checkpoint=bool(is_final_checkpoint),
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

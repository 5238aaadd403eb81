"""Loading a checkpoint: the reference's load methods, which ckptd leaves as they are.

Loading reads a promoted ``step_N`` (or a LoRA adapter) through the ``Checkpointer``; the
daemon has no part in it. A path in an ``s3://`` root (a committed checkpoint's URL, from
``orchestrator.latest``) is fetched to a local copy first (``_fetching.py``).
:class:`LoadingMixin` holds these methods for
:class:`~orchestrator.automodel.AutomodelCheckpointManager`, whose saving side
(``_manager.py``) is where ckptd comes in.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ._dtypes import MasterWeightDtypeError, describe_drift, master_weight_drift
from ._fetching import fetched
from ._generations import loading_config
from ._lora import _resolve_lora_adapter_dir, peft_load_dir

if TYPE_CHECKING:
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer

__all__ = ["CheckpointerNotInitialized", "LoadingMixin"]

logger = logging.getLogger("orchestrator.automodel")


class CheckpointerNotInitialized(AssertionError, RuntimeError):
    """The manager was used before ``init_checkpointer``.

    Both an ``AssertionError`` (what NeMo-RL's module raises, and its tests expect) and a
    ``RuntimeError`` (what an assertion-free check raises), so either ``except`` works.
    """


class LoadingMixin:
    """The load methods of :class:`~orchestrator.automodel.AutomodelCheckpointManager`.

    A mixin: the manager sets both attributes in its constructor.

    Attributes:
        checkpointer: The underlying nemo_automodel ``Checkpointer`` (None until
            ``init_checkpointer``).
        moe_mesh: Optional MoE device mesh.
    """

    checkpointer: Checkpointer | None
    moe_mesh: DeviceMesh | None

    def load_lora_adapter(self, model: nn.Module, adapter_dir: str) -> None:
        """Load validated donor adapter weights through the PEFT checkpointer path.

        Args:
            model: Model whose LoRA adapters will be initialized.
            adapter_dir: An adapter directory, a checkpoint's ``policy/weights``
                directory, or its ``model`` subdirectory.

        Raises:
            RuntimeError: the checkpointer was not initialized with ``is_peft=True``.
            FileNotFoundError: no adapter there (see :func:`_resolve_lora_adapter_dir`).
        """
        checkpointer = self._require("warm starting LoRA adapters")
        if not checkpointer.config.is_peft:
            raise RuntimeError(
                "the checkpointer must be initialized with is_peft=True before warm "
                "starting LoRA adapters"
            )
        with fetched(adapter_dir) as (local,):
            assert local is not None
            resolved = os.path.abspath(_resolve_lora_adapter_dir(local))
            with peft_load_dir(resolved) as load_dir:
                checkpointer.load_model(model=model, model_path=load_dir)
        logger.info("warm-started LoRA adapters from %s", adapter_dir)

    def load_checkpoint(
        self,
        model: nn.Module,
        weights_path: str,
        optimizer: torch.optim.Optimizer | None = None,
        optimizer_path: str | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    ) -> None:
        """Load a checkpoint into the model using Automodel's Checkpointer.

        The model is read from ``weights_path/model`` (or ``weights_path`` itself when
        it ends in ``model``) in the format and PEFT-ness found on disk
        (``detect_checkpoint_format``), whatever the save configuration says; that
        configuration is left as it was. Optimizer (and scheduler) state is loaded only
        if ``optimizer`` and ``optimizer_path`` are given. An optimizer that keeps master weights
        (``optimizer.master_weights``) is checked with :meth:`check_master_weight_dtypes`
        first.

        Args:
            model: The model to load weights into.
            weights_path: The checkpoint's weights path (``step_N/policy/weights``; in an
                ``s3://`` root, the committed URL's ``.../policy/weights``, fetched first).
            optimizer: Optional optimizer to load state into.
            optimizer_path: Optional optimizer checkpoint path.
            scheduler: Optional learning-rate scheduler.

        Raises:
            CheckpointerNotInitialized: before ``init_checkpointer``.
            MasterWeightDtypeError: the optimizer's master-weight dtype drifted.
        """
        logger.info("loading weights from %s", weights_path)
        checkpointer = self._require("loading checkpoint")
        optimizer_path = optimizer_path if optimizer is not None else None
        with fetched(weights_path, optimizer_path) as (local_weights, local_optimizer):
            assert local_weights is not None
            self._load_local(
                checkpointer, model, local_weights, optimizer, local_optimizer, scheduler
            )

    def _load_local(
        self,
        checkpointer: Checkpointer,
        model: nn.Module,
        weights_path: str,
        optimizer: torch.optim.Optimizer | None,
        optimizer_path: str | None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    ) -> None:
        # A path already ending in model is the model directory (NeMo-RL passes either).
        name = os.path.basename(os.path.normpath(weights_path))
        model_dir = weights_path if name == "model" else os.path.join(weights_path, "model")
        with loading_config(checkpointer, weights_path):
            checkpointer.load_model(model=model, model_path=model_dir)
        if optimizer_path and optimizer is not None:
            if getattr(optimizer, "master_weights", False):
                self.check_master_weight_dtypes(model, optimizer, optimizer_path)
            checkpointer.load_optimizer(
                optimizer=optimizer, model=model, weights_path=optimizer_path, scheduler=scheduler
            )

    def check_master_weight_dtypes(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, optimizer_path: str
    ) -> None:
        """Hard-error if a resumed optimizer's on-disk master dtype has drifted.

        Reads the master-weight (``...master_param``) dtypes from the optimizer
        checkpoint's DCP metadata and compares them with what the live optimizer would
        load into. Must run before ``load_optimizer``: FP32 masters must not be silently
        cast into int16 remainders of BF16 parameters (or the reverse) because
        ``store_param_remainders`` / ``master_weight_dtype`` changed between save and
        resume. Passes when the dtypes match, and when either side has no master weights.

        Args:
            model: The model the optimizer updates.
            optimizer: The live optimizer.
            optimizer_path: The optimizer checkpoint (``step_N/policy/optimizer``).

        Raises:
            MasterWeightDtypeError: a ``ValueError`` naming the entry, the checkpoint's
                dtype and the optimizer's.
            FileNotFoundError: no optimizer checkpoint at ``optimizer_path``.
        """
        is_peft = bool(self.checkpointer.config.is_peft) if self.checkpointer else False
        with fetched(optimizer_path) as (local,):
            assert local is not None
            drift = master_weight_drift(
                model,
                optimizer,
                local,
                is_peft=is_peft,
                has_expert_parallelism=self.moe_mesh is not None,
            )
        if drift:
            raise MasterWeightDtypeError(describe_drift(drift, optimizer_path))

    # -- plumbing -------------------------------------------------------------------------

    def _require(self, doing: str) -> Checkpointer:
        if self.checkpointer is None:
            raise CheckpointerNotInitialized(
                f"Checkpointer must be initialized before {doing}. Call init_checkpointer() first."
            )
        return self.checkpointer

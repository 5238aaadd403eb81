"""``CheckpointManager``: torchtitan 0.3.0's checkpoint manager, its steps promoted by ckptd.

A subclass of ``torchtitan.components.checkpointer.dcp.CheckpointManager`` that changes
only where a step's files go and who renames and deletes. Everything else is
torchtitan's own code, run as it is: the interval rule, ``last_step``, the log lines,
the staging and upload futures the trainer waits on, loading and its resume rule (the
highest ``step-N`` holding ``.metadata`` or an HF index).

With a daemon serving the folder (probed once, in the constructor, agreed by every
rank), each save is written into the root's staged directory (``tmp_step_N``, which
torchtitan's ``step-N`` search cannot match), begun with and reported to the
daemon, which renames it to ``step-N`` once every rank's files have landed and been
verified, moves ``latest`` and retires old steps by the root's policy (the table
:func:`~orchestrator.torchtitan.root_toml` writes for ``keep_latest_k``). The trainer
never deletes. Without one, it is torchtitan's own manager, and says so once.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torchtitan.components.checkpointer import dcp as _titan
from torchtitan.components.checkpointer.dcp import AsyncMode
from torchtitan.tools.utils import GarbageCollection

from .._errors import DaemonError
from .._steps import Found
from .._tiers import decided, has_fast_tier
from ._daemon import Daemon, connect
from ._saves import Saves

if TYPE_CHECKING:
    from .._client import CheckpointClient

__all__ = ["AsyncMode", "CheckpointManager", "staging_options"]

logger = logging.getLogger("orchestrator.torchtitan")

_STEP_NAME = re.compile(r"step-(\d+)")


def staging_options() -> StagingOptions:
    """The pinned-memory staging options of torchtitan, as far as this host can use them.

    With an accelerator: torchtitan's own (pinned memory, shared memory, asynchronous,
    non-blocking copies). Without one, DCP refuses pinned memory and non-blocking
    copies (``Non-blocking copy requires that the current accelerator is available``),
    so those two are off and the rest is the same.
    """
    accelerated = torch.accelerator.is_available()
    return StagingOptions(
        use_pinned_memory=accelerated,
        use_shared_memory=True,
        use_async_staging=True,
        use_non_blocking_copy=accelerated,
    )


class CheckpointManager(_titan.CheckpointManager):  # type: ignore[misc]  # untyped base
    """torchtitan's ``CheckpointManager``, with ckptd promoting and retiring its steps.

    Selected in a torchtitan config with
    ``checkpoint=orchestrator.torchtitan.CheckpointManager.Config(...)``; the fields,
    and so the ``--checkpoint.*`` flags, are torchtitan's. The constructor takes
    torchtitan's arguments, and one of its own.

    Args:
        config: torchtitan's checkpoint config.
        dataloader: As torchtitan's.
        model_parts: As torchtitan's.
        optimizers: As torchtitan's.
        lr_schedulers: As torchtitan's.
        states: As torchtitan's.
        sd_adapter: As torchtitan's.
        base_folder: As torchtitan's (``dump_folder``).
        client: The daemon client; default one on ``$CKPTD_SOCKET`` (else ckptd's
            default socket), made if a daemon answers there, and closed by
            :meth:`close`.

    Raises:
        ValueError: torchtitan's, for a config it refuses; and a daemon that serves the
            folder with a layout torchtitan cannot resume from (the message gives the
            root's table).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(_titan.CheckpointManager.Config):  # type: ignore[misc]  # untyped base
        """torchtitan's checkpoint config (the same fields); builds the ckptd manager."""

        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """DCP save mode: synchronous, threaded async, or pinned-memory async. Each goes
        through the daemon when one serves the folder."""

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
        client: CheckpointClient | None = None,
    ) -> None:
        self._saves: Saves | None = None
        self._closed = False
        self._resume: Found | None = None  # while loading: the daemons' decision
        super().__init__(
            config,
            dataloader=dataloader,
            model_parts=model_parts,
            optimizers=optimizers,
            lr_schedulers=lr_schedulers,
            states=states,
            sd_adapter=sd_adapter,
            base_folder=base_folder,
        )
        if not self.enable:
            return
        daemon = connect(self.folder, self.keep_latest_k, client)
        if daemon is not None:
            self._saves = Saves(daemon)

    @property
    def uses_daemon(self) -> bool:
        """Whether the daemon promotes and retires this folder's steps."""
        return getattr(self, "_saves", None) is not None

    @property
    def daemon(self) -> Daemon | None:
        """The daemon that promotes this folder's steps, if one does."""
        saves: Saves | None = getattr(self, "_saves", None)
        return None if saves is None else saves.daemon

    # -- torchtitan's hooks ----------------------------------------------------------------

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Save ``curr_step`` as torchtitan does; with the daemon, a stager this host can run."""
        if (
            self._saves is not None
            and self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM
            and getattr(self, "stager", None) is None
            and not last_step
            and self._should_save(curr_step, last_step)
        ):
            self.stager = DefaultStager(staging_options())
        saved: bool = super()._save(curr_step, last_step)
        return saved

    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Any:
        """Save as torchtitan does; with the daemon, into the step's staged directory.

        Args:
            state_dict: The state dict to save.
            checkpoint_id: torchtitan's ``folder/step-N``; with the daemon, the step is
                written into the root's staged ``tmp_step_N`` instead and renamed to
                this name by the daemon once complete.
            async_mode: How: synchronously, or with either async mode.
            enable_garbage_collection: Collect garbage after the save, as torchtitan.
            to_hf: Save HF safetensors through ``sd_adapter`` (the last step).

        Returns:
            As torchtitan's: None (synchronous), a future (``async``), or an
            ``AsyncSaveResponse`` (``async_with_pinned_mem``).
        """
        step = self._step_of(checkpoint_id)
        if self._saves is None or step is None:
            return super().dcp_save(
                state_dict,
                checkpoint_id=checkpoint_id,
                async_mode=async_mode,
                enable_garbage_collection=enable_garbage_collection,
                to_hf=to_hf,
            )
        result: Any = None
        if to_hf:
            assert self.sd_adapter is not None, "sd_adapter is required for to_hf=True"
            hf_state_dict = self.sd_adapter.to_hf(state_dict)
            self._saves.save_hf(hf_state_dict, step, self.sd_adapter.fqn_to_index_mapping)
        elif async_mode == AsyncMode.ASYNC:
            result = self._saves.start(state_dict, step, self.pg)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            result = self._saves.start(
                state_dict,
                step,
                self.pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self.stager,
            )
        else:
            self._saves.save(state_dict, step)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return result

    def _load(self, step: int = -1) -> bool:
        """Load as torchtitan does; on a root with a fast tier, the step the daemons decided.

        With the daemon serving a root with a fast tier, the newest step (``step=-1``)
        is the one the daemons decided for the run (``restore``, docs/tiers.md): its
        copy in this node's fast tier when every node holds what its ranks read, else
        the durable root's. Without a daemon answering, or a fast tier, or for a
        given step, torchtitan's own search of the folder (its ``step-N`` holding
        ``.metadata``) decides, as without ckptd.
        """
        self._resume = self._decided() if step == -1 else None
        try:
            loaded: bool = super()._load(step)
        finally:
            self._resume = None
        return loaded

    def _find_load_step(self, folder: str = "") -> int:
        """The highest ``step-N`` (torchtitan's search); while resuming, the decided step."""
        resume: Found | None = getattr(self, "_resume", None)
        if resume is not None and not folder:
            return resume.step
        found: int = super()._find_load_step(folder)
        return found

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        """The ``folder/step-N`` torchtitan names; while resuming from a decision, its directory."""
        resume: Found | None = getattr(self, "_resume", None)
        if resume is not None and not folder and step == resume.step:
            return resume.path
        name: str = super()._create_checkpoint_id(step, folder)
        return name

    def _decided(self) -> Found | None:
        """The daemons' decision for a root with a fast tier; None: torchtitan's search."""
        saves = getattr(self, "_saves", None)
        if saves is None or not has_fast_tier(saves.daemon.root):
            return None
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        try:
            found = decided(saves.daemon.root, saves.daemon.client, rank=rank, world_size=world)
        except DaemonError as exc:
            logger.warning(
                "ckptd: no restore decision for %s (%s); torchtitan's search of the folder decides",
                saves.daemon.root,
                exc,
            )
            return None
        # Nothing in either tier: a fresh start (torchtitan's initial load, if any).
        return found if found is not None else Found(step=-1, path="")

    def _should_purge(self) -> bool:
        """Purge by torchtitan's rule without the daemon; with it, never: the daemon retires."""
        if getattr(self, "_saves", None) is not None:
            return False
        purge: bool = super()._should_purge()
        return purge

    def _close(self) -> None:
        """Close as torchtitan does; then this process's saves are reported to the daemon."""
        if self._closed:
            return
        self._closed = True
        super()._close()
        if self._saves is not None:
            self._saves.daemon.close()

    # -- helpers ---------------------------------------------------------------------------

    def _step_of(self, checkpoint_id: str) -> int | None:
        """The step whose checkpoint ``checkpoint_id`` names in this folder, or None."""
        match = _STEP_NAME.fullmatch(os.path.basename(checkpoint_id))
        if match is None:
            return None
        step = int(match.group(1))
        return step if checkpoint_id == self._create_checkpoint_id(step) else None

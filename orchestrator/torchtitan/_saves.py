"""torchtitan's three kinds of DCP save, each begun with and reported to the daemon.

What ``CheckpointManager.dcp_save`` does for a step when the daemon promotes it:

- ``async`` and ``async_with_pinned_mem``: :func:`orchestrator.async_save` (DCP's thread
  writer, or its process writer with torchtitan's stager), which begins the step, gates
  the writes on the daemon's acknowledgement and reports ``done`` with the rank's shards
  when the upload lands;
- ``disabled`` and the last step: a synchronous ``dcp.save`` into the staged directory,
  its planner waiting for the acknowledgement first (a refusal fails the save on every
  rank before any write), then ``done`` with the rank's shards from the save's result;
- the last step in HF safetensors (``last_save_in_hf``): the same, through DCP's
  ``HuggingFaceStorageWriter`` and, for a sharded model, torchtitan's consolidation on
  every rank. These files have no DCP ``.metadata`` to name them, so rank 0 reports every
  file the save left in the step's directory, once every rank's part is written (the
  save's last collective, and consolidation's closing barrier, say so).

Nothing here runs unless the ranks agreed on the daemon (``_daemon.connect``).
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint._consolidate_hf_safetensors import (
    consolidate_safetensors_files_on_every_rank,
)
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from .._dcp import AfterBeginPlanner, async_save
from .._tracking import SaveHandle, describe
from ..protocol import FileEntry
from ._daemon import Daemon

__all__ = ["Saves", "files_under"]

_OWN = ".ckptd-"
"""Names the daemon gives its own files in a step (the attempt marker, the manifest)."""
_SHARDED = "sharded"
"""torchtitan's subdirectory for a sharded HF save before consolidation."""


def files_under(path: str) -> list[FileEntry]:
    """Every file below ``path`` but the daemon's own, relative to it, with its size."""
    found = []
    for directory, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(_OWN)]
        for name in names:
            if name.startswith(_OWN):
                continue
            full = os.path.join(directory, name)
            found.append(FileEntry(os.path.relpath(full, path), os.stat(full).st_size))
    return sorted(found, key=lambda entry: entry.path)


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1  # DCP's own single-process save


class Saves:
    """One folder's saves through the daemon.

    Args:
        daemon: The daemon that promotes the folder's steps.
    """

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def begin(self, step: int) -> SaveHandle:
        """Begin this rank's part of ``step`` (not waited for: the save's planner waits)."""
        rank, world = _rank_world()
        return self.daemon.client.save(self.daemon.root, step, rank, world, wait=False)

    def start(self, state_dict: dict[str, Any], step: int, pg: Any, **kwargs: Any) -> Any:
        """An asynchronous save of ``step`` (torchtitan's ``async`` modes).

        Args:
            state_dict: What to save.
            step: The step.
            pg: torchtitan's gloo group for checkpoints.
            **kwargs: Passed to ``dcp.async_save`` (the process writer and its stager).

        Returns:
            What ``dcp.async_save`` returned: a future, or an ``AsyncSaveResponse``.
        """
        return async_save(
            state_dict,
            root=self.daemon.root,
            step=step,
            client=self.daemon.client,
            process_group=pg,
            **kwargs,
        )

    def save(self, state_dict: dict[str, Any], step: int) -> None:
        """A synchronous ``dcp.save`` of ``step`` into its staged directory, reported.

        Raises:
            BaseException: what ``dcp.save`` raises (a refused step: its
                ``CheckpointException``, on every rank); the daemon is told first.
        """
        handle = self.begin(step)
        try:
            metadata = dcp_save(
                state_dict, checkpoint_id=handle.path, planner=AfterBeginPlanner(handle)
            )
        except BaseException as exc:  # CheckpointException derives from BaseException
            handle.fail(f"dcp.save raised {describe(exc)}")
            raise
        landed: Future[Any] = Future()
        landed.set_result(metadata)
        handle.add(landed, dcp_dir=".", group_rank=_rank_world()[0])
        handle.seal()

    def save_hf(self, hf_state_dict: dict[str, Any], step: int, fqn_to_index_mapping: Any) -> None:
        """Save torchtitan's HF safetensors of ``step`` (already converted), reported.

        Args:
            hf_state_dict: The state dict in HF names (``sd_adapter.to_hf``).
            step: The step.
            fqn_to_index_mapping: The adapter's; with one, the shards are written to
                ``sharded/`` and consolidated on every rank, as torchtitan does.

        Raises:
            BaseException: what the save or the consolidation raises; the daemon is
                told first.
        """
        handle = self.begin(step)
        path = handle.path
        writer = HuggingFaceStorageWriter(
            path=os.path.join(path, _SHARDED) if fqn_to_index_mapping else path,
            save_distributed=True,
            fqn_to_index_mapping=fqn_to_index_mapping,
            enable_consolidation=not fqn_to_index_mapping,
        )
        try:
            dcp_save(hf_state_dict, storage_writer=writer, planner=AfterBeginPlanner(handle))
            if fqn_to_index_mapping:
                consolidate_safetensors_files_on_every_rank(
                    input_dir=os.path.join(path, _SHARDED),
                    output_dir=path,
                    fqn_to_index_mapping=fqn_to_index_mapping,
                    num_threads=5,
                )
            files = files_under(path) if _rank_world()[0] == 0 else []
        except BaseException as exc:
            handle.fail(f"the HF safetensors save raised {describe(exc)}")
            raise
        handle.add_files(files)
        handle.seal()

"""Which files of a Trainer checkpoint each rank reports.

transformers' ``_save_checkpoint`` writes one directory from every rank at once:

- the process that saves (``args.should_save``, rank 0) writes the model
  (``model.safetensors`` or its shards and index, ``config.json``,
  ``generation_config.json``, ``training_args.bin``, a tokenizer or processor),
  ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt`` and ``trainer_state.json``;
- every rank writes its own ``rng_state_{rank}.pth`` (``rng_state.pth`` alone);
- with FSDP's sharded state dict (accelerate), every rank writes its shards
  ``__{rank}_{i}.distcp`` of ``pytorch_model_fsdp_0/`` and ``optimizer_0/``, and rank 0
  their ``.metadata``; the daemon verifies those directories as DCP checkpoints.

A rank reports what it wrote, found by name, so no rank waits for another and none
reports a file another rank may still be writing: its own RNG state and DCP shards,
and, for the saving process, everything else but the other ranks' RNG states and
shards (DeepSpeed's per-rank ``zero_pp_rank_R_`` files likewise).
"""

from __future__ import annotations

import os
import re
from typing import Final

from ..protocol import FileEntry

__all__ = ["files_of_rank"]

_OWN: Final = ".ckptd-"
"""Names the daemon gives its own files in a step (the attempt marker, node markers)."""
_PER_RANK: Final = (
    re.compile(r"rng_state_(\d+)\.pth"),
    re.compile(r"__(\d+)_\d+\.distcp"),
    re.compile(r"(?:.*_)?zero_pp_rank_(\d+)_.*"),
)
"""Files that one rank writes, the rank's number in the first group."""


def writer_of(name: str) -> int | None:
    """The rank that writes a file of this name, when its name says; None otherwise."""
    for pattern in _PER_RANK:
        match = pattern.fullmatch(name)
        if match is not None:
            return int(match.group(1))
    return None


def files_of_rank(path: str, rank: int, *, saves: bool) -> list[FileEntry]:
    """The files in ``path`` that ``rank`` wrote, relative to it, with their sizes.

    Args:
        path: The step's staged directory.
        rank: This process's rank (``args.process_index``).
        saves: Whether this process saves the shared files (``args.should_save``).

    Returns:
        Sorted by path; empty when the rank wrote nothing that is there.
    """
    found: list[FileEntry] = []
    for directory, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(_OWN)]
        for name in names:
            if name.startswith(_OWN):
                continue
            writer = writer_of(name)
            if writer is None and name == "rng_state.pth":
                writer = 0
            if writer is None and not saves:
                continue
            if writer is not None and writer != rank:
                continue
            full = os.path.join(directory, name)
            try:
                size = os.stat(full).st_size
            except FileNotFoundError:
                continue  # a temporary file renamed meanwhile: its final name is listed
            found.append(FileEntry(os.path.relpath(full, path), size))
    return sorted(found, key=lambda entry: entry.path)

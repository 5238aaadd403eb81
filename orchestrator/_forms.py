"""The files one rank's DCP save wrote, whatever the save's form, for its ``done``.

A rank reports every file it wrote, so that the daemon checks each before it promotes
the step. Which files those are depends on how DCP wrote them (torch 2.13):

- **global metadata** (the default): the save's ``Metadata`` names every shard; rank
  ``R`` (in the checkpoint group) wrote ``__R_*.distcp``, and the coordinator also wrote
  ``.metadata``;
- **per-rank metadata** (``use_collectives=False``): the ``Metadata`` the rank's save
  returns names its own shards, and the rank wrote ``__R.metadata`` beside them (no
  ``.metadata``). Told apart by what is on disk when the upload completed (on a
  filesystem root; on an object store the global form is assumed);
- **safetensors** (``HuggingFaceStorageWriter``): the ``Metadata`` has no storage data,
  so the rank's files are taken from the directory by the writer's naming: rank ``R``
  wrote ``shard-{R+1:05d}-model-*.safetensors`` (in the directory, or in its ``sharded/``
  when the save is consolidated); the coordinator also wrote the consolidated
  ``model-*.safetensors`` and the ``*.safetensors.index.json`` (with consolidation, or
  when it saved alone).

Runs on the thread that completes the upload (or the caller's, for a finished save),
never the training thread of an asynchronous save.
"""

from __future__ import annotations

import os
import re
from typing import Any, Final

from ._objstore import is_object_url
from .protocol import FileEntry

__all__ = ["files_from_metadata", "files_written"]

_GLOBAL: Final = ".metadata"
_SHARDED: Final = "sharded"
_CONSOLIDATED: Final = re.compile(r"model-\d+-of-\d+\.safetensors")


def files_from_metadata(result: Any, dcp_dir: str, group_rank: int) -> list[FileEntry]:
    """The shard files a DCP save's result says ``group_rank`` wrote, with minimum sizes.

    Args:
        result: The ``Metadata`` a DCP save future resolves to (anything else gives []).
        dcp_dir: The DCP directory, relative to the step's tmp directory.
        group_rank: The writer's rank in the checkpoint process group; DCP names its
            shards ``__{group_rank}_{n}.distcp``. The coordinator (0) also wrote
            ``.metadata``.

    Returns:
        One entry per file.
    """
    storage = getattr(result, "storage_data", None)
    if not isinstance(storage, dict):
        return []
    prefix = f"__{group_rank}_"
    sizes: dict[str, int] = {}
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if isinstance(name, str) and name.startswith(prefix):
            end = int(info.offset) + int(info.length)
            sizes[name] = max(sizes.get(name, 0), end)
    entries = [FileEntry(os.path.normpath(os.path.join(dcp_dir, n)), s) for n, s in sizes.items()]
    if group_rank == 0 and storage:  # a writer with nothing in storage_data wrote none
        entries.append(FileEntry(os.path.normpath(os.path.join(dcp_dir, _GLOBAL)), 1))
    return sorted(entries, key=lambda e: e.path)


def files_written(
    result: Any, directory: str | None, dcp_dir: str, group_rank: int
) -> list[FileEntry]:
    """Every file ``group_rank``'s save into ``directory`` wrote, by the save's form.

    Args:
        result: What the save's future resolved to (DCP's ``Metadata``).
        directory: The DCP directory itself (the step's directory joined with
            ``dcp_dir``); None or an object-store URL: not looked at.
        dcp_dir: The DCP directory, relative to the step's tmp directory.
        group_rank: The writer's rank in the checkpoint process group.

    Returns:
        One entry per file, its path relative to the step's tmp directory, sorted.
    """
    local = directory is not None and not is_object_url(directory)
    storage = getattr(result, "storage_data", None)
    if isinstance(storage, dict):
        entries = files_from_metadata(result, dcp_dir, group_rank)
        own = f"__{group_rank}.metadata"
        if local and _per_rank(str(directory), own):
            entries = [e for e in entries if os.path.basename(e.path) != _GLOBAL]
            entries.append(FileEntry(os.path.normpath(os.path.join(dcp_dir, own)), 1))
        return sorted(entries, key=lambda e: e.path)
    if not local:
        return []
    return _safetensors_files(str(directory), dcp_dir, group_rank)


def _per_rank(directory: str, own: str) -> bool:
    """Whether the save into ``directory`` wrote per-rank metadata (no ``.metadata``).

    DCP writes the global ``.metadata`` before any rank's save returns, so its absence
    beside this rank's ``__R.metadata`` tells the form apart.
    """
    return os.path.isfile(os.path.join(directory, own)) and not os.path.exists(
        os.path.join(directory, _GLOBAL)
    )


def _safetensors_files(directory: str, dcp_dir: str, group_rank: int) -> list[FileEntry]:
    """The safetensors files (and index) ``group_rank`` wrote into ``directory``."""
    own = f"shard-{group_rank + 1:05d}-"
    entries: list[FileEntry] = []
    for sub in ("", _SHARDED):
        found = _listing(os.path.join(directory, sub) if sub else directory)
        for name, size in found:
            mine = name.startswith(own) and name.endswith(".safetensors")
            coordinators = group_rank == 0 and (
                _CONSOLIDATED.fullmatch(name) is not None
                or name.endswith(".safetensors.index.json")
            )
            if mine or coordinators:
                rel = os.path.join(dcp_dir, sub, name) if sub else os.path.join(dcp_dir, name)
                entries.append(FileEntry(os.path.normpath(rel), size))
    return sorted(entries, key=lambda e: e.path)


def _listing(directory: str) -> list[tuple[str, int]]:
    """Every regular file directly in ``directory`` with its size ([] if there is none)."""
    try:
        with os.scandir(directory) as it:
            return [(e.name, e.stat().st_size) for e in it if e.is_file(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []

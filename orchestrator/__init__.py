"""Trainer-side ckptd: the daemon client and the glue from DCP async saves to it.

Importing this package is light (no torch): :func:`async_save` loads torch on first use,
and the client's modules load on first use of a name from them, so that the daemon,
which imports only :mod:`orchestrator.protocol`, does not load the client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._errors import DaemonError, SaveRefused
from .protocol import FileEntry, default_socket_path

if TYPE_CHECKING:
    from ._client import CheckpointClient
    from ._dcp import AfterBeginPlanner, async_save, checkpoint_group, default_client
    from ._manager import CheckpointManager
    from ._objstore import open_file, storage_reader, storage_writer
    from ._pending import Begun, PendingBegin
    from ._sync import save
    from ._tiers import latest
    from ._tracking import SaveHandle, files_from_metadata

__all__ = [
    "AfterBeginPlanner",
    "Begun",
    "CheckpointClient",
    "CheckpointManager",
    "DaemonError",
    "FileEntry",
    "PendingBegin",
    "SaveHandle",
    "SaveRefused",
    "async_save",
    "checkpoint_group",
    "default_client",
    "default_socket_path",
    "files_from_metadata",
    "latest",
    "open_file",
    "save",
    "storage_reader",
    "storage_writer",
]

_LAZY = {
    "CheckpointClient": "._client",
    "CheckpointManager": "._manager",
    "Begun": "._pending",
    "PendingBegin": "._pending",
    "SaveHandle": "._tracking",
    "files_from_metadata": "._tracking",
    "AfterBeginPlanner": "._dcp",
    "async_save": "._dcp",
    "checkpoint_group": "._dcp",
    "default_client": "._dcp",
    "save": "._sync",
    "latest": "._tiers",
    "open_file": "._objstore",
    "storage_reader": "._objstore",
    "storage_writer": "._objstore",
}
"""Names loaded on first use, and the module each comes from."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""Trainer-side ckptd: the daemon client and the glue from DCP async saves to it.

Importing this package is light (no torch): :func:`async_save` loads torch on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._client import CheckpointClient
from ._errors import DaemonError, SaveRefused
from ._pending import Begun, PendingBegin
from ._tracking import SaveHandle, files_from_metadata
from .protocol import FileEntry, default_socket_path

if TYPE_CHECKING:
    from ._dcp import AfterBeginPlanner, async_save, checkpoint_group, default_client

__all__ = [
    "AfterBeginPlanner",
    "Begun",
    "CheckpointClient",
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
]

_TORCH_NAMES = frozenset({"AfterBeginPlanner", "async_save", "checkpoint_group", "default_client"})


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        from . import _dcp

        return getattr(_dcp, name)
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")

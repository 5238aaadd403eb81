"""Each root's layout file: how its directories are named, for clients that cannot ask.

A client names a step's directory before the daemon answers its ``begin`` (and while
the daemon is down). It learns the root's ``tmp_prefix`` from an acknowledged begin, or
else from this file, which the daemon writes into every configured root when it starts.
"""

from __future__ import annotations

import os

import msgspec

from orchestrator.protocol import LAYOUT_FILE, RootInfo

from ..config._config import RootConfig
from ._durable import write_atomic

_MAX_LAYOUT = 65536


def decode_layout(data: bytes) -> RootInfo | None:
    """A layout file's contents as :class:`RootInfo`; None if they are not one."""
    try:
        return msgspec.json.decode(data, type=RootInfo)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def read_layout(root: RootConfig) -> RootInfo | None:
    """``ROOT/.ckptd-layout.json``, if a daemon wrote it. Blocking I/O.

    Raises:
        OSError: the root cannot be read (not when it or the file is missing).
    """
    try:
        with open(os.path.join(root.path, LAYOUT_FILE), "rb") as fh:
            data = fh.read(_MAX_LAYOUT)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return decode_layout(data)


__all__ = ["decode_layout", "read_layout", "write_layout"]


def write_layout(root: RootConfig) -> bool:
    """Write ``ROOT/.ckptd-layout.json`` if it does not already say this. Blocking I/O.

    Written to a unique temporary name, fsynced and renamed over the old one, so a
    reader sees the old layout or the new one, never a part.

    Returns:
        Whether the file was (re)written.

    Raises:
        OSError: the root cannot be written.
    """
    path = os.path.join(root.path, LAYOUT_FILE)
    fast = "" if root.fast is None else root.fast.path
    info = RootInfo(root.path, root.tmp_prefix, root.final_prefix, root.pointer, root.staging, fast)
    data = msgspec.json.encode(info) + b"\n"
    try:
        with open(path, "rb") as fh:
            if fh.read(65536) == data:
                return False
    except OSError:
        pass
    write_atomic(path, data, sync_dir=False)  # rewritten at every start if lost
    return True

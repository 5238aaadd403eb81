"""Each root's layout file: how its directories are named, for clients that cannot ask.

A client names a step's directory before the daemon answers its ``begin`` (and while
the daemon is down). It learns the root's ``tmp_prefix`` from an acknowledged begin, or
else from this file, which the daemon writes into every configured root when it starts.
"""

from __future__ import annotations

import os
import uuid

import msgspec

from orchestrator.protocol import LAYOUT_FILE, RootInfo

from ._config import RootConfig

__all__ = ["write_layout"]


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
    info = RootInfo(root.path, root.tmp_prefix, root.final_prefix, root.pointer)
    data = msgspec.json.encode(info) + b"\n"
    try:
        with open(path, "rb") as fh:
            if fh.read(65536) == data:
                return False
    except OSError:
        pass
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    return True

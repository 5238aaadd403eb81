"""Which root an operator's command names, and refusing a path that names none.

A command that reads a root (``ls``, ``latest``) takes a root the running daemon serves,
with the daemon's naming, or, the daemon down or serving other roots, a root a daemon
once served: one holding the ``.ckptd-layout.json`` every daemon writes into each of its
roots at start-up, whose naming it records. Any other path is refused before anything
is read from it (:class:`daemon.base._errors.UnknownRoot`): a mistyped path or a
directory that is no root gets an error naming it, never an empty listing.

Commands that ask the daemon about a root (``gc``, ``promote``, ``pin``...) are answered
by the daemon, which refuses a root it does not serve (``root_not_configured``, naming
it); :func:`require_present` refuses, before that, a local path that does not exist.
"""

from __future__ import annotations

import os
from typing import Any

from orchestrator.protocol import LAYOUT_FILE

from ..base._errors import UnknownRoot
from ..config._config import RootConfig
from ..config._root import abspath
from ..config._s3 import is_s3_url
from ..store._storage import Storage

__all__ = ["require_present", "resolve_root"]


def resolve_root(
    storage: Storage, given: str, status: dict[str, Any] | None, socket: str
) -> RootConfig:
    """The root ``given`` names, with its directory names.

    Args:
        storage: Where the root is read.
        given: The path or ``s3://`` URL the operator typed.
        status: The daemon's ``status`` reply; None when it does not answer.
        socket: The daemon's socket, for the error message.

    Raises:
        UnknownRoot: ``given`` does not exist, or is not a root (see the module).
        OSError: the root cannot be read (an object store's error says why).
    """
    path = abspath(given)
    real = path if is_s3_url(path) else os.path.realpath(path)
    served = [layout["path"] for layout in (status or {}).get("layouts", [])]
    for layout in (status or {}).get("layouts", []):
        if layout["path"] in (path, real):
            names = {k: layout[k] for k in ("tmp_prefix", "final_prefix", "pointer")}
            return RootConfig(path=real, real=real, staging=layout.get("staging", ""), **names)
    require_present(storage, path)
    found = storage.read_layout(RootConfig(path=real, real=real))
    if found is not None:
        return RootConfig(
            path=real,
            real=real,
            tmp_prefix=found.tmp_prefix,
            final_prefix=found.final_prefix,
            pointer=found.pointer,
            staging=found.staging,
        )
    if status is None:
        daemon = f"the daemon at {socket} does not answer"
    else:
        daemon = f"the daemon at {socket} serves {', '.join(served) or 'no root'}"
    raise UnknownRoot(
        f"{path} is not a checkpoint root: {daemon}, and it holds no {LAYOUT_FILE} "
        "(a daemon writes one into each root it serves); name a configured root"
    )


def require_present(storage: Storage, path: str) -> None:
    """Refuse a local ``path`` that does not exist (an ``s3://`` URL is not looked at).

    Raises:
        UnknownRoot: nothing is at ``path``.
    """
    if not is_s3_url(path) and not storage.present(path):
        raise UnknownRoot(f"{path}: no such file or directory")

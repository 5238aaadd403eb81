"""The fast tiers' coordination directory on the durable root: small JSON facts.

Nodes of one job agree on their fast tiers the way they agree on durable saves: through
files on the shared root, here under ``ROOT/.ckptd-tiers/``:

- ``parts/step_N/NODE.json``: the node's sealed part of step N (:class:`Part`); step N
  is complete in the fast tier once the parts of one run cover every rank.
- ``drains/step_N.json``: the leader's order that step N be drained (every node copies
  its part, then commits by the usual rules).
- ``restore/RUN/NODE.json``: a restarting node's ranks and what its tier holds;
  ``restore/RUN/decision.json``: the one step every rank of run RUN restores, written
  once (create-only) by the node serving rank 0.

Every write is a unique temp file, fsync, rename and directory fsync; a reader opens
each file afresh (which revalidates a caching mount's entry).
"""

from __future__ import annotations

import os
import uuid
from typing import Final, TypeVar

import msgspec

from ..config._root import RootConfig
from ._durable import fsync_dir, write_atomic

__all__ = [
    "COORD",
    "create_once",
    "list_names",
    "read_fact",
    "read_facts",
    "remove_fact",
    "write_fact",
]

COORD: Final = ".ckptd-tiers"

_F = TypeVar("_F", bound=msgspec.Struct)


def _path(root: RootConfig, rel: str) -> str:
    path = os.path.normpath(os.path.join(root.path, COORD, rel))
    if not path.startswith(os.path.join(root.path, COORD) + os.sep):
        raise ValueError(f"{rel!r} is not inside {COORD}")
    return path


def _makedirs(directory: str) -> None:
    if os.path.isdir(directory):
        return
    parent = os.path.dirname(directory)
    _makedirs(parent)
    try:
        os.mkdir(directory, 0o755)
    except FileExistsError:
        return
    fsync_dir(parent)


def write_fact(root: RootConfig, rel: str, data: bytes) -> None:
    """Write (or replace) the fact ``rel`` durably."""
    if root.on_object_store:
        from . import _tierobj

        return _tierobj.write_fact(root, rel, data)
    path = _path(root, rel)
    _makedirs(os.path.dirname(path))
    write_atomic(path, data)


def create_once(root: RootConfig, rel: str, data: bytes) -> bool:
    """Create the fact ``rel`` unless it exists; whether this call created it.

    The contents are written and flushed under a temp name, then linked to ``rel``
    (``link`` fails if the name exists, on every node's view of the filesystem).
    """
    if root.on_object_store:
        from . import _tierobj

        return _tierobj.create_once(root, rel, data)
    path = _path(root, rel)
    directory = os.path.dirname(path)
    _makedirs(directory)
    tmp = os.path.join(directory, f".{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    fsync_dir(directory)
    return True


def read_fact(root: RootConfig, rel: str) -> bytes | None:
    """The fact ``rel``'s contents; None if it does not exist."""
    if root.on_object_store:
        from . import _tierobj

        return _tierobj.read_fact(root, rel)
    try:
        with open(_path(root, rel), "rb") as f:
            return f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None


def list_names(root: RootConfig, rel: str) -> list[str]:
    """The facts in directory ``rel`` (temp files left out), sorted; [] if none."""
    if root.on_object_store:
        from . import _tierobj

        return _tierobj.list_names(root, rel)
    try:
        names = os.listdir(_path(root, rel))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(n for n in names if not n.endswith(".tmp"))


def read_facts(root: RootConfig, rel: str, kind: type[_F], *, skip: str) -> list[_F]:
    """Every fact of directory ``rel`` that decodes as ``kind`` (``skip`` left out).

    The nodes' facts beside one decision (``restore/RUN/``, ``stop/RUN/``): a fact that
    vanished or does not decode is left out, as a node that has not spoken.
    """
    facts = []
    for name in list_names(root, rel):
        if name == skip:
            continue
        data = read_fact(root, f"{rel}/{name}")
        if data is None:
            continue
        try:
            facts.append(msgspec.json.decode(data, type=kind))
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
    return facts


def remove_fact(root: RootConfig, rel: str) -> None:
    """Remove the fact (or the directory of facts) ``rel``, if there."""
    if root.on_object_store:
        from . import _tierobj

        return _tierobj.remove_fact(root, rel)
    import shutil

    path = _path(root, rel)
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

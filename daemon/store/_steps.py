"""Retention's blocking filesystem work: find checkpoints, move ``best``, retire steps.

Run in the root's lane (``daemon.store._lanes``), never on the event loop. A checkpoint is
*complete* when its ``step_N`` is a real directory holding the manifest the daemon wrote
at promotion, naming this root's step N, and is the directory that manifest was written
in (its origin, :mod:`daemon.store._origin`); anything else named ``step_N`` (a copy,
a backup restored, a trainer's own directory) is never retired. Retiring a step is one rename of
``step_N`` into ``ROOT/.ckptd-trash/delete/`` as ``step_N.retired-<suffix>``; the
background remover (``daemon.store._trash``) deletes it from there.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import re
import uuid
from collections.abc import Iterable
from datetime import datetime
from typing import Any, Final

import msgspec

from ..config._config import RootConfig
from ..config._retention import MAX_METRICS
from . import _gc
from ._attempts import read_marker
from ._durable import fsync_dir, write_atomic
from ._markers import NODE_PREFIX, NodeMarker
from ._origin import Origin, origin
from ._promote import read_pointer
from ._verify import MANIFEST_NAME

__all__ = [
    "TRAINING_INFO",
    "Found",
    "ManifestCache",
    "doomed_step",
    "free_space",
    "leader_node",
    "promoted_durably",
    "read_named_pointer",
    "remove_pointer",
    "retire",
    "scan",
    "training_info_metrics",
    "write_pointer",
]

TRAINING_INFO: Final = "training_info.json"
"""NeMo-RL's file of the step's training state, at the top of the step's directory."""

_MAX_INFO: Final = 1024 * 1024
_HEAD_BYTES: Final = 64 * 1024
_METRIC: Final = re.compile(r"^[A-Za-z0-9_.:/@+-]{1,128}$")
_RETIRED: Final = ".retired-"


class _Head(msgspec.Struct, frozen=True):
    """The fields of a manifest retention reads."""

    root: str = ""
    step: int = -1
    created: str = ""
    origin: Origin | None = None
    attempt: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Found:
    """One ``step_N`` of a root, as the disk shows it."""

    step: int
    complete: bool
    promoted_at: float = 0.0
    """When its manifest was written (wall-clock seconds)."""
    attempt: str = ""
    """The attempt its manifest names."""


ManifestCache = dict[tuple[str, int], tuple[tuple[int, ...], Found]]
"""What each manifest said, by (root, step), with the manifest's (dev, inode, mtime) and
its directory's origin (inode, birth) it was read at."""


def scan(root: RootConfig, cache: ManifestCache) -> list[Found]:
    """Every ``step_N`` directory entry of ``root``, by step. Blocking I/O.

    A manifest is read once (``cache``), then only stat'ed: a large checkpoint's manifest
    lists every file, and a root holds many checkpoints.
    """
    found: list[Found] = []
    with os.scandir(root.path) as entries:
        names = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
    seen: set[int] = set()
    for name, is_dir in names:
        step = root.parse_step(name, root.final_prefix)
        if step is None:
            continue
        seen.add(step)
        if not is_dir:
            found.append(Found(step, complete=False))
            continue
        found.append(_facts(root, step, cache))
    for key in [k for k in cache if k[0] == root.path and k[1] not in seen]:
        del cache[key]
    return sorted(found, key=lambda f: f.step)


def _facts(root: RootConfig, step: int, cache: ManifestCache) -> Found:
    final = root.final_dir(step)
    path = os.path.join(final, MANIFEST_NAME)
    try:
        st = os.lstat(path)
        here = origin(final)
    except OSError:
        return Found(step, complete=False)
    # The directory's origin is in the stamp: a copy restored where its original was
    # may get the original's inode numbers back, and ``cp -a`` keeps the mtime.
    stamp = (st.st_dev, st.st_ino, st.st_mtime_ns, here.ino, here.born_ns)
    cached = cache.get((root.path, step))
    if cached is not None and cached[0] == stamp:
        return cached[1]
    try:
        head = _read_head(path)
    except (OSError, msgspec.DecodeError):
        return Found(step, complete=False)
    complete = (
        head.step == step
        and head.root in (root.path, root.real, root.named)
        # Renamed here by a promotion, not copied in (a manifest from before origins
        # were recorded is taken as the daemon's).
        and (head.origin is None or head.origin.same(here))
    )
    facts = Found(step, complete, _when(head.created, st.st_mtime), head.attempt)
    cache[(root.path, step)] = (stamp, facts)
    return facts


def _read_head(path: str) -> _Head:
    """The manifest's root, step, creation time and attempt, without parsing its file list.

    A large checkpoint's manifest lists every file (megabytes of JSON); parsing it whole
    would hold the interpreter for tens of milliseconds. The daemon writes the manifest
    with ``files`` after the fields read here, and ``,"files":`` cannot occur inside a
    JSON string, so the part before it, closed, is the head. The attempt, written last,
    is then read from the checkpoint's attempt marker, which the promotion renamed with it.
    """
    with open(path, "rb") as fh:
        data = fh.read(_HEAD_BYTES + 1)
        if len(data) <= _HEAD_BYTES:
            return msgspec.json.decode(data, type=_Head)
        cut = data.find(b',"files":')
        if cut < 0:  # not as the daemon writes it: parse it all
            return msgspec.json.decode(data + fh.read(), type=_Head)
    head = msgspec.json.decode(data[:cut] + b"}", type=_Head)
    marker = read_marker(os.path.dirname(path))
    return msgspec.structs.replace(head, attempt=marker.attempt if marker is not None else "")


def _when(created: str, fallback: float) -> float:
    try:
        return datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return fallback


def promoted_durably(root: RootConfig, step: int) -> bool:
    """Whether ``step_N`` is a checkpoint of ``root``'s step N, durably. Blocking I/O.

    For a node with no save of the step, which cannot know how its ``step_N`` came to
    be (another node's daemon renamed it on a shared root; an earlier run, whose state
    is gone, promoted it): it holds the manifest a promotion writes and fsyncs before
    its rename, naming this root and step, and the root is fsynced here and now, so
    that the rename (another daemon's, perhaps not yet flushed) survives a crash from
    here on. A directory made by hand, or a copy of another step, is not one.
    """
    try:
        head = _read_head(os.path.join(root.final_dir(step), MANIFEST_NAME))
    except (OSError, msgspec.DecodeError):
        return False
    if head.step != step or head.root not in (root.path, root.real, root.named):
        return False
    try:
        fsync_dir(root.path)
    except OSError:
        return False  # not known durable: not promoted yet, as far as this node can say
    return True


def leader_node(root: RootConfig, step: int) -> str | None:
    """The node that led promoted step ``step``, if it spanned nodes. Blocking I/O.

    A save that spans nodes leaves each node's marker in its directory, and the rename
    takes them into ``step_N``: the leader is the node whose marker holds global rank 0.
    None: no marker (a save of one node's ranks). "": markers, but none names rank 0.
    """
    markers: list[NodeMarker] = []
    try:
        with os.scandir(root.final_dir(step)) as entries:
            names = [e.path for e in entries if e.name.startswith(NODE_PREFIX)]
    except OSError:
        return None
    for path in names:
        try:
            with open(path, "rb") as fh:
                markers.append(msgspec.json.decode(fh.read(_MAX_INFO), type=NodeMarker))
        except (OSError, msgspec.DecodeError):
            continue
    if not names:
        return None
    for marker in markers:
        if "0" in marker.files:
            return marker.node
    return ""


def read_named_pointer(root: RootConfig, name: str) -> int | None:
    """The step the pointer ``name`` (a symlink, or ``name.txt``) of ``root`` names."""
    return read_pointer(dataclasses.replace(root, pointer=name))


def remove_pointer(root: RootConfig, name: str) -> bool:
    """Remove the pointer ``name`` of ``root`` if it names a step; whether it did.

    Only a pointer ckptd could have written goes: a symlink to ``step_N``, or
    ``name.txt`` holding ``step_N``. Anything else of that name stays. Blocking I/O.
    """
    if read_named_pointer(root, name) is None:
        return False
    link = os.path.join(root.path, name)
    for path in (link, f"{link}.txt"):
        if os.path.islink(path) or (path.endswith(".txt") and os.path.isfile(path)):
            os.unlink(path)
    fsync_dir(root.path)
    return True


def write_pointer(root: RootConfig, name: str, step: int) -> None:
    """Point ``ROOT/name`` at ``step_N`` atomically, then fsync the root. Blocking I/O.

    A symlink replaced by a rename; where the filesystem has no symlinks, ``name.txt``
    holding the directory's name, as ``latest`` falls back.

    Raises:
        OSError: neither could be written.
    """
    link = os.path.join(root.path, name)
    target = os.path.basename(root.final_dir(step))
    tmp = os.path.join(root.path, f".{name}.{uuid.uuid4().hex}.tmp")
    try:
        os.symlink(target, tmp)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        write_atomic(f"{link}.txt", f"{target}\n".encode(), sync_dir=False)
    else:
        try:
            os.replace(tmp, link)
        except BaseException:
            os.unlink(tmp)
            raise
        if os.path.lexists(f"{link}.txt"):
            os.unlink(f"{link}.txt")
    fsync_dir(root.path)


def retire(root: RootConfig, steps: Iterable[int]) -> tuple[dict[int, str], dict[int, str]]:
    """Rename each ``step_N`` into the root's doomed area; make the renames durable.

    Only renames (and creating the trash directories): the part of retirement that must
    not overlap a promotion in the root. Blocking I/O.

    Returns:
        The doomed entry name of each step moved, and why each other step was not.

    Raises:
        OSError: the doomed area cannot be created or synced.
    """
    target = _gc.doomed_dir(root)
    os.makedirs(target, mode=0o700, exist_ok=True)
    moved: dict[int, str] = {}
    refused: dict[int, str] = {}
    for step in steps:
        source = root.final_dir(step)
        entry = f"{os.path.basename(source)}{_RETIRED}{uuid.uuid4().hex[:12]}"
        try:
            os.rename(source, os.path.join(target, entry))
        except OSError as exc:
            refused[step] = exc.strerror or str(exc)
            continue
        moved[step] = entry
    if moved:
        _gc.sync_doomed(root)
    return moved, refused


def free_space(root: RootConfig) -> tuple[int, int]:
    """Bytes of ``root``'s filesystem available to the daemon, and its size. Blocking I/O.

    Raises:
        OSError: it cannot be stat'ed.
    """
    st = os.statvfs(root.path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def doomed_step(root: RootConfig, entry: str) -> int | None:
    """The step a doomed entry named ``step_N.retired-<suffix>`` was, else None."""
    head, sep, _ = entry.partition(_RETIRED)
    return root.parse_step(head, root.final_prefix) if sep else None


def training_info_metrics(path: str) -> dict[str, float]:
    """The numeric top-level keys of ``path/training_info.json`` (NeMo-RL's), as metrics.

    JSON, parsed as data (never executed, never unpickled), at most 1 MiB. Numbers
    (not booleans) that are finite become metrics of the same name; other values, and
    names outside ``A-Za-z0-9_.:/@+-``, are left out. A missing or unreadable file
    gives none.
    """
    try:
        with open(os.path.join(path, TRAINING_INFO), "rb") as fh:
            data = fh.read(_MAX_INFO + 1)
    except OSError:
        return {}
    if len(data) > _MAX_INFO:
        return {}
    try:
        info: Any = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return {}
    if not isinstance(info, dict):
        return {}
    out: dict[str, float] = {}
    for name, value in info.items():
        if len(out) >= MAX_METRICS:
            break
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        try:
            number = float(value)
        except OverflowError:
            continue
        if isinstance(name, str) and _METRIC.match(name) and math.isfinite(number):
            out[name] = number
    return out

"""Retention's facts on the root: each step's pin, hold and metrics, in ``.ckptd-retention/``.

The journal is the fast path; these files are the truth a daemon with an empty state
directory (a requeued job, a new pod) starts from. One small file a step,
``ROOT/.ckptd-retention/step_N.json``, replaced atomically (temp name, fsync, rename,
directory fsync) before a ``pin``, ``unpin``, ``hold`` or ``score`` is acknowledged.
A step's metrics and hold are of one promoted attempt (``attempt``): a step saved again
by another attempt does not inherit them. Its pin is of the step, whatever attempt
promotes it, as a pin always was.
"""

from __future__ import annotations

import errno
import os
from typing import Final

import msgspec

from ..config._config import RootConfig
from ._durable import fsync_dir, make_dir, write_atomic

__all__ = [
    "FACTS_DIR",
    "StepRetention",
    "read_best_name",
    "read_facts",
    "remove_facts",
    "write_best_name",
    "write_facts",
]

FACTS_DIR: Final = ".ckptd-retention"
"""The directory of the root that holds retention's facts, one file a step."""

_MAX_FACTS: Final = 1024 * 1024
_SUFFIX: Final = ".json"
_BEST: Final = "best-pointer"
"""The file naming the ``best`` pointer the daemon last wrote (its ``best_pointer``)."""


class StepRetention(msgspec.Struct, frozen=True, kw_only=True):
    """What retention knows of one step of a root, as the root records it."""

    format: str = "ckptd-retention/1"
    step: int
    attempt: str = ""
    """The promoted attempt ``metrics`` and ``held_until`` are of ("": none yet)."""
    pinned: bool = False
    held_until: float = 0.0
    """Wall-clock seconds until which a reader holds the step (0: not held)."""
    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    written: int = 0
    """When these facts were taken (wall-clock nanoseconds): a reader takes a step's facts
    only once for each time they were written, so a stale read never undoes a change."""


def facts_path(root: RootConfig, step: int) -> str:
    """Where step ``step``'s facts are."""
    return os.path.join(root.path, FACTS_DIR, f"{root.final_prefix}{step}{_SUFFIX}")


def write_facts(root: RootConfig, facts: StepRetention) -> None:
    """Record ``facts`` on the root, durably (directory created and fsynced if new)."""
    make_dir(root.path, FACTS_DIR)
    write_atomic(facts_path(root, facts.step), msgspec.json.encode(facts))


def read_facts(root: RootConfig) -> dict[int, StepRetention]:
    """Every step's facts the root records; a file that cannot be read is skipped."""
    directory = os.path.join(root.path, FACTS_DIR)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return {}
    found: dict[int, StepRetention] = {}
    for name in names:
        if not name.endswith(_SUFFIX):
            continue  # a writer's temporary file
        step = root.parse_step(name[: -len(_SUFFIX)], root.final_prefix)
        if step is None:
            continue
        try:
            with open(os.path.join(directory, name), "rb") as fh:
                facts = msgspec.json.decode(fh.read(_MAX_FACTS), type=StepRetention)
        except (OSError, msgspec.DecodeError):
            continue
        if facts.step == step:
            found[step] = facts
    return found


def remove_facts(root: RootConfig, step: int) -> None:
    """Forget step ``step``'s facts on the root (it was retired), durably."""
    try:
        os.unlink(facts_path(root, step))
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise
        return
    fsync_dir(os.path.join(root.path, FACTS_DIR))


def read_best_name(root: RootConfig) -> str | None:
    """The name of the ``best`` pointer last written into ``root``, if one was."""
    try:
        with open(os.path.join(root.path, FACTS_DIR, _BEST), "rb") as fh:
            name = fh.read(4096).decode().strip()
    except (OSError, UnicodeError):
        return None
    return name or None


def write_best_name(root: RootConfig, name: str | None) -> None:
    """Record ``name`` as the root's ``best`` pointer (None: it has none), durably."""
    path = os.path.join(root.path, FACTS_DIR, _BEST)
    if name is None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        fsync_dir(os.path.dirname(path))
        return
    try:
        os.mkdir(os.path.dirname(path), 0o755)
    except FileExistsError:
        pass
    write_atomic(path, f"{name}\n".encode())

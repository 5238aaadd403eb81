"""Finding and removing failed and orphaned tmp directories (``ckptd gc``).

Removal is a rename into the root's trash directory, then a recursive delete of the
trash: a half-deleted save is never left under its own name.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Collection

from ._config import RootConfig

__all__ = ["TRASH", "candidates", "quarantine", "remove", "unknown_tmp_dirs"]

TRASH = ".ckptd-trash"
"""Directory inside each root where removed saves go before they are deleted."""


def candidates(
    root: RootConfig, failed: Collection[int], active: Collection[int], min_age: float
) -> list[int]:
    """Steps whose tmp directory may be removed. Blocking I/O.

    A failed step always qualifies. A tmp directory the daemon does not know is an
    orphan and qualifies once nothing in it changed for ``min_age`` seconds (so a
    trainer that writes before it says ``begin`` is not robbed). Active saves never do.
    """
    found: list[int] = []
    with os.scandir(root.path) as entries:
        for entry in entries:
            step = root.parse_step(entry.name, root.tmp_prefix)
            if step is None or step in active:
                continue
            if step in failed or _idle_for(entry.path) >= min_age:
                found.append(step)
    return sorted(found)


def quarantine(root: RootConfig, step: int) -> str | None:
    """Move a failed attempt's tmp directory into the trash, kept until ``gc``.

    Returns:
        Where it went, or None if there was nothing to move. Blocking I/O.
    """
    tmp = root.tmp_dir(step)
    if not os.path.lexists(tmp):
        return None
    trash = os.path.join(root.path, TRASH)
    os.makedirs(trash, mode=0o700, exist_ok=True)
    target = os.path.join(trash, f"{os.path.basename(tmp)}.failed-{uuid.uuid4().hex[:12]}")
    os.rename(tmp, target)
    return target


def unknown_tmp_dirs(root: RootConfig, known: Collection[int]) -> list[int]:
    """Steps with a tmp directory in ``root`` that are not in ``known``. Blocking I/O."""
    with os.scandir(root.path) as entries:
        steps = (root.parse_step(e.name, root.tmp_prefix) for e in entries)
        return sorted(s for s in steps if s is not None and s not in known)


def remove(root: RootConfig, steps: Collection[int]) -> None:
    """Move each step's tmp directory to the trash, then delete the trash. Blocking I/O."""
    trash = os.path.join(root.path, TRASH)
    os.makedirs(trash, mode=0o700, exist_ok=True)
    for step in steps:
        tmp = root.tmp_dir(step)
        if os.path.lexists(tmp):
            os.rename(tmp, os.path.join(trash, f"{os.path.basename(tmp)}.{uuid.uuid4().hex}"))
    for entry in os.scandir(trash):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            os.unlink(entry.path)


def _idle_for(path: str) -> float:
    newest = os.lstat(path).st_mtime
    for dirpath, _dirs, files in os.walk(path):
        newest = max(newest, os.lstat(dirpath).st_mtime)
        for name in files:
            newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime)
    return time.time() - newest

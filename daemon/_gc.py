"""What ``ckptd gc`` may remove, and the renames that doom it. Blocking filesystem work.

Each root's trash, ``ROOT/.ckptd-trash/``, holds two kinds of entry:

- **kept**: a failed attempt's tmp directory set aside so that a new attempt starts
  afresh (``<tmp dir name>.failed-<id>`` and ``<tmp dir name>.attempt-<id>``). It stays
  for inspection and ``ckptd promote`` until a ``gc`` names it.
- **doomed**: everything under ``ROOT/.ckptd-trash/delete/``. ``gc`` renames what it
  removes in there (one rename per entry, in the root, under the root's lock); the
  background remover (``_trash``) deletes only what is in there, and on start resumes
  whatever a previous run had doomed.

A rename into the trash is how nothing is ever left half deleted under its own name.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from . import _attempts
from ._config import RootConfig

__all__ = [
    "DOOMED",
    "TRASH",
    "KeptEntry",
    "candidates",
    "doom",
    "doomed_dir",
    "set_aside",
    "sync_doomed",
    "unknown_tmp_dirs",
]

TRASH = _attempts.TRASH
"""Directory inside each root where removed and set-aside saves go."""

DOOMED = "delete"
"""Directory inside the trash whose entries the background remover deletes."""


@dataclass(frozen=True, slots=True)
class KeptEntry:
    """A kept entry of the trash: a failed attempt's tmp directory, set aside."""

    name: str
    """Its name in ``ROOT/.ckptd-trash/``."""
    step: int
    """The step it was written for."""


def doomed_dir(root: RootConfig) -> str:
    """``ROOT/.ckptd-trash/delete``: what is in there is deleted in the background."""
    return os.path.join(root.path, TRASH, DOOMED)


def candidates(
    root: RootConfig, failed: Collection[int], active: Collection[int], min_age: float
) -> list[int]:
    """Steps whose tmp directory may be removed. Blocking I/O; walks orphans' files.

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


def set_aside(root: RootConfig) -> list[KeptEntry]:
    """The kept entries of the root's trash, by step then name. Blocking I/O.

    An entry is kept if its name is a tmp directory's name followed by ``.`` and a
    suffix (``tmp_step_7.failed-1f2e``, ``tmp_step_7.attempt-9c0d``); anything else in
    the trash is left alone.
    """
    try:
        with os.scandir(os.path.join(root.path, TRASH)) as entries:
            names = [e.name for e in entries]
    except FileNotFoundError:
        return []
    found: list[KeptEntry] = []
    for name in names:
        if not name.startswith(root.tmp_prefix):
            continue
        digits, dot, suffix = name[len(root.tmp_prefix) :].partition(".")
        step = root.parse_step(root.tmp_prefix + digits, root.tmp_prefix)
        if step is not None and dot and suffix:
            found.append(KeptEntry(name, step))
    return sorted(found, key=lambda s: (s.step, s.name))


def unknown_tmp_dirs(root: RootConfig, known: Collection[int]) -> list[int]:
    """Steps with a tmp directory in ``root`` that are not in ``known``. Blocking I/O."""
    with os.scandir(root.path) as entries:
        steps = (root.parse_step(e.name, root.tmp_prefix) for e in entries)
        return sorted(s for s in steps if s is not None and s not in known)


def doom(
    root: RootConfig, steps: Iterable[int], kept: Iterable[str]
) -> tuple[list[str], dict[str, str]]:
    """Rename each step's tmp directory and each named kept entry into the doomed area.

    Only renames (and creating the trash directories): the part of removal that must
    not overlap a promotion in the root. Blocking I/O. A tmp directory or kept entry
    that no longer exists is skipped. The renames are durable only after
    :func:`sync_doomed`.

    Returns:
        The names the moved entries now have in ``ROOT/.ckptd-trash/delete/``, and for
        each path that could not be moved (e.g. a mount point: ``EBUSY``), why.

    Raises:
        OSError: the doomed area cannot be created.
    """
    target = doomed_dir(root)
    os.makedirs(target, mode=0o700, exist_ok=True)
    moved: list[str] = []
    refused: dict[str, str] = {}
    sources = [(root.tmp_dir(s), f"{root.tmp_prefix}{s}.{uuid.uuid4().hex[:12]}") for s in steps]
    sources += [(os.path.join(root.path, TRASH, name), name) for name in kept]
    for source, name in sources:
        try:
            os.rename(source, os.path.join(target, name))
        except FileNotFoundError:
            continue  # already gone: nothing to remove
        except OSError as exc:
            refused[source] = exc.strerror or str(exc)
            continue
        moved.append(name)
    return moved, refused


def sync_doomed(root: RootConfig) -> None:
    """Make renames into the doomed area durable: fsync it, the trash and the root."""
    for path in (doomed_dir(root), os.path.join(root.path, TRASH), root.path):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _idle_for(path: str) -> float:
    newest = os.lstat(path).st_mtime
    for dirpath, _dirs, files in os.walk(path):
        newest = max(newest, os.lstat(dirpath).st_mtime)
        for name in files:
            newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime)
    return time.time() - newest

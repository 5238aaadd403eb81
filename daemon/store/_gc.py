"""What ``ckptd gc`` may remove, and the renames that doom it. Blocking filesystem work.

Each root's trash, ``ROOT/.ckptd-trash/``, holds two kinds of entry:

- **kept**: a failed attempt's tmp directory set aside so that a new attempt starts
  afresh (``<tmp dir name>.attempt-<id>-<suffix>``, and ``<tmp dir name>.failed-<id>``
  from earlier versions). It stays for inspection and ``ckptd promote`` until a ``gc``
  names it. Its name says whose it is, even when the journal that recorded the move is
  lost.
- **doomed**: everything under ``ROOT/.ckptd-trash/delete/``. ``gc`` renames what it
  removes in there (one rename per entry, in the root, under the root's lock); the
  background remover (``_trash``) deletes only what is in there, and on start resumes
  whatever a previous run had doomed.

A rename into the trash is how nothing is ever left half deleted under its own name.
"""

from __future__ import annotations

import os
import stat
import time
import uuid
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from ..config._config import RootConfig
from . import _attempts

__all__ = [
    "DOOMED",
    "TRASH",
    "KeptEntry",
    "TmpDir",
    "doom",
    "doomed_dir",
    "kept_entries",
    "sync_doomed",
    "tmp_dirs",
    "unknown_tmp_dirs",
]

TRASH = _attempts.TRASH
"""Directory inside each root where removed and set-aside saves go."""

DOOMED = "delete"
"""Directory inside the trash whose entries the background remover deletes."""

_ATTEMPT_TAG = "attempt-"


@dataclass(frozen=True, slots=True)
class KeptEntry:
    """A kept entry of the trash: a failed attempt's tmp directory, set aside."""

    name: str
    """Its name in ``ROOT/.ckptd-trash/``."""
    step: int
    """The step it was written for."""
    attempt: str | None
    """The attempt its name carries (``.attempt-<id>-<suffix>``); None for other names."""


@dataclass(frozen=True, slots=True)
class TmpDir:
    """A ``tmp_step_N`` of a step with no save in flight."""

    step: int
    failed: bool
    """Its marker names the step's failed attempt: it could not be set aside (or
    ``ckptd promote`` brought it back and could not verify it)."""
    qualifies: bool
    """gc may remove it: it is the failed attempt's, or nothing in it changed for the
    orphan age."""


def doomed_dir(root: RootConfig) -> str:
    """``ROOT/.ckptd-trash/delete``: what is in there is deleted in the background."""
    return os.path.join(root.path, TRASH, DOOMED)


def tmp_dirs(
    root: RootConfig, failed: Mapping[int, str], busy: Collection[int], min_age: float
) -> list[TmpDir]:
    """The tmp directories of the steps not in ``busy``, by step. Blocking I/O.

    A directory whose marker names the failed attempt ``failed[step]`` qualifies at
    once. Any other (no marker: a trainer's files written before its ``begin``; another
    attempt's marker; a step the daemon does not know) is an orphan and qualifies once
    nothing in it changed for ``min_age`` seconds, so a trainer that writes before it
    says ``begin`` is not robbed. Walks the orphans' files.
    """
    found: list[TmpDir] = []
    with os.scandir(root.staging_dir) as entries:
        for entry in entries:
            step = root.parse_step(entry.name, root.tmp_prefix)
            if step is None or step in busy:
                continue
            attempt = failed.get(step)
            own = False
            if attempt and entry.is_dir(follow_symlinks=False):
                marker = _attempts.read_marker(entry.path)
                own = marker is not None and marker.attempt == attempt
            found.append(TmpDir(step, own, own or _idle_for(entry.path) >= min_age))
    return sorted(found, key=lambda d: d.step)


def kept_entries(root: RootConfig) -> list[KeptEntry]:
    """The kept entries of the root's trash, by step then name. Blocking I/O.

    An entry is kept if its name is a tmp directory's name followed by ``.`` and a
    suffix (``tmp_step_7.attempt-9c0d1e2f3a4b5c6d-1a2b3c4d``, ``tmp_step_7.failed-1f2e``);
    anything else in the trash is left alone.
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
        if step is None or not dot or not suffix:
            continue
        attempt = None
        if suffix.startswith(_ATTEMPT_TAG) and len(suffix) > len(_ATTEMPT_TAG):
            # <id>-<suffix>; the id holds no "-" (16 hex digits, or "unknown").
            attempt = suffix[len(_ATTEMPT_TAG) :].rsplit("-", 1)[0]
        found.append(KeptEntry(name, step, attempt))
    return sorted(found, key=lambda s: (s.step, s.name))


def unknown_tmp_dirs(root: RootConfig, known: Collection[int]) -> list[int]:
    """Steps with a tmp directory (in the root's staging directory) not in ``known``.

    Blocking I/O.
    """
    with os.scandir(root.staging_dir) as entries:
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
    """Make renames into the doomed area durable: fsync it, the trash and the root.

    And the staging directory the tmp directories left, when the root has one.
    """
    paths = [doomed_dir(root), os.path.join(root.path, TRASH), root.path]
    paths += [root.staging] if root.staging else []
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _idle_for(path: str) -> float:
    """Seconds since anything under ``path`` changed; 0 if something vanished meanwhile."""
    try:
        top = os.lstat(path)
        newest = top.st_mtime
        if not stat.S_ISDIR(top.st_mode):  # a symlink is not followed
            return time.time() - newest
        for dirpath, _dirs, files in os.walk(path):
            newest = max(newest, os.lstat(dirpath).st_mtime)
            for name in files:
                newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime)
    except FileNotFoundError:
        return 0.0  # someone is changing it: not idle
    return time.time() - newest

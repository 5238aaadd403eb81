"""Retention, gc and retention's facts on an object store (:class:`S3Keep`, a mixin).

Deletion without a trash: a retired step loses its commit object first (from then on no
reader trusts it), then its objects go in batches of 1,000 (``DeleteObjects``), and
multipart uploads left under it are aborted. Only what ckptd's naming recognises is
ever deleted: ``step_N/`` of a step with a commit object or an attempt marker, and in
it the attempt prefixes (16 hex digits), the marker and ckptd's own objects; a prefix
or object of any other name stays. Pins, holds and scores are small objects under
``.ckptd/facts/`` and the ``best`` pointer's name under ``.ckptd/best-name``, so a
daemon started on an empty state directory (a requeued job) reads them back.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Collection, Iterable, Mapping
from datetime import datetime
from typing import Final, Protocol, TypeVar

import msgspec

from orchestrator.protocol import LAYOUT_FILE, RootInfo

from ..config._config import RootConfig
from . import _s3commit as commits
from . import _s3pointers as pointers
from ._facts import StepRetention
from ._gc import KeptEntry, TmpDir
from ._layout import decode_layout
from ._s3client import Bucket, Listed, StoreError
from ._s3commit import Commit
from ._steps import Found, ManifestCache

__all__ = ["S3Keep"]

_Where = TypeVar("_Where", int, str)

_ATTEMPT: Final = re.compile(r"^[0-9a-f]{16}$")
_FACTS: Final = ".ckptd/facts"
_BEST_NAME: Final = ".ckptd/best-name"
_MAX_INFO: Final = 1024 * 1024


class _Roots(Protocol):
    def bucket(self, root: RootConfig) -> Bucket: ...

    def root_of(self, path: str) -> tuple[RootConfig, int | None, str]: ...

    def read_commit(self, root: RootConfig, step: int) -> Commit | None: ...


def _steps(bucket: Bucket, root: RootConfig) -> list[int]:
    """The steps with a ``step_N/`` prefix in the root (one paginated delimited LIST)."""
    found: list[int] = []
    for item in bucket.listing("", delimiter=True):
        if isinstance(item, str):
            step = root.parse_step(item.rstrip("/"), root.final_prefix)
            if step is not None:
                found.append(step)
    return sorted(found)


def _objects(bucket: Bucket, root: RootConfig, step: int) -> list[Listed]:
    return [i for i in bucket.listing(commits.step_name(root, step)) if isinstance(i, Listed)]


def _ours(root: RootConfig, step: int, key: str) -> bool:
    """Whether ``key`` (relative to the root) is ckptd's to delete with step N."""
    rel = key[len(commits.step_name(root, step)) + 1 :]
    first, sep, _ = rel.partition("/")
    return bool(_ATTEMPT.match(first)) if sep else commits.own_object(first)


class S3Keep:
    """gc, retention and facts of ``s3://`` roots; mixed into :class:`S3Storage`."""

    def entries(self: _Roots, root: RootConfig) -> list[str]:
        """The root's names: ``step_N`` (committed), ``tmp_step_N`` (not yet), pointers.

        A ``step_N/`` prefix with neither a commit object nor an attempt marker is left
        out: a retired step's (some stores, SeaweedFS among them, keep listing an
        emptied prefix), or none of ckptd's.
        """
        bucket = self.bucket(root)
        names: set[str] = set()
        for item in bucket.listing("", delimiter=True):
            if isinstance(item, str):
                name = item.rstrip("/")
                step = root.parse_step(name, root.final_prefix)
                if step is None:
                    names.add(name)
                elif bucket.head(commits.commit_name(root, step)) is not None:
                    names.add(name)
                elif bucket.head(commits.marker_name(root, step)) is not None:
                    names.add(f"{root.tmp_prefix}{step}")
            else:
                names.add(item.key)
        return sorted(names)

    def set_aside_entries(self, root: RootConfig) -> list[str]:
        """Nothing is ever moved into a trash on an object store."""
        return []

    def read_layout(self: _Roots, root: RootConfig) -> RootInfo | None:
        """The root's ``.ckptd-layout.json`` object, if a daemon wrote it."""
        got = self.bucket(root).get(LAYOUT_FILE)
        return None if got is None else decode_layout(got[0])

    def tmp_dirs(
        self: _Roots,
        root: RootConfig,
        failed: Mapping[int, str],
        busy: Collection[int],
        min_age: float,
    ) -> list[TmpDir]:
        """Steps with an attempt marker and no commit object, not in ``busy``."""
        bucket = self.bucket(root)
        found: list[TmpDir] = []
        for step in _steps(bucket, root):
            if step in busy or bucket.head(commits.commit_name(root, step)) is not None:
                continue
            marker = commits.read_marker(bucket, root, step)
            if marker is None:
                continue  # not ckptd's: never touched
            own = failed.get(step) == marker.attempt
            newest = max((o.modified for o in _objects(bucket, root, step)), default=None)
            idle = time.time() - newest.timestamp() if newest is not None else float("inf")
            found.append(TmpDir(step, own, own or idle >= min_age))
        return found

    def kept_entries(self: _Roots, root: RootConfig) -> list[KeptEntry]:
        """Failed attempts' prefixes (``step_N/ATTEMPT``) beside the committed or current one."""
        bucket = self.bucket(root)
        kept: list[KeptEntry] = []
        for step in _steps(bucket, root):
            commit = self.read_commit(root, step)
            marker = commits.read_marker(bucket, root, step)
            if commit is None and marker is None:
                continue
            live = {a.attempt for a in (commit, marker) if a is not None}
            for item in bucket.listing(commits.step_name(root, step), delimiter=True):
                if isinstance(item, str):
                    attempt = item.rstrip("/").rsplit("/", 1)[-1]
                    if _ATTEMPT.match(attempt) and attempt not in live:
                        kept.append(
                            KeptEntry(f"{commits.step_name(root, step)}/{attempt}", step, attempt)
                        )
        return kept

    def unknown_tmp_dirs(self: _Roots, root: RootConfig, known: Collection[int]) -> list[int]:
        """Steps with an attempt marker, no commit object, and no save the daemon knows."""
        bucket = self.bucket(root)
        return [
            step
            for step in _steps(bucket, root)
            if step not in known
            and bucket.head(commits.marker_name(root, step)) is not None
            and bucket.head(commits.commit_name(root, step)) is None
        ]

    def doom(
        self: _Roots, root: RootConfig, steps: Iterable[int], kept: Iterable[str]
    ) -> tuple[list[str], dict[str, str]]:
        """Delete uncommitted steps' attempts and marker, and the named failed attempts."""
        bucket = self.bucket(root)
        removed: list[str] = []
        refused: dict[str, str] = {}
        for step in steps:
            if bucket.head(commits.commit_name(root, step)) is not None:
                refused[root.tmp_dir(step)] = "committed meanwhile"
                continue
            keys = [o.key for o in _objects(bucket, root, step) if _ours(root, step, o.key)]
            _delete(bucket, commits.step_name(root, step), keys, refused, root.tmp_dir(step))
            removed.append(f"{root.tmp_prefix}{step}")
        for name in kept:
            keys = [i.key for i in bucket.listing(name) if isinstance(i, Listed)]
            _delete(bucket, name, keys, refused, f"{root.path}/{name}")
            removed.append(name)
        return removed, refused

    def sync_doomed(self, root: RootConfig) -> None:
        """Nothing to do: deletions are done when :meth:`doom` returns."""

    def scan_steps(self: _Roots, root: RootConfig, cache: ManifestCache) -> list[Found]:
        """Every committed step of the root, from its commit object."""
        found: list[Found] = []
        for step in _steps(self.bucket(root), root):
            commit = self.read_commit(root, step)
            if commit is not None:
                at = datetime.fromisoformat(commit.committed).timestamp()
                found.append(Found(step, True, promoted_at=at, attempt=commit.attempt))
        return found

    def leader_node(self, root: RootConfig, step: int) -> str | None:
        """Saves on an object store are one node's: its own daemon prunes."""
        return None

    def free_space(self, root: RootConfig) -> tuple[int, int]:
        """An object store reports no free space: ``(0, 0)`` (unknown)."""
        return 0, 0

    def read_named_pointer(self: _Roots, root: RootConfig, name: str) -> int | None:
        """The step the pointer object ``name`` names."""
        found = pointers.read_pointer(self.bucket(root), name)
        return None if found is None else found[0].step

    def write_pointer(self: _Roots, root: RootConfig, name: str, step: int) -> None:
        """Point ``name`` at committed step N, by compare-and-swap.

        Raises:
            FileNotFoundError: the step is not committed.
        """
        commit = self.read_commit(root, step)
        if commit is None:
            raise FileNotFoundError(f"{root.final_dir(step)} is not committed")
        pointers.write_pointer(self.bucket(root), name, step, commit.attempt, commit.url)

    def retire(
        self: _Roots, root: RootConfig, steps: Iterable[int]
    ) -> tuple[dict[int, str], dict[int, str]]:
        """Delete each step: its commit object first, then its objects in batches."""
        bucket = self.bucket(root)
        moved: dict[int, str] = {}
        refused: dict[int, str] = {}
        for step in steps:
            name = commits.step_name(root, step)
            try:
                bucket.delete(commits.commit_name(root, step))  # no reader trusts it now
                keys = [o.key for o in _objects(bucket, root, step) if _ours(root, step, o.key)]
            except StoreError as exc:
                refused[step] = exc.strerror or str(exc)
                continue
            if _delete(bucket, name, keys, refused, step):
                moved[step] = name
        return moved, refused

    def training_info_metrics(self: _Roots, path: str) -> dict[str, float]:
        """The metrics in the committed checkpoint's ``training_info.json``."""
        try:
            root, step, _ = self.root_of(path)
        except FileNotFoundError:
            return {}
        commit = None if step is None else self.read_commit(root, step)
        if commit is None or step is None:
            return {}
        got = self.bucket(root).get(
            f"{commits.attempt_name(root, step, commit.attempt)}/training_info.json"
        )
        if got is None or len(got[0]) > _MAX_INFO:
            return {}
        try:
            data = json.loads(got[0])
        except ValueError:
            return {}
        if not isinstance(data, dict):
            return {}
        return {
            str(k): float(v)
            for k, v in data.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }

    def remove_pointer(self: _Roots, root: RootConfig, name: str) -> bool:
        """Remove the pointer object ``name`` if it is one; whether it did."""
        return pointers.remove_pointer(self.bucket(root), name)

    def read_best_name(self: _Roots, root: RootConfig) -> str | None:
        """The name of the ``best`` pointer last written into the root."""
        got = self.bucket(root).get(_BEST_NAME)
        if got is None:
            return None
        name = got[0].decode(errors="replace").strip()
        return name or None

    def write_best_name(self: _Roots, root: RootConfig, name: str | None) -> None:
        """Record the root's ``best`` pointer name (None: it has none)."""
        bucket = self.bucket(root)
        if name is None:
            bucket.delete(_BEST_NAME)
        else:
            bucket.put(_BEST_NAME, name.encode())

    def write_facts(self: _Roots, root: RootConfig, facts: StepRetention) -> None:
        """Record a step's pin, hold and metrics as one object."""
        name = f"{_FACTS}/{root.final_prefix}{facts.step}.json"
        self.bucket(root).put(name, msgspec.json.encode(facts))

    def read_facts(self: _Roots, root: RootConfig) -> dict[int, StepRetention]:
        """Every step's pin, hold and metrics the root records."""
        bucket = self.bucket(root)
        found: dict[int, StepRetention] = {}
        for item in bucket.listing(_FACTS):
            if not isinstance(item, Listed):
                continue
            got = bucket.get(item.key)
            if got is None:
                continue
            try:
                facts = msgspec.json.decode(got[0], type=StepRetention)
            except msgspec.DecodeError:
                continue
            found[facts.step] = facts
        return found

    def remove_facts(self: _Roots, root: RootConfig, step: int) -> None:
        """Forget a retired step's facts."""
        self.bucket(root).delete(f"{_FACTS}/{root.final_prefix}{step}.json")


def _delete(
    bucket: Bucket, name: str, keys: list[str], refused: dict[_Where, str], where: _Where
) -> bool:
    """Delete ``keys`` and abort the uploads under ``name``; False if anything failed.

    Why it failed goes in ``refused[where]``.
    """
    try:
        failed = bucket.delete_many(keys)
        for upload in bucket.uploads(name):
            bucket.abort(upload)
    except StoreError as exc:
        refused[where] = exc.strerror or str(exc)
        return False
    if failed:
        refused[where] = f"{len(failed)} objects could not be deleted"
        return False
    return True

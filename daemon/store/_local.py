"""The POSIX storage: :class:`LocalStorage`, for roots on a local or shared filesystem.

Each :class:`daemon.store._storage.Storage` method is the module function of the same
idea (``daemon.store._attempts``, ``_markers``, ``_fence``, ``_gc``, ``_steps``,
``_verify``, ``_promote``); promotion's own writes go through this class's primitives
(:class:`daemon.store._promote.FileOps`), which fault-injection tests override on a
subclass to put a real failing call behind a promotion.
"""

from __future__ import annotations

import ctypes
import errno
import os
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Final

from orchestrator.protocol import AttemptMarker, FileEntry, RootInfo

from ..config._config import RootConfig
from . import (
    _attempts,
    _durable,
    _facts,
    _fence,
    _gc,
    _layout,
    _markers,
    _paths,
    _promote,
    _steps,
    _verify,
)
from ._attempts import Prepared, StagedMarker
from ._durable import fsync_dir
from ._facts import StepRetention
from ._gc import KeptEntry, TmpDir
from ._markers import NodeMarker, Outcome, Seen, Verdict
from ._promote import Promotion
from ._steps import Found, ManifestCache
from ._verify import Manifest

__all__ = ["LocalStorage"]

_AT_FDCWD: Final = -100
_RENAME_NOREPLACE: Final = 1


class LocalStorage:
    """:class:`daemon.store._storage.Storage` on a POSIX filesystem."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._renameat2 = getattr(libc, "renameat2", None)

    def fsync(self, path: str, *, directory: bool = False) -> None:
        """See :meth:`daemon.store._promote.FileOps.fsync`."""
        flags = os.O_RDONLY | (os.O_DIRECTORY if directory else 0)
        # O_NONBLOCK: a file swapped for a FIFO after verification fails its fsync
        # instead of blocking this thread (and the root's promotions) on the open.
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_atomic(self, path: str, data: bytes, *, sync_dir: bool = True) -> None:
        """See :meth:`daemon.store._promote.FileOps.write_atomic`."""
        _durable.write_atomic(path, data, sync_dir=False)
        if sync_dir:
            self.fsync(os.path.dirname(path), directory=True)

    def rename_noreplace(self, src: str, dst: str) -> None:
        """See :meth:`daemon.store._promote.FileOps.rename_noreplace`."""
        if self._renameat2 is not None:
            rc = self._renameat2(
                _AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE
            )
            if rc == 0:
                return
            err = ctypes.get_errno()
            if err not in (errno.ENOSYS, errno.EINVAL):
                raise OSError(err, os.strerror(err), src, None, dst)
        # Filesystems without RENAME_NOREPLACE (some NFS): the daemon serialises renames
        # per root, so no other writer can create dst between the check and the rename.
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
        os.rename(src, dst)

    def replace_symlink(self, target: str, path: str) -> None:
        """See :meth:`daemon.store._promote.FileOps.replace_symlink`."""
        tmp = os.path.join(
            os.path.dirname(path), f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp"
        )
        os.symlink(target, tmp)
        try:
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

    # The daemon's effects on a root (daemon.store._storage.Storage).

    def scan_save(
        self,
        root: RootConfig,
        step: int,
        world_size: int,
        reported: dict[int, tuple[FileEntry, ...]],
        attempt: str = "",
        source: str | None = None,
    ) -> Manifest:
        """See :func:`daemon.store._verify.scan_save`."""
        return _verify.scan_save(root, step, world_size, reported, attempt, source)

    def read_manifest(self, path: str) -> Manifest:
        """See :func:`daemon.store._verify.read_manifest`."""
        return _verify.read_manifest(path)

    def verify_checkpoint(self, path: str) -> list[str]:
        """See :func:`daemon.store._verify.verify_checkpoint`."""
        return _verify.verify_checkpoint(path)

    def entries(self, root: RootConfig) -> list[str]:
        """See :meth:`daemon.store._storage.Storage.entries`."""
        return sorted(os.listdir(root.path))

    def read_layout(self, root: RootConfig) -> RootInfo | None:
        """See :func:`daemon.store._layout.read_layout`."""
        return _layout.read_layout(root)

    def set_aside_entries(self, root: RootConfig) -> list[str]:
        """See :meth:`daemon.store._storage.Storage.set_aside_entries`."""
        try:
            return sorted(os.listdir(os.path.join(root.path, _attempts.TRASH)))
        except FileNotFoundError:
            return []

    def identity(self, path: str) -> tuple[int, int]:
        """See :func:`daemon.store._promote.identity`."""
        return _promote.identity(path)

    def promote(
        self,
        root: RootConfig,
        step: int,
        manifest: Manifest,
        *,
        intent: Callable[[], object] | None = None,
        expect: tuple[int, int] | None = None,
        pointer_node: str | None = None,
        source: str | None = None,
        flushed: Collection[str] = frozenset(),
    ) -> Promotion:
        """See :func:`daemon.store._promote.promote`."""
        return _promote.promote(
            self,
            root,
            step,
            manifest,
            intent=intent,
            expect=expect,
            pointer_node=pointer_node,
            source=source,
            flushed=flushed,
        )

    def finish(self, root: RootConfig, step: int, pointer_node: str | None = None) -> Promotion:
        """See :func:`daemon.store._promote.finish`."""
        return _promote.finish(self, root, step, pointer_node)

    def promoted(self, root: RootConfig, step: int) -> bool:
        """See :meth:`daemon.store._storage.Storage.promoted`."""
        return os.path.isdir(root.final_dir(step))

    def promoted_durably(self, root: RootConfig, step: int) -> bool:
        """See :func:`daemon.store._steps.promoted_durably`."""
        return _steps.promoted_durably(root, step)

    def writing(self, root: RootConfig, step: int) -> bool:
        """See :meth:`daemon.store._storage.Storage.writing`."""
        return os.path.isdir(root.tmp_dir(step))

    def present(self, path: str) -> bool:
        """See :meth:`daemon.store._storage.Storage.present`."""
        return os.path.lexists(path)

    def directory(self, path: str) -> bool:
        """See :meth:`daemon.store._storage.Storage.directory`."""
        return os.path.isdir(path)

    def promotion_landed(self, root: RootConfig, step: int, tmp: str) -> bool:
        """See :meth:`daemon.store._storage.Storage.promotion_landed`."""
        return os.path.isdir(root.final_dir(step)) and not os.path.lexists(tmp)

    def check_tmp_dir(self, root: RootConfig, step: int) -> None:
        """See :func:`daemon.store._paths.check_tmp_dir`."""
        _paths.check_tmp_dir(root, step)

    def read_pointer(self, root: RootConfig) -> int | None:
        """See :func:`daemon.store._promote.read_pointer`."""
        return _promote.read_pointer(root)

    def latest_promoted(self, root: RootConfig) -> int | None:
        """See :func:`daemon.store._promote.latest_promoted`."""
        return _promote.latest_promoted(root)

    def locate(self, root: RootConfig, step: int) -> str:
        """``step_N`` of the root: the checkpoint's own directory.

        Raises:
            FileNotFoundError: it is not there.
        """
        final = root.final_dir(step)
        if not os.path.isdir(final):
            raise FileNotFoundError(final)
        return final

    def sync_root(self, root: RootConfig) -> None:
        """Fsync the root directory."""
        fsync_dir(root.path)

    def write_layout(self, root: RootConfig) -> bool:
        """See :func:`daemon.store._layout.write_layout`."""
        return _layout.write_layout(root)

    def stage_attempt(
        self, root: RootConfig, step: int, attempt: str, world_size: int, run: str = ""
    ) -> StagedMarker | None:
        """See :func:`daemon.store._attempts.stage_marker`."""
        return _attempts.stage_marker(root, step, attempt, world_size, run)

    def prepare(
        self,
        root: RootConfig,
        step: int,
        attempt: str,
        world_size: int,
        run: str = "",
        *,
        sync: bool = True,
        staged: StagedMarker | None = None,
    ) -> Prepared:
        """See :func:`daemon.store._attempts.prepare`."""
        return _attempts.prepare(root, step, attempt, world_size, run, sync=sync, staged=staged)

    def read_attempt(self, tmp: str) -> AttemptMarker | None:
        """See :func:`daemon.store._attempts.read_marker`."""
        return _attempts.read_marker(tmp)

    def set_aside(
        self, root: RootConfig, step: int, attempt: str, *, sync: bool = True
    ) -> str | None:
        """See :func:`daemon.store._attempts.set_aside`."""
        return _attempts.set_aside(root, step, attempt, sync=sync)

    def set_aside_dirs(self, root: RootConfig) -> tuple[str, ...]:
        """See :func:`daemon.store._attempts.set_aside_dirs`."""
        return _attempts.set_aside_dirs(root)

    def flush_dirs(self, paths: Sequence[str]) -> None:
        """See :func:`daemon.store._durable.fsync_dir` (concurrent flushes are shared)."""
        for path in paths:
            fsync_dir(path)

    def write_marker(
        self, root: RootConfig, step: int, marker: NodeMarker, *, durable: bool = True
    ) -> None:
        """See :func:`daemon.store._markers.write_marker`."""
        _markers.write_marker(root, step, marker, durable=durable)

    def read_markers(self, root: RootConfig, step: int, seen: Seen) -> list[NodeMarker]:
        """See :func:`daemon.store._markers.read_markers`."""
        return _markers.read_markers(root, step, seen)

    def read_markers_in(self, tmp: str, seen: Seen) -> list[NodeMarker]:
        """See :func:`daemon.store._markers.read_markers_in`."""
        return _markers.read_markers_in(tmp, seen)

    def check_files(
        self, root: RootConfig, step: int, files: Mapping[int, Sequence[FileEntry]]
    ) -> list[str]:
        """See :func:`daemon.store._markers.check_files`."""
        return _markers.check_files(root, step, files)

    def write_verdict(
        self,
        root: RootConfig,
        step: int,
        attempt: str,
        node: str,
        reason: str,
        *,
        promoted: bool = False,
    ) -> None:
        """See :func:`daemon.store._markers.write_verdict`."""
        _markers.write_verdict(root, step, attempt, node, reason, promoted=promoted)

    def read_verdict(self, root: RootConfig, step: int, attempt: str) -> Verdict | None:
        """See :func:`daemon.store._markers.read_verdict`."""
        return _markers.read_verdict(root, step, attempt)

    def read_outcome(
        self, root: RootConfig, step: int, attempt: str, *, full: bool = True
    ) -> Outcome | None:
        """See :func:`daemon.store._markers.read_outcome`."""
        return _markers.read_outcome(root, step, attempt, full=full)

    def spanning_attempt(self, root: RootConfig, step: int) -> AttemptMarker | None:
        """See :func:`daemon.store._markers.spanning_attempt`."""
        return _markers.spanning_attempt(root, step)

    def claim(
        self, root: RootConfig, step: int, node: str, attempt: str, tmp: str | None = None
    ) -> None:
        """See :func:`daemon.store._fence.claim`."""
        _fence.claim(root, step, node, attempt, tmp)

    def release(
        self, root: RootConfig, step: int, node: str, attempt: str, tmp: str | None = None
    ) -> None:
        """See :func:`daemon.store._fence.release`."""
        _fence.release(root, step, node, attempt, tmp)

    def claimed(self, root: RootConfig, step: int) -> bool:
        """See :func:`daemon.store._fence.claimed`."""
        return _fence.claimed(root, step)

    def tmp_dirs(
        self, root: RootConfig, failed: Mapping[int, str], busy: Collection[int], min_age: float
    ) -> list[TmpDir]:
        """See :func:`daemon.store._gc.tmp_dirs`."""
        return _gc.tmp_dirs(root, failed, busy, min_age)

    def kept_entries(self, root: RootConfig) -> list[KeptEntry]:
        """See :func:`daemon.store._gc.kept_entries`."""
        return _gc.kept_entries(root)

    def unknown_tmp_dirs(self, root: RootConfig, known: Collection[int]) -> list[int]:
        """See :func:`daemon.store._gc.unknown_tmp_dirs`."""
        return _gc.unknown_tmp_dirs(root, known)

    def doom(
        self, root: RootConfig, steps: Iterable[int], kept: Iterable[str]
    ) -> tuple[list[str], dict[str, str]]:
        """See :func:`daemon.store._gc.doom`."""
        return _gc.doom(root, steps, kept)

    def sync_doomed(self, root: RootConfig) -> None:
        """See :func:`daemon.store._gc.sync_doomed`."""
        _gc.sync_doomed(root)

    def scan_steps(self, root: RootConfig, cache: ManifestCache) -> list[Found]:
        """See :func:`daemon.store._steps.scan`."""
        return _steps.scan(root, cache)

    def leader_node(self, root: RootConfig, step: int) -> str | None:
        """See :func:`daemon.store._steps.leader_node`."""
        return _steps.leader_node(root, step)

    def free_space(self, root: RootConfig) -> tuple[int, int]:
        """See :func:`daemon.store._steps.free_space`."""
        return _steps.free_space(root)

    def read_named_pointer(self, root: RootConfig, name: str) -> int | None:
        """See :func:`daemon.store._steps.read_named_pointer`."""
        return _steps.read_named_pointer(root, name)

    def write_pointer(self, root: RootConfig, name: str, step: int) -> None:
        """See :func:`daemon.store._steps.write_pointer`."""
        _steps.write_pointer(root, name, step)

    def retire(
        self, root: RootConfig, steps: Iterable[int]
    ) -> tuple[dict[int, str], dict[int, str]]:
        """See :func:`daemon.store._steps.retire`."""
        return _steps.retire(root, steps)

    def training_info_metrics(self, path: str) -> dict[str, float]:
        """See :func:`daemon.store._steps.training_info_metrics`."""
        return _steps.training_info_metrics(path)

    def remove_pointer(self, root: RootConfig, name: str) -> bool:
        """See :func:`daemon.store._steps.remove_pointer`."""
        return _steps.remove_pointer(root, name)

    def read_best_name(self, root: RootConfig) -> str | None:
        """See :func:`daemon.store._facts.read_best_name`."""
        return _facts.read_best_name(root)

    def write_best_name(self, root: RootConfig, name: str | None) -> None:
        """See :func:`daemon.store._facts.write_best_name`."""
        _facts.write_best_name(root, name)

    def write_facts(self, root: RootConfig, facts: StepRetention) -> None:
        """See :func:`daemon.store._facts.write_facts`."""
        _facts.write_facts(root, facts)

    def read_facts(self, root: RootConfig) -> dict[int, StepRetention]:
        """See :func:`daemon.store._facts.read_facts`."""
        return _facts.read_facts(root)

    def remove_facts(self, root: RootConfig, step: int) -> None:
        """See :func:`daemon.store._facts.remove_facts`."""
        _facts.remove_facts(root, step)

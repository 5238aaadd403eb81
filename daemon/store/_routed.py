"""The storage of a daemon whose roots differ in kind: each call goes to its root's.

:class:`RoutedStorage` is the :class:`daemon.store._storage.Storage` the daemon is built
with: a call on an ``s3://`` root (or a URL in one) goes to
:class:`daemon.store._s3.S3Storage`, any other to :class:`daemon.store._local.LocalStorage`.
Nothing above ``daemon.store`` knows which kind a root is.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from orchestrator.protocol import AttemptMarker, FileEntry, RootInfo

from ..config._config import RootConfig
from ..config._s3 import is_s3_url
from ._attempts import Prepared, StagedMarker
from ._facts import StepRetention
from ._gc import KeptEntry, TmpDir
from ._local import LocalStorage
from ._markers import NodeMarker, Outcome, Seen, Verdict
from ._promote import Promotion
from ._steps import Found, ManifestCache
from ._storage import Storage
from ._verify import Manifest

__all__ = ["RoutedStorage"]


class RoutedStorage:
    """Each root's calls to its own kind of storage (see the module).

    Args:
        local: The storage of filesystem roots.
        s3: The storage of ``s3://`` roots; default one built on first use.
    """

    def __init__(self, local: Storage | None = None, s3: Storage | None = None) -> None:
        self.local: Storage = local or LocalStorage()
        self._s3 = s3

    @property
    def s3(self) -> Storage:
        """The storage of ``s3://`` roots (built on first use: botocore loads then)."""
        if self._s3 is None:
            from ._s3 import S3Storage

            self._s3 = S3Storage()
        return self._s3

    def _for(self, root: RootConfig) -> Storage:
        if root.on_object_store:
            s3 = self.s3
            register = getattr(s3, "register", None)
            if register is not None:
                register(root)
            return s3
        return self.local

    def _at(self, path: str) -> Storage:
        return self.s3 if is_s3_url(path) else self.local

    def scan_save(
        self,
        root: RootConfig,
        step: int,
        world_size: int,
        reported: dict[int, tuple[FileEntry, ...]],
        attempt: str = "",
        source: str | None = None,
    ) -> Manifest:
        """See :meth:`daemon.store._storage.Storage.scan_save`."""
        return self._for(root).scan_save(root, step, world_size, reported, attempt, source)

    def read_manifest(self, path: str) -> Manifest:
        """See :meth:`daemon.store._storage.Storage.read_manifest`."""
        return self._at(path).read_manifest(path)

    def verify_checkpoint(self, path: str) -> list[str]:
        """See :meth:`daemon.store._storage.Storage.verify_checkpoint`."""
        return self._at(path).verify_checkpoint(path)

    def entries(self, root: RootConfig) -> list[str]:
        """See :meth:`daemon.store._storage.Storage.entries`."""
        return self._for(root).entries(root)

    def set_aside_entries(self, root: RootConfig) -> list[str]:
        """See :meth:`daemon.store._storage.Storage.set_aside_entries`."""
        return self._for(root).set_aside_entries(root)

    def read_layout(self, root: RootConfig) -> RootInfo | None:
        """See :meth:`daemon.store._storage.Storage.read_layout`."""
        return self._for(root).read_layout(root)

    def identity(self, path: str) -> tuple[int, int]:
        """See :meth:`daemon.store._storage.Storage.identity`."""
        return self._at(path).identity(path)

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
        """See :meth:`daemon.store._storage.Storage.promote`."""
        return self._for(root).promote(
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
        """See :meth:`daemon.store._storage.Storage.finish`."""
        return self._for(root).finish(root, step, pointer_node)

    def promoted(self, root: RootConfig, step: int) -> bool:
        """See :meth:`daemon.store._storage.Storage.promoted`."""
        return self._for(root).promoted(root, step)

    def promoted_durably(self, root: RootConfig, step: int) -> bool:
        """See :meth:`daemon.store._storage.Storage.promoted_durably`."""
        return self._for(root).promoted_durably(root, step)

    def writing(self, root: RootConfig, step: int) -> bool:
        """See :meth:`daemon.store._storage.Storage.writing`."""
        return self._for(root).writing(root, step)

    def present(self, path: str) -> bool:
        """See :meth:`daemon.store._storage.Storage.present`."""
        return self._at(path).present(path)

    def directory(self, path: str) -> bool:
        """See :meth:`daemon.store._storage.Storage.directory`."""
        return self._at(path).directory(path)

    def promotion_landed(self, root: RootConfig, step: int, tmp: str) -> bool:
        """See :meth:`daemon.store._storage.Storage.promotion_landed`."""
        return self._for(root).promotion_landed(root, step, tmp)

    def check_tmp_dir(self, root: RootConfig, step: int) -> None:
        """See :meth:`daemon.store._storage.Storage.check_tmp_dir`."""
        return self._for(root).check_tmp_dir(root, step)

    def read_pointer(self, root: RootConfig) -> int | None:
        """See :meth:`daemon.store._storage.Storage.read_pointer`."""
        return self._for(root).read_pointer(root)

    def latest_promoted(self, root: RootConfig) -> int | None:
        """See :meth:`daemon.store._storage.Storage.latest_promoted`."""
        return self._for(root).latest_promoted(root)

    def locate(self, root: RootConfig, step: int) -> str:
        """See :meth:`daemon.store._storage.Storage.locate`."""
        return self._for(root).locate(root, step)

    def sync_root(self, root: RootConfig) -> None:
        """See :meth:`daemon.store._storage.Storage.sync_root`."""
        return self._for(root).sync_root(root)

    def write_layout(self, root: RootConfig) -> bool:
        """See :meth:`daemon.store._storage.Storage.write_layout`."""
        return self._for(root).write_layout(root)

    def stage_attempt(
        self, root: RootConfig, step: int, attempt: str, world_size: int, run: str = ""
    ) -> StagedMarker | None:
        """See :meth:`daemon.store._storage.Storage.stage_attempt`."""
        return self._for(root).stage_attempt(root, step, attempt, world_size, run)

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
        """See :meth:`daemon.store._storage.Storage.prepare`."""
        for_root = self._for(root)
        return for_root.prepare(root, step, attempt, world_size, run, sync=sync, staged=staged)

    def read_attempt(self, tmp: str) -> AttemptMarker | None:
        """See :meth:`daemon.store._storage.Storage.read_attempt`."""
        return self._at(tmp).read_attempt(tmp)

    def set_aside(
        self, root: RootConfig, step: int, attempt: str, *, sync: bool = True
    ) -> str | None:
        """See :meth:`daemon.store._storage.Storage.set_aside`."""
        return self._for(root).set_aside(root, step, attempt, sync=sync)

    def set_aside_dirs(self, root: RootConfig) -> tuple[str, ...]:
        """See :meth:`daemon.store._storage.Storage.set_aside_dirs`."""
        return self._for(root).set_aside_dirs(root)

    def flush_dirs(self, paths: Sequence[str]) -> None:
        """See :meth:`daemon.store._storage.Storage.flush_dirs`."""
        local = [path for path in paths if not is_s3_url(path)]
        if local:
            self.local.flush_dirs(local)

    def write_marker(
        self, root: RootConfig, step: int, marker: NodeMarker, *, durable: bool = True
    ) -> None:
        """See :meth:`daemon.store._storage.Storage.write_marker`."""
        return self._for(root).write_marker(root, step, marker, durable=durable)

    def read_markers(self, root: RootConfig, step: int, seen: Seen) -> list[NodeMarker]:
        """See :meth:`daemon.store._storage.Storage.read_markers`."""
        return self._for(root).read_markers(root, step, seen)

    def read_markers_in(self, tmp: str, seen: Seen) -> list[NodeMarker]:
        """See :meth:`daemon.store._storage.Storage.read_markers_in`."""
        return self._at(tmp).read_markers_in(tmp, seen)

    def check_files(
        self, root: RootConfig, step: int, files: Mapping[int, Sequence[FileEntry]]
    ) -> list[str]:
        """See :meth:`daemon.store._storage.Storage.check_files`."""
        return self._for(root).check_files(root, step, files)

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
        """See :meth:`daemon.store._storage.Storage.write_verdict`."""
        return self._for(root).write_verdict(root, step, attempt, node, reason, promoted=promoted)

    def read_verdict(self, root: RootConfig, step: int, attempt: str) -> Verdict | None:
        """See :meth:`daemon.store._storage.Storage.read_verdict`."""
        return self._for(root).read_verdict(root, step, attempt)

    def read_outcome(
        self, root: RootConfig, step: int, attempt: str, *, full: bool = True
    ) -> Outcome | None:
        """See :meth:`daemon.store._storage.Storage.read_outcome`."""
        return self._for(root).read_outcome(root, step, attempt, full=full)

    def spanning_attempt(self, root: RootConfig, step: int) -> AttemptMarker | None:
        """See :meth:`daemon.store._storage.Storage.spanning_attempt`."""
        return self._for(root).spanning_attempt(root, step)

    def claim(
        self, root: RootConfig, step: int, node: str, attempt: str, tmp: str | None = None
    ) -> None:
        """See :meth:`daemon.store._storage.Storage.claim`."""
        return self._for(root).claim(root, step, node, attempt, tmp)

    def release(
        self, root: RootConfig, step: int, node: str, attempt: str, tmp: str | None = None
    ) -> None:
        """See :meth:`daemon.store._storage.Storage.release`."""
        return self._for(root).release(root, step, node, attempt, tmp)

    def claimed(self, root: RootConfig, step: int) -> bool:
        """See :meth:`daemon.store._storage.Storage.claimed`."""
        return self._for(root).claimed(root, step)

    def tmp_dirs(
        self, root: RootConfig, failed: Mapping[int, str], busy: Collection[int], min_age: float
    ) -> list[TmpDir]:
        """See :meth:`daemon.store._storage.Storage.tmp_dirs`."""
        return self._for(root).tmp_dirs(root, failed, busy, min_age)

    def kept_entries(self, root: RootConfig) -> list[KeptEntry]:
        """See :meth:`daemon.store._storage.Storage.kept_entries`."""
        return self._for(root).kept_entries(root)

    def unknown_tmp_dirs(self, root: RootConfig, known: Collection[int]) -> list[int]:
        """See :meth:`daemon.store._storage.Storage.unknown_tmp_dirs`."""
        return self._for(root).unknown_tmp_dirs(root, known)

    def doom(
        self, root: RootConfig, steps: Iterable[int], kept: Iterable[str]
    ) -> tuple[list[str], dict[str, str]]:
        """See :meth:`daemon.store._storage.Storage.doom`."""
        return self._for(root).doom(root, steps, kept)

    def sync_doomed(self, root: RootConfig) -> None:
        """See :meth:`daemon.store._storage.Storage.sync_doomed`."""
        return self._for(root).sync_doomed(root)

    def scan_steps(self, root: RootConfig, cache: ManifestCache) -> list[Found]:
        """See :meth:`daemon.store._storage.Storage.scan_steps`."""
        return self._for(root).scan_steps(root, cache)

    def leader_node(self, root: RootConfig, step: int) -> str | None:
        """See :meth:`daemon.store._storage.Storage.leader_node`."""
        return self._for(root).leader_node(root, step)

    def free_space(self, root: RootConfig) -> tuple[int, int]:
        """See :meth:`daemon.store._storage.Storage.free_space`."""
        return self._for(root).free_space(root)

    def read_named_pointer(self, root: RootConfig, name: str) -> int | None:
        """See :meth:`daemon.store._storage.Storage.read_named_pointer`."""
        return self._for(root).read_named_pointer(root, name)

    def write_pointer(self, root: RootConfig, name: str, step: int) -> None:
        """See :meth:`daemon.store._storage.Storage.write_pointer`."""
        return self._for(root).write_pointer(root, name, step)

    def retire(
        self, root: RootConfig, steps: Iterable[int]
    ) -> tuple[dict[int, str], dict[int, str]]:
        """See :meth:`daemon.store._storage.Storage.retire`."""
        return self._for(root).retire(root, steps)

    def training_info_metrics(self, path: str) -> dict[str, float]:
        """See :meth:`daemon.store._storage.Storage.training_info_metrics`."""
        return self._at(path).training_info_metrics(path)

    def remove_pointer(self, root: RootConfig, name: str) -> bool:
        """See :meth:`daemon.store._storage.Storage.remove_pointer`."""
        return self._for(root).remove_pointer(root, name)

    def read_best_name(self, root: RootConfig) -> str | None:
        """See :meth:`daemon.store._storage.Storage.read_best_name`."""
        return self._for(root).read_best_name(root)

    def write_best_name(self, root: RootConfig, name: str | None) -> None:
        """See :meth:`daemon.store._storage.Storage.write_best_name`."""
        return self._for(root).write_best_name(root, name)

    def write_facts(self, root: RootConfig, facts: StepRetention) -> None:
        """See :meth:`daemon.store._storage.Storage.write_facts`."""
        return self._for(root).write_facts(root, facts)

    def read_facts(self, root: RootConfig) -> dict[int, StepRetention]:
        """See :meth:`daemon.store._storage.Storage.read_facts`."""
        return self._for(root).read_facts(root)

    def remove_facts(self, root: RootConfig, step: int) -> None:
        """See :meth:`daemon.store._storage.Storage.remove_facts`."""
        return self._for(root).remove_facts(root, step)

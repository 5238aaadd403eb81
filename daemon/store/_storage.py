"""The storage interface: every effect the daemon has on a checkpoint root, in its words.

Everything above ``daemon.store`` (the server, node coordination, retention, the
operator commands) reaches a root only through a :class:`Storage`. Each call is blocking
I/O: the daemon runs it in the root's lane (:mod:`daemon.store._lanes`), never on the
event loop. :class:`daemon.store._local.LocalStorage` is the POSIX implementation; a
second backend (an object store) is another class with these methods, chosen by the
root's configuration, not edits across the daemon.

A method names what it achieves (``set_aside``, ``claim``, ``retire``), not the calls
that achieve it: on a POSIX root ``promote`` is fsyncs and one rename, elsewhere it may
be one conditional write. What each guarantees is in the docstring of the module that
implements it for POSIX, named below.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Protocol

from orchestrator.protocol import AttemptMarker, FileEntry, RootInfo

from ..config._config import RootConfig
from ._attempts import Prepared, StagedMarker
from ._facts import StepRetention
from ._gc import KeptEntry, TmpDir
from ._markers import NodeMarker, Outcome, Seen, Verdict
from ._promote import Promotion
from ._steps import Found, ManifestCache
from ._verify import Manifest

__all__ = ["Storage"]


class Storage(Protocol):
    """What the daemon does to its roots (blocking; run in the root's lane)."""

    # Verification and promotion (daemon.store._verify, daemon.store._promote).

    def scan_save(
        self,
        root: RootConfig,
        step: int,
        world_size: int,
        reported: dict[int, tuple[FileEntry, ...]],
        attempt: str = "",
        source: str | None = None,
    ) -> Manifest:
        """Verify a save's files against what its ranks reported; its manifest.

        Raises:
            VerificationError: the save is incomplete or not what was reported.
        """
        ...

    def read_manifest(self, path: str) -> Manifest:
        """The manifest of the promoted checkpoint at ``path``."""
        ...

    def verify_checkpoint(self, path: str) -> list[str]:
        """What is wrong with the promoted checkpoint at ``path`` (empty: nothing)."""
        ...

    def entries(self, root: RootConfig) -> list[str]:
        """The names in the root (checkpoints, save directories, pointers), sorted."""
        ...

    def set_aside_entries(self, root: RootConfig) -> list[str]:
        """The names in the root's trash (failed attempts set aside), sorted."""
        ...

    def read_layout(self, root: RootConfig) -> RootInfo | None:
        """The root's layout file, written by a daemon that serves it; None if absent."""
        ...

    def identity(self, path: str) -> tuple[int, int]:
        """An identity of the directory ``path`` that changes if it is replaced."""
        ...

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
        """Make the verified step a checkpoint, durably, and move the pointer.

        ``flushed``: files (relative to the save's directory) other nodes flushed
        before their markers, which need no flush here.

        Raises:
            PromotionError: nothing became visible, or what did was undone.
        """
        ...

    def finish(self, root: RootConfig, step: int, pointer_node: str | None = None) -> Promotion:
        """Finish a promotion that became visible before a restart."""
        ...

    def promoted(self, root: RootConfig, step: int) -> bool:
        """Whether ``step`` of ``root`` is a promoted checkpoint (``step_N`` exists)."""
        ...

    def promoted_durably(self, root: RootConfig, step: int) -> bool:
        """Whether ``step_N`` is a promotion of this root's step N, known durable.

        Its manifest names this root and step, and the root is fsynced now: for a node
        with no save of the step, whose rename may be another daemon's.
        """
        ...

    def writing(self, root: RootConfig, step: int) -> bool:
        """Whether ``step`` of ``root`` has a save directory (``tmp_step_N`` exists)."""
        ...

    def present(self, path: str) -> bool:
        """Whether anything (a checkpoint, a save directory) is at ``path`` in a root."""
        ...

    def directory(self, path: str) -> bool:
        """Whether ``path`` in a root is a directory (a save set aside, a checkpoint)."""
        ...

    def promotion_landed(self, root: RootConfig, step: int, tmp: str) -> bool:
        """Whether a rename of ``tmp`` to ``step_N`` happened (``step_N`` and no ``tmp``)."""
        ...

    def check_tmp_dir(self, root: RootConfig, step: int) -> None:
        """Refuse a new save whose directories are already unusable.

        Raises:
            RequestError: the step is promoted already, or its save directory is a
                symlink or not a directory.
        """
        ...

    def read_pointer(self, root: RootConfig) -> int | None:
        """The step the root's pointer (``latest``) names, if any."""
        ...

    def latest_promoted(self, root: RootConfig) -> int | None:
        """The step the pointer names, if that checkpoint exists."""
        ...

    def locate(self, root: RootConfig, step: int) -> str:
        """Where readers load the promoted step (``step_N``; an object store's URL).

        Raises:
            FileNotFoundError: the step is not promoted.
        """
        ...

    def sync_root(self, root: RootConfig) -> None:
        """Make the root's entries (renames into and out of it) durable."""
        ...

    def write_layout(self, root: RootConfig) -> bool:
        """Record the root's naming for trainers; whether it changed."""
        ...

    # Attempts (daemon.store._attempts).

    def stage_attempt(
        self, root: RootConfig, step: int, attempt: str, world_size: int, run: str = ""
    ) -> StagedMarker | None:
        """The attempt's marker, made durable before the root's lock where that is possible.

        Handed to :meth:`prepare` (and closed after it); None where nothing can be staged.
        """
        ...

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
        """Make ``tmp_step_N`` the attempt's (of run ``run``): mark it, setting aside another's.

        Without ``sync``, the directories in ``Prepared.unsynced`` are the caller's to flush.
        ``staged`` is this attempt's marker from :meth:`stage_attempt`.
        """
        ...

    def read_attempt(self, tmp: str) -> AttemptMarker | None:
        """The attempt marker of the save directory ``tmp``, if it has one."""
        ...

    def set_aside(
        self, root: RootConfig, step: int, attempt: str, *, sync: bool = True
    ) -> str | None:
        """Move a failed attempt's directory into the root's trash; where it went.

        Without ``sync``, the caller flushes :meth:`set_aside_dirs` once it moved.
        """
        ...

    def set_aside_dirs(self, root: RootConfig) -> tuple[str, ...]:
        """The directories a set-aside changes (the trash, the root, a staging directory)."""
        ...

    def flush_dirs(self, paths: Sequence[str]) -> None:
        """Flush the entries of each directory; concurrent flushes of one are shared."""
        ...

    # Node markers and verdicts on a shared root (daemon.store._markers).

    def write_marker(
        self, root: RootConfig, step: int, marker: NodeMarker, *, durable: bool = True
    ) -> None:
        """Write (or replace) this node's marker in the step's directory."""
        ...

    def read_markers(self, root: RootConfig, step: int, seen: Seen) -> list[NodeMarker]:
        """Every node's marker in ``tmp_step_N`` (re-reading only what changed)."""
        ...

    def read_markers_in(self, tmp: str, seen: Seen) -> list[NodeMarker]:
        """Every node's marker in the directory ``tmp``."""
        ...

    def check_files(
        self, root: RootConfig, step: int, files: Mapping[int, Sequence[FileEntry]]
    ) -> list[str]:
        """What is wrong with this node's reported files on disk (empty: nothing).

        Files found whole are durable when it returns (a local or shared root flushes
        each; an object is durable once stored), which this node's marker then says.
        """
        ...

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
        """Record an attempt's outcome where every node looks for it."""
        ...

    def read_verdict(self, root: RootConfig, step: int, attempt: str) -> Verdict | None:
        """An attempt's recorded verdict, if one was written."""
        ...

    def read_outcome(
        self, root: RootConfig, step: int, attempt: str, *, full: bool = True
    ) -> Outcome | None:
        """An attempt's outcome as other nodes learn it: verdict or promoted step."""
        ...

    def spanning_attempt(self, root: RootConfig, step: int) -> AttemptMarker | None:
        """The attempt of ``tmp_step_N`` if other nodes' markers are in it."""
        ...

    # Fences (daemon.store._fence).

    def claim(
        self, root: RootConfig, step: int, node: str, attempt: str, tmp: str | None = None
    ) -> None:
        """Fence the step for this node's promotion.

        Raises:
            ClaimedError: another node or attempt holds it.
        """
        ...

    def release(
        self, root: RootConfig, step: int, node: str, attempt: str, tmp: str | None = None
    ) -> None:
        """Drop this node's claim of the step."""
        ...

    def claimed(self, root: RootConfig, step: int) -> bool:
        """Whether some node claims the step (a promotion may be under way)."""
        ...

    # gc (daemon.store._gc).

    def tmp_dirs(
        self, root: RootConfig, failed: Mapping[int, str], busy: Collection[int], min_age: float
    ) -> list[TmpDir]:
        """The save directories ``gc`` may remove."""
        ...

    def kept_entries(self, root: RootConfig) -> list[KeptEntry]:
        """What the root's trash keeps for inspection."""
        ...

    def unknown_tmp_dirs(self, root: RootConfig, known: Collection[int]) -> list[int]:
        """Steps with a save directory the daemon knows nothing of."""
        ...

    def doom(
        self, root: RootConfig, steps: Iterable[int], kept: Iterable[str]
    ) -> tuple[list[str], dict[str, str]]:
        """Move save directories and kept entries to be removed in the background."""
        ...

    def sync_doomed(self, root: RootConfig) -> None:
        """Make what :meth:`doom` moved durable."""
        ...

    # Retention (daemon.store._steps).

    def scan_steps(self, root: RootConfig, cache: ManifestCache) -> list[Found]:
        """Every ``step_N`` of the root with its manifest's facts."""
        ...

    def leader_node(self, root: RootConfig, step: int) -> str | None:
        """The node that led a promoted step, from its markers."""
        ...

    def free_space(self, root: RootConfig) -> tuple[int, int]:
        """Bytes of the root's filesystem available to the daemon, and its size."""
        ...

    def read_named_pointer(self, root: RootConfig, name: str) -> int | None:
        """The step a named pointer (``best``) names, if any."""
        ...

    def write_pointer(self, root: RootConfig, name: str, step: int) -> None:
        """Point the named pointer at ``step``."""
        ...

    def retire(
        self, root: RootConfig, steps: Iterable[int]
    ) -> tuple[dict[int, str], dict[int, str]]:
        """Move retired checkpoints into the trash: moved and refused, by step."""
        ...

    def training_info_metrics(self, path: str) -> dict[str, float]:
        """The metrics in a checkpoint's ``training_info.json``."""
        ...

    def remove_pointer(self, root: RootConfig, name: str) -> bool:
        """Remove a pointer the daemon wrote (one naming a step); whether it did."""
        ...

    def read_best_name(self, root: RootConfig) -> str | None:
        """The name of the ``best`` pointer last written into the root."""
        ...

    def write_best_name(self, root: RootConfig, name: str | None) -> None:
        """Record the root's ``best`` pointer name (None: it has none)."""
        ...

    def write_facts(self, root: RootConfig, facts: StepRetention) -> None:
        """Record a step's pin, hold and metrics on the root, durably."""
        ...

    def read_facts(self, root: RootConfig) -> dict[int, StepRetention]:
        """Every step's pin, hold and metrics the root records."""
        ...

    def remove_facts(self, root: RootConfig, step: int) -> None:
        """Forget a retired step's facts on the root."""
        ...

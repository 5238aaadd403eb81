"""The object-store storage: :class:`S3Storage`, for ``s3://BUCKET/PREFIX`` roots.

:class:`daemon.store._storage.Storage` where nothing can be renamed. An attempt's ranks
write under its own prefix; promotion is verification (:mod:`daemon.store._s3commit`)
and one create-only commit object; pointers move by compare-and-swap
(:mod:`daemon.store._s3pointers`). Each root is probed once before use
(:mod:`daemon.store._s3probe`): a root whose store ignores conditional writes, or that
cannot be reached, fails its own requests with the reason, and no other root's.
Retention, gc and facts are in :mod:`daemon.store._s3keep`; node markers, verdicts
and claims in :mod:`daemon.store._s3nodes`.
"""

from __future__ import annotations

import errno
import re
import threading
from collections.abc import Callable, Collection, Sequence
from datetime import UTC, datetime

import msgspec

from orchestrator.protocol import LAYOUT_FILE, AttemptMarker, ErrorCode, FileEntry, RootInfo

from ..base._errors import PromotionError, RequestError
from ..base._faults import crash_point
from ..config._config import RootConfig
from . import _s3commit as commits
from . import _s3pointers as pointers
from ._attempts import Prepared, StagedMarker, encode_marker
from ._promote import Promotion
from ._s3client import Bucket, Listed, Precondition, StoreError
from ._s3commit import Commit
from ._s3keep import S3Keep
from ._s3nodes import S3Nodes
from ._s3probe import probe
from ._verify import Manifest

__all__ = ["S3Storage"]

_URL = re.compile(r"^(s3://[^/]+(?:/.*?)?)/([^/]+?)(\d+)(?:/([^/]+))?$")


class S3Storage(S3Keep, S3Nodes):
    """The verification, promotion and attempts of ``s3://`` roots (see the module).

    Args:
        bucket_for: Builds the :class:`Bucket` of a root (tests pass one that counts or
            fails requests); default one over botocore with the root's options.
        probe_roots: Probe each root's store before its first use.
    """

    def __init__(
        self,
        bucket_for: Callable[[RootConfig], Bucket] | None = None,
        *,
        probe_roots: bool = True,
    ) -> None:
        self._bucket_for = bucket_for or (lambda root: Bucket(root.path, root.s3))
        self._probe = probe_roots
        self._lock = threading.Lock()
        self._buckets: dict[str, Bucket] = {}
        self._roots: dict[str, RootConfig] = {}
        self._probed: dict[str, StoreError | None] = {}
        self._scans: dict[tuple[str, int, str], tuple[dict[str, Listed], dict[str, str]]] = {}

    # -- roots and their buckets ---------------------------------------------------

    def register(self, root: RootConfig) -> None:
        """Know ``root``, so that URLs in it are read with its settings (no request)."""
        self._roots[root.path] = root

    def bucket(self, root: RootConfig) -> Bucket:
        """The root's bucket, probed before first use.

        Raises:
            StoreError: the store refused the probe, or could not be reached for it.
        """
        with self._lock:
            bucket = self._buckets.get(root.path)
            if bucket is None:
                bucket = self._buckets[root.path] = self._bucket_for(root)
                self._roots[root.path] = root
        if self._probe:
            self._check(root, bucket)
        return bucket

    def _check(self, root: RootConfig, bucket: Bucket) -> None:
        if root.path not in self._probed:
            try:
                probe(bucket)
            except StoreError as exc:
                # A refusal sticks (the store lies); a failure to reach it is tried again.
                if exc.errno == errno.EPROTO:
                    self._probed[root.path] = exc
                raise
            self._probed[root.path] = None
        refused = self._probed[root.path]
        if refused is not None:
            raise refused

    def root_of(self, path: str) -> tuple[RootConfig, int | None, str]:
        """The root, the step and the attempt (or "") a URL in a root names.

        Raises:
            FileNotFoundError: the URL names no step of a known root.
        """
        for known, root in sorted(self._roots.items(), key=lambda kv: -len(kv[0])):
            if path == known:
                return root, None, ""
            if path.startswith(known + "/"):
                first, _, rest = path[len(known) + 1 :].partition("/")
                step = root.parse_step(first, root.final_prefix)
                if step is None:
                    step = root.parse_step(first, root.tmp_prefix)
                return root, step, rest.split("/")[0] if rest else ""
        match = _URL.match(path)
        if match is None:
            raise FileNotFoundError(errno.ENOENT, "not a step of an s3:// root", path)
        base, prefix, digits, attempt = match.groups()
        root = RootConfig(path=base, real=base, final_prefix=prefix)
        self.bucket(root)
        return root, int(digits), attempt or ""

    # -- verification and promotion --------------------------------------------------

    def scan_save(
        self,
        root: RootConfig,
        step: int,
        world_size: int,
        reported: dict[int, tuple[FileEntry, ...]],
        attempt: str = "",
        source: str | None = None,
    ) -> Manifest:
        """See :func:`daemon.store._s3commit.scan_attempt`."""
        bucket = self.bucket(root)
        if not attempt:
            marker = commits.read_marker(bucket, root, step)
            attempt = marker.attempt if marker is not None else ""
        manifest, objects, etags = commits.scan_attempt(
            bucket, root, step, world_size, reported, attempt
        )
        self._scans[(root.path, step, attempt)] = (objects, etags)
        return manifest

    def url(self, root: RootConfig, step: int, attempt: str) -> str:
        """Where readers load attempt ``attempt`` of step N."""
        return root.save_dir(step, attempt)

    def read_manifest(self, path: str) -> Manifest:
        """The manifest in the commit object of the step ``path`` names."""
        root, step, _ = self.root_of(path)
        if step is None:
            raise FileNotFoundError(errno.ENOENT, "not a step", path)
        found = commits.read_commit(self.bucket(root), root, step)
        if found is None:
            raise FileNotFoundError(errno.ENOENT, "not committed", path)
        return found[0].manifest

    def read_commit(self, root: RootConfig, step: int) -> Commit | None:
        """Step N's commit object, if it is committed."""
        found = commits.read_commit(self.bucket(root), root, step)
        return None if found is None else found[0]

    def verify_checkpoint(self, path: str) -> list[str]:
        """What is wrong with the committed step at ``path`` (empty: nothing)."""
        try:
            root, step, _ = self.root_of(path)
        except FileNotFoundError:
            return [f"{path} names no step of an s3:// root"]
        if step is None:
            return [f"{path} names no step"]
        bucket = self.bucket(root)
        found = commits.read_commit(bucket, root, step)
        if found is None:
            return [f"{root.final_dir(step)} has no commit object: it is not a checkpoint"]
        commit = found[0]
        base = commits.attempt_name(root, step, commit.attempt)
        return commits.verify_commit(bucket, commit, base)

    def identity(self, path: str) -> tuple[int, int]:
        """An attempt's prefix is never replaced: its identity is constant once it exists.

        Raises:
            FileNotFoundError: the step has no attempt marker.
        """
        root, step, _ = self.root_of(path)
        if step is None or commits.read_marker(self.bucket(root), root, step) is None:
            raise FileNotFoundError(errno.ENOENT, "no attempt of the step", path)
        return 0, 0

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
        """Journal the intent, write the commit object create-only, move ``latest``.

        ``flushed`` is not needed: every object is durable once stored.

        Raises:
            PromotionError: another attempt's commit object is there (the step is that
                attempt's), or the store failed the write; nothing was committed.
        """
        bucket = self.bucket(root)
        attempt = manifest.attempt
        scanned = self._scans.pop((root.path, step, attempt), None)
        if scanned is None:  # verified by another storage object: list what is there now
            base = commits.attempt_name(root, step, attempt)
            listed = (i for i in bucket.listing(base) if isinstance(i, Listed))
            now = {i.key[len(base) + 1 :]: i for i in listed}
            scanned = {r: o for r, o in now.items() if not commits.own_object(r)}, {}
        objects, etags = scanned
        if intent is not None:
            intent()
        url = self.url(root, step, attempt)
        commit = Commit(
            root=root.path,
            step=step,
            attempt=attempt,
            url=url,
            committed=datetime.now(UTC).isoformat(),
            objects={rel: (o.size, o.etag) for rel, o in sorted(objects.items())},
            metadata=etags,
            manifest=manifest,
        )
        name = commits.commit_name(root, step)
        try:
            bucket.put(name, msgspec.json.encode(commit), create=True)
        except Precondition:
            found = commits.read_commit(bucket, root, step)
            if found is None or found[0].attempt != attempt:
                other = "none readable" if found is None else f"attempt {found[0].attempt}"
                raise PromotionError(
                    errno.EEXIST,
                    f"{bucket.url}/{name} exists ({other}): another daemon committed step "
                    f"{step} first; this attempt stands down",
                ) from None
            # Our own commit, written before a restart or a retried request.
        except StoreError as exc:
            raise PromotionError(exc.errno or errno.EIO, f"commit failed: {exc}") from None
        crash_point("after_commit")
        return self._after_commit(root, step, attempt)

    def _after_commit(self, root: RootConfig, step: int, attempt: str) -> Promotion:
        url = self.url(root, step, attempt)
        try:
            moved = pointers.advance(self.bucket(root), root.pointer, step, attempt, url)
            error = None
        except StoreError as exc:
            moved, error = False, f"{root.pointer} not moved: {exc.strerror or exc}"
        crash_point("after_pointer")
        return Promotion(path=url, pointer_moved=moved, pointer_error=error)

    def finish(self, root: RootConfig, step: int, pointer_node: str | None = None) -> Promotion:
        """Move the pointer of a step committed before a restart.

        Raises:
            PromotionError: the step has no commit object.
        """
        commit = self.read_commit(root, step)
        if commit is None:
            raise PromotionError(errno.ENOENT, f"{root.final_dir(step)} is not committed")
        return self._after_commit(root, step, commit.attempt)

    def promoted(self, root: RootConfig, step: int) -> bool:
        """Whether step N's commit object exists."""
        return self.bucket(root).head(commits.commit_name(root, step)) is not None

    def promoted_durably(self, root: RootConfig, step: int) -> bool:
        """Whether step N's commit object exists and names this root and step."""
        commit = self.read_commit(root, step)
        return commit is not None and commit.root == root.path

    def writing(self, root: RootConfig, step: int) -> bool:
        """Whether step N has an attempt marker and no commit object."""
        bucket = self.bucket(root)
        if bucket.head(commits.marker_name(root, step)) is None:
            return False
        return bucket.head(commits.commit_name(root, step)) is None

    def present(self, path: str) -> bool:
        """Whether step ``path`` names is committed or being written (any object of it)."""
        try:
            root, step, attempt = self.root_of(path)
        except FileNotFoundError:
            return False
        if step is None:
            return True
        bucket = self.bucket(root)
        if attempt:
            return any(True for _ in _first(bucket, commits.attempt_name(root, step, attempt)))
        if path == root.final_dir(step):
            return self.promoted(root, step)
        return bucket.head(commits.marker_name(root, step)) is not None

    def directory(self, path: str) -> bool:
        """See :meth:`present` (prefixes stand for directories)."""
        return self.present(path)

    def promotion_landed(self, root: RootConfig, step: int, tmp: str) -> bool:
        """Whether the step's commit object is there, naming the attempt now marked."""
        commit = self.read_commit(root, step)
        if commit is None:
            return False
        marker = commits.read_marker(self.bucket(root), root, step)
        return marker is None or marker.attempt == commit.attempt

    def check_tmp_dir(self, root: RootConfig, step: int) -> None:
        """Refuse a save of a committed step, or of a root whose store is refused.

        Raises:
            RequestError: ``already_promoted``, or ``invalid_state`` with the store's
                error (a refused store, denied credentials, a missing bucket, an
                unreachable endpoint): a retry would not help until it is fixed.
        """
        try:
            promoted = self.promoted(root, step)
        except StoreError as exc:
            raise RequestError(
                ErrorCode.INVALID_STATE, f"the store of {root.path} is unusable: {exc.strerror}"
            ) from None
        if promoted:
            raise RequestError(
                ErrorCode.ALREADY_PROMOTED, f"{root.final_dir(step)} is committed already"
            )

    def read_pointer(self, root: RootConfig) -> int | None:
        """The step the root's ``latest`` object names, if any."""
        found = pointers.read_pointer(self.bucket(root), root.pointer)
        return None if found is None else found[0].step

    def latest_promoted(self, root: RootConfig) -> int | None:
        """The step ``latest`` names, if that step's commit object exists."""
        step = self.read_pointer(root)
        return step if step is not None and self.promoted(root, step) else None

    def locate(self, root: RootConfig, step: int) -> str:
        """Where readers load committed step N (its attempt's prefix).

        Raises:
            FileNotFoundError: the step is not committed.
        """
        commit = self.read_commit(root, step)
        if commit is None:
            raise FileNotFoundError(errno.ENOENT, "not committed", root.final_dir(step))
        return commit.url

    def sync_root(self, root: RootConfig) -> None:
        """Nothing to do: a completed PUT is durable and visible."""

    def write_layout(self, root: RootConfig) -> bool:
        """Probe the store, then record the root's naming for trainers; whether it changed.

        Raises:
            StoreError: the store is refused (it ignores conditional writes) or failed.
        """
        bucket = self.bucket(root)
        info = RootInfo(root.path, root.tmp_prefix, root.final_prefix, root.pointer)
        data = msgspec.json.encode(info) + b"\n"  # as on a filesystem root
        got = bucket.get(LAYOUT_FILE)
        if got is not None and got[0] == data:
            return False
        bucket.put(LAYOUT_FILE, data)
        return True

    # -- attempts ----------------------------------------------------------------------

    def stage_attempt(
        self, root: RootConfig, step: int, attempt: str, world_size: int, run: str = ""
    ) -> StagedMarker | None:
        """Nothing to stage: a PUT is durable when it returns."""
        return None

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
        """Mark step N as attempt ``attempt``'s; a previous attempt's objects stay put.

        A PUT is durable when it returns: ``sync`` and ``staged`` change nothing, and
        nothing is left for the caller to flush.

        Raises:
            StoreError: the marker could not be written.
        """
        bucket = self.bucket(root)
        previous = commits.read_marker(bucket, root, step)
        if previous is not None and previous.attempt == attempt:
            return Prepared()
        data = encode_marker(root, step, attempt, world_size, run)
        # The attempt's own marker first (what verification checks, never replaced),
        # then the step's current one (what a daemon without its journal reads).
        bucket.put(commits.own_marker_name(root, step, attempt), data)
        bucket.put(commits.marker_name(root, step), data)
        if previous is None:
            return Prepared(created=True)
        moved = self.url(root, step, previous.attempt)
        return Prepared(moved=moved, foreign=previous.attempt)

    def read_attempt(self, tmp: str) -> AttemptMarker | None:
        """The attempt marker of the step ``tmp`` names."""
        try:
            root, step, _ = self.root_of(tmp)
        except FileNotFoundError:
            return None
        if step is None:
            return None
        return commits.read_marker(self.bucket(root), root, step)

    def set_aside(
        self, root: RootConfig, step: int, attempt: str, *, sync: bool = True
    ) -> str | None:
        """Nothing moves: the failed attempt's objects stay under their own prefix.

        The next attempt writes under another prefix, so it may begin at once; gc removes
        the failed one. Returns where it is kept. (``sync``: nothing to flush.)
        """
        return self.url(root, step, attempt)

    def set_aside_dirs(self, root: RootConfig) -> tuple[str, ...]:
        """The prefixes a set-aside would change: the root's (nothing is moved on a store)."""
        return root.path, root.path

    def flush_dirs(self, paths: Sequence[str]) -> None:
        """Nothing: an object store has no directory entries to flush."""


def _first(bucket: Bucket, name: str) -> list[Listed | str]:
    for item in bucket.listing(name):
        return [item]
    return []

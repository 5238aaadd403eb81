"""Node markers, verdicts and claims on an object store (:class:`S3Nodes`, a mixin).

Each is a small object in the attempt's own prefix (``step_N/ATTEMPT/``), so that
nothing of one attempt is ever read as another's: a node's marker
``.ckptd-node-NODE.json`` (rewritten as the node's ranks finish), the leader's verdict
``.ckptd-verdict.json`` and the promotion claim ``.ckptd-claim``, both written with
``If-None-Match: *``: of two writers exactly one wins, and the other reads what won.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping, Sequence
from typing import Final, Literal, Protocol

import msgspec

from orchestrator.protocol import AttemptMarker, FileEntry

from ..config._config import RootConfig
from . import _s3commit as commits
from ._fence import Claim, ClaimedError
from ._markers import NODE_PREFIX, NodeMarker, Outcome, Seen, Verdict, marker_name, now_iso
from ._s3client import Bucket, Listed, Precondition
from ._s3commit import Commit

__all__ = ["S3Nodes"]

_VERDICT: Final = ".ckptd-verdict.json"
_CLAIM: Final = ".ckptd-claim"


class _Roots(Protocol):
    def bucket(self, root: RootConfig) -> Bucket: ...

    def root_of(self, path: str) -> tuple[RootConfig, int | None, str]: ...

    def read_commit(self, root: RootConfig, step: int) -> Commit | None: ...


def _current(bucket: Bucket, root: RootConfig, step: int) -> str | None:
    marker = commits.read_marker(bucket, root, step)
    return None if marker is None else marker.attempt


def _markers(bucket: Bucket, base: str) -> list[NodeMarker]:
    found: list[NodeMarker] = []
    for item in bucket.listing(base):
        if not isinstance(item, Listed):
            continue
        name = item.key.rsplit("/", 1)[-1]
        if not (name.startswith(NODE_PREFIX) and name.endswith(".json")):
            continue
        got = bucket.get(item.key)
        if got is None:
            continue
        try:
            found.append(msgspec.json.decode(got[0], type=NodeMarker))
        except msgspec.DecodeError:
            continue
    return sorted(found, key=lambda m: m.node)


class S3Nodes:
    """Markers, verdicts and claims of ``s3://`` roots; mixed into :class:`S3Storage`."""

    def write_marker(
        self: _Roots, root: RootConfig, step: int, marker: NodeMarker, *, durable: bool = True
    ) -> None:
        """Write (or replace) this node's marker in the attempt's prefix."""
        base = commits.attempt_name(root, step, marker.attempt)
        self.bucket(root).put(f"{base}/{marker_name(marker.node)}", msgspec.json.encode(marker))

    def read_markers(self: _Roots, root: RootConfig, step: int, seen: Seen) -> list[NodeMarker]:
        """Every node's marker of the step's current attempt."""
        bucket = self.bucket(root)
        attempt = _current(bucket, root, step)
        if attempt is None:
            return []
        return _markers(bucket, commits.attempt_name(root, step, attempt))

    def read_markers_in(self: _Roots, tmp: str, seen: Seen) -> list[NodeMarker]:
        """Every node's marker of the attempt ``tmp`` names (or the step's current one)."""
        try:
            root, step, attempt = self.root_of(tmp)
        except FileNotFoundError:
            return []
        if step is None:
            return []
        bucket = self.bucket(root)
        attempt = attempt or _current(bucket, root, step) or ""
        if not attempt:
            return []
        return _markers(bucket, commits.attempt_name(root, step, attempt))

    def check_files(
        self: _Roots, root: RootConfig, step: int, files: Mapping[int, Sequence[FileEntry]]
    ) -> list[str]:
        """What is wrong with this node's reported files in the current attempt's prefix."""
        bucket = self.bucket(root)
        attempt = _current(bucket, root, step)
        if attempt is None:
            return [f"{root.final_dir(step)} has no attempt marker"]
        base = commits.attempt_name(root, step, attempt)
        sizes = {
            i.key[len(base) + 1 :]: i.size for i in bucket.listing(base) if isinstance(i, Listed)
        }
        problems: list[str] = []
        for rank, entries in sorted(files.items()):
            for entry in entries:
                size = sizes.get(entry.path)
                if size is None:
                    problems.append(f"rank {rank} reported {entry.path}, which is missing")
                elif size < entry.size:
                    problems.append(
                        f"{entry.path} is {size} bytes; rank {rank} reported {entry.size}"
                    )
        return problems

    def write_verdict(
        self: _Roots,
        root: RootConfig,
        step: int,
        attempt: str,
        node: str,
        reason: str,
        *,
        promoted: bool = False,
    ) -> None:
        """Record an attempt's outcome, create-only: the first verdict stands."""
        state: Literal["failed", "promoted"] = "promoted" if promoted else "failed"
        verdict = Verdict(
            attempt=attempt, step=step, node=node, reason=reason, written=now_iso(), state=state
        )
        name = f"{commits.attempt_name(root, step, attempt)}/{_VERDICT}"
        try:
            self.bucket(root).put(name, msgspec.json.encode(verdict), create=True)
        except Precondition:
            pass  # a verdict is there already; it stands

    def read_verdict(self: _Roots, root: RootConfig, step: int, attempt: str) -> Verdict | None:
        """An attempt's recorded verdict, if one was written."""
        name = f"{commits.attempt_name(root, step, attempt)}/{_VERDICT}"
        got = self.bucket(root).get(name)
        if got is None:
            return None
        try:
            return msgspec.json.decode(got[0], type=Verdict)
        except msgspec.DecodeError:
            return None

    def read_outcome(
        self: _Roots, root: RootConfig, step: int, attempt: str, *, full: bool = True
    ) -> Outcome | None:
        """An attempt's outcome: its verdict, or the commit object (ours or another's).

        Without ``full`` only the verdict is read (a waiting node's cheap look).
        """
        verdict = S3Nodes.read_verdict(self, root, step, attempt)
        if verdict is not None:
            if verdict.state == "promoted":
                return Outcome("promoted", root.save_dir(step, attempt))
            return Outcome("failed", verdict.reason)
        if not full:
            return None
        commit = self.read_commit(root, step)
        if commit is not None:
            if commit.attempt == attempt:
                return Outcome("promoted", commit.url)
            return Outcome("failed", f"step {step} was committed from attempt {commit.attempt}")
        owner = _current(self.bucket(root), root, step)
        if owner is not None and owner != attempt:
            return Outcome("superseded", owner)
        return None

    def spanning_attempt(self: _Roots, root: RootConfig, step: int) -> AttemptMarker | None:
        """The step's current attempt, if any node's marker is in its prefix."""
        bucket = self.bucket(root)
        marker = commits.read_marker(bucket, root, step)
        if marker is None:
            return None
        base = commits.attempt_name(root, step, marker.attempt)
        return marker if _markers(bucket, base) else None

    def claim(
        self: _Roots, root: RootConfig, step: int, node: str, attempt: str, tmp: str | None = None
    ) -> None:
        """Claim the step's promotion, create-only; idempotent for the same holder.

        Raises:
            ClaimedError: another node or attempt holds it.
        """
        bucket = self.bucket(root)
        name = f"{commits.step_name(root, step)}/{_CLAIM}"
        data = msgspec.json.encode(Claim(node=node, attempt=attempt, written=now_iso()))
        try:
            bucket.put(name, data, create=True)
        except Precondition:
            got = bucket.get(name)
            held = None
            if got is not None:
                try:
                    held = msgspec.json.decode(got[0], type=Claim)
                except msgspec.DecodeError:
                    held = None
            if held is not None and held.node == node and held.attempt == attempt:
                return
            who = "an unreadable claim" if held is None else f"node {held.node} ({held.written})"
            raise ClaimedError(
                errno.EEXIST, f"step {step} is claimed for promotion by {who}"
            ) from None

    def release(
        self: _Roots, root: RootConfig, step: int, node: str, attempt: str, tmp: str | None = None
    ) -> None:
        """Drop this node's claim of the step (only ours)."""
        bucket = self.bucket(root)
        name = f"{commits.step_name(root, step)}/{_CLAIM}"
        got = bucket.get(name)
        if got is None:
            return
        try:
            held = msgspec.json.decode(got[0], type=Claim)
        except msgspec.DecodeError:
            return
        if held.node == node and held.attempt == attempt:
            bucket.delete(name)

    def claimed(self: _Roots, root: RootConfig, step: int) -> bool:
        """Whether some node claims the step."""
        name = f"{commits.step_name(root, step)}/{_CLAIM}"
        return self.bucket(root).head(name) is not None

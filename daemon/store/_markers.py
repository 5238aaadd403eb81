"""Node markers and verdicts: the evidence nodes leave each other on the shared filesystem.

A save that spans nodes is coordinated through files only, on the filesystem the
checkpoint lives on:

- ``tmp_step_N/.ckptd-node-<node>.json``: one node's word on the attempt. ``writing``
  once its first rank began, ``done`` (with its ranks' files and sizes) once all of them
  are done and their files checked, ``failed`` (with why) if anything failed there.
  Written to a unique temp name, fsynced, renamed, the directory fsynced.
- ``ROOT/.ckptd-verdicts/<tmp dir>.attempt-<id>.json``: the leader's verdict on a failed
  attempt, outside the directory it sets aside, so that every node can read it.
- A promotion's verdict is the manifest of ``step_N``, which names its attempt.

Shared filesystems cache lookups and attributes for seconds: markers are found by
listing the directory, re-read only when their inode, size or time changed, and read
with ``open()`` (which revalidates on NFS, where ``stat`` may not). Blocking I/O only.
"""

from __future__ import annotations

import errno
import math
import os
import re
import stat
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Final, Literal, TypeVar

import msgspec

from orchestrator.protocol import ATTEMPT_MARKER, AttemptMarker, FileEntry

from ..config._config import RootConfig
from ..ledger._saves import SaveRecord
from ._durable import make_dir, write_atomic

__all__ = [
    "CLAIM",
    "NODE_PREFIX",
    "VERDICTS",
    "NodeMarker",
    "Outcome",
    "Seen",
    "check_files",
    "is_marker_name",
    "marker_for",
    "marker_name",
    "read_markers",
    "read_markers_in",
    "read_outcome",
    "read_verdict",
    "spanning_attempt",
    "write_marker",
    "write_verdict",
]

NODE_PREFIX: Final = ".ckptd-node-"
"""Name prefix of node markers in ``tmp_step_N``."""
VERDICTS: Final = ".ckptd-verdicts"
"""Directory in each root holding the leader's verdicts on failed spanning attempts."""
NODE_NAME: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
"""What a node name may be: it becomes part of a file name."""
_MAX_MARKER: Final = 64 * 1024 * 1024
_MANIFEST: Final = ".ckptd-manifest.json"  # daemon.store._verify.MANIFEST_NAME (which imports us)
CLAIM: Final = ".ckptd-claim"
"""The promotion claim in ``tmp_step_N`` (:mod:`daemon.store._fence`)."""

NodeState = Literal["writing", "done", "failed"]


class NodeMarker(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One node's word on one attempt of a save that spans nodes."""

    format: str = "ckptd-node/1"
    node: str
    attempt: str
    step: int
    world_size: int
    local_world_size: int
    state: NodeState
    files: dict[str, list[FileEntry]] = {}
    """Each done rank (as a string) with the files it reported."""
    reason: str = ""
    """Why it failed (``failed``)."""
    written: str = ""
    """When (ISO 8601, UTC)."""
    flushed: bool = False
    """``done``: the node flushed its ranks' files before writing this marker, so the
    leader need not (False in a marker from before nodes did)."""

    def ranks(self) -> dict[int, list[FileEntry]]:
        """The done ranks and their files."""
        return {int(r): entries for r, entries in self.files.items()}


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    """The leader's verdict on an attempt: failed (and why), or promoted and durable."""

    format: str = "ckptd-verdict/1"
    attempt: str
    step: int
    node: str
    reason: str
    written: str
    state: Literal["failed", "promoted"] = "failed"


Seen = dict[str, tuple[int, int, int, float]]
"""Marker name -> (inode, size, mtime in ns) as last read, and when (monotonic) an
unchanged ``writing`` marker is read again (infinity for ``done`` and ``failed``)."""
WRITING_REREAD: Final = 1.0
"""Seconds after which an unchanged ``writing`` marker is read again: its replacement by
the ``done`` one can keep the cached attributes (on NFS, ``open()`` sees it first)."""
REREADS_PER_S: Final = 20.0
"""At most this many unchanged ``writing`` markers are read again a second, however many
nodes write: each is read again about every ``max(WRITING_REREAD, writing / REREADS_PER_S)``
seconds, in slots of its own."""
_UNKNOWN_INO: Final = frozenset({0, 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF})
"""Inode numbers a directory listing gives when the filesystem does not say (some FUSE
servers): such an entry is always measured with a stat."""


class Outcome(msgspec.Struct, frozen=True):
    """What the shared directory says of an attempt, as a node other than the leader sees it.

    ``state`` is ``promoted`` (``detail``: the checkpoint), ``failed`` (``detail``: why),
    ``superseded`` (``detail``: the attempt that now owns the step's directory) or
    ``renamed`` (``detail``: the checkpoint, whose rename the leader has not yet said is
    durable).
    """

    state: Literal["promoted", "failed", "superseded", "renamed"]
    detail: str


def marker_name(node: str) -> str:
    """The file name of ``node``'s marker."""
    return f"{NODE_PREFIX}{node}.json"


def is_marker_name(name: str) -> bool:
    """Whether ``name`` (a top-level entry of ``tmp_step_N``) is a node marker or its temp."""
    return name.startswith(NODE_PREFIX) and (name.endswith(".json") or name.endswith(".tmp"))


def now_iso() -> str:
    """The wall-clock time, ISO 8601 UTC."""
    return datetime.now(UTC).isoformat()


def write_marker(root: RootConfig, step: int, marker: NodeMarker, *, durable: bool = True) -> None:
    """Write ``marker`` into ``tmp_step_N``, replacing this node's previous one.

    Only into a directory that is the marker's attempt's: another attempt's directory
    (one that replaced ours) is left alone.

    Raises:
        OSError: it cannot be written, or (``ESTALE``) the directory is another attempt's.
    """
    tmp = root.tmp_dir(step)
    owner = _attempt_of(tmp)
    if owner != marker.attempt:
        raise OSError(errno.ESTALE, f"{tmp} is attempt {owner or '(none)'}'s now", tmp)
    path = os.path.join(tmp, marker_name(marker.node))
    write_atomic(path, msgspec.json.encode(marker), sync_dir=durable)


def read_markers(root: RootConfig, step: int, seen: Seen) -> list[NodeMarker]:
    """Node markers in ``tmp_step_N`` that are new or changed since ``seen`` (updated).

    A directory that is gone reads as no markers; an unreadable marker is skipped (and
    read again next time).
    """
    return read_markers_in(root.tmp_dir(step), seen)


def read_markers_in(tmp: str, seen: Seen) -> list[NodeMarker]:
    """Node markers in directory ``tmp`` that are new or changed since ``seen``.

    One listing of the directory, and per marker only what it needs: a marker is
    replaced by renaming a new file over it, so an entry whose inode (which the listing
    gives, without a stat) is the one last read is that same file, and is neither
    measured nor read again, except an unchanged ``writing`` marker now and then (its
    replacement may hide behind a cached listing; ``open()`` sees through it). The
    leader's look costs one listing plus an open (measured through the open file) and
    a read per marker that changed.
    """
    out: list[NodeMarker] = []
    try:
        entries = list(os.scandir(tmp))
    except (FileNotFoundError, NotADirectoryError):
        return out
    now = time.monotonic()
    read: list[tuple[str, tuple[int, int, int], NodeMarker]] = []
    for entry in entries:
        if not (entry.name.startswith(NODE_PREFIX) and entry.name.endswith(".json")):
            continue
        last = seen.get(entry.name)
        ino = entry.inode()
        known = ino not in _UNKNOWN_INO
        if last is not None and known and ino == last[0] and now < last[3]:
            continue
        if not known and last is not None and now < last[3]:
            # No inode in the listing: a stat tells whether the marker changed.
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if (st.st_ino, st.st_size, st.st_mtime_ns) == last[:3]:
                continue
        # Opened first and measured through the open file: one lookup, not two.
        fd = _open(entry.path)
        if fd is None:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                continue
            marker = _decode(fd, NodeMarker)
        finally:
            os.close(fd)
        if marker is not None:
            read.append((entry.name, (st.st_ino, st.st_size, st.st_mtime_ns), marker))
    for name, tag, _ in read:
        seen[name] = (*tag, math.inf)
    # Each writing marker just read is read again in the first free slot after the
    # others', slots 1 / REREADS_PER_S apart: however many markers a look finds (the
    # first finds a whole job's), no more than that many fall due in a second.
    slot = max((last[3] for last in seen.values() if last[3] != math.inf), default=-math.inf)
    for name, tag, marker in read:
        again = math.inf
        if marker.state == "writing":
            slot = again = max(slot + 1.0 / REREADS_PER_S, now + WRITING_REREAD)
        seen[name] = (*tag, again)
        out.append(marker)
    return out


def check_files(root: RootConfig, step: int, files: Mapping[int, Sequence[FileEntry]]) -> list[str]:
    """Problems with the files this node's ranks reported: missing, short, or unflushed.

    Each file is opened (which revalidates a cached entry on NFS), measured through the
    open file and flushed: on the machine that wrote it, whose client holds whatever of
    it is not yet on the server, so that the leader need not flush it again.
    """
    tmp = root.tmp_dir(step)
    problems: list[str] = []
    for rank, entries in sorted(files.items()):
        for entry in entries:
            path = os.path.join(tmp, entry.path)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError as exc:
                problems.append(f"{entry.path}: reported by rank {rank} but {exc.strerror}")
                continue
            try:
                size = os.fstat(fd).st_size
                if size >= entry.size:
                    os.fsync(fd)
            except OSError as exc:
                problems.append(f"{entry.path}: cannot be flushed: {exc.strerror or exc}")
                continue
            finally:
                os.close(fd)
            if size < entry.size:
                problems.append(
                    f"{entry.path}: {size} bytes on disk, rank {rank} reported {entry.size}"
                )
    return problems


def verdict_path(root: RootConfig, step: int, attempt: str) -> str:
    """Where the leader's verdict on failed attempt ``attempt`` goes."""
    base = os.path.basename(root.tmp_dir(step))
    return os.path.join(root.path, VERDICTS, f"{base}.attempt-{attempt}.json")


def write_verdict(
    root: RootConfig, step: int, attempt: str, node: str, reason: str, *, promoted: bool = False
) -> None:
    """Durably record the leader's verdict on attempt ``attempt`` of step ``step``.

    It failed, and why; or, with ``promoted``, its promotion is durable (the root was
    fsynced after the rename).

    Raises:
        OSError: it cannot be written.
    """
    make_dir(root.path, VERDICTS)
    state: Literal["failed", "promoted"] = "promoted" if promoted else "failed"
    verdict = Verdict(
        attempt=attempt, step=step, node=node, reason=reason, written=now_iso(), state=state
    )
    write_atomic(verdict_path(root, step, attempt), msgspec.json.encode(verdict))


def read_verdict(root: RootConfig, step: int, attempt: str) -> Verdict | None:
    """The leader's verdict on attempt ``attempt``, if it gave one."""
    return _read(verdict_path(root, step, attempt), Verdict)


def read_outcome(root: RootConfig, step: int, attempt: str, *, full: bool = True) -> Outcome | None:
    """What became of attempt ``attempt``, if the shared directory says yet.

    Promoted: the leader's verdict says so, written once the rename was durable. Failed:
    its verdict, or ``step_N`` promoted from another attempt. Superseded: ``tmp_step_N``
    carries another attempt's marker (the leader set ours aside and a new attempt
    began). Renamed: ``step_N``'s manifest names the attempt but no verdict says yet that
    the rename is durable.

    With ``full`` false only the verdict is read: one lookup while there is none, all
    a waiting node needs as long as the leader can write its verdict (the rest is for
    a leader that could not).
    """
    final = root.final_dir(step)
    verdict = read_verdict(root, step, attempt)
    if verdict is not None:
        if verdict.state == "promoted":
            return Outcome("promoted", final)
        return Outcome("failed", verdict.reason)
    if not full:
        return None
    manifest = _read(os.path.join(final, _MANIFEST), _ManifestAttempt)
    if manifest is not None:
        if manifest.attempt == attempt:
            return Outcome("renamed", final)
        return Outcome("failed", f"step {step} was promoted from attempt {manifest.attempt}")
    owner = _attempt_of(root.tmp_dir(step))
    if owner is not None and owner != attempt:
        return Outcome("superseded", owner)
    return None


class _ManifestAttempt(msgspec.Struct, frozen=True):
    attempt: str = ""


class _AttemptOnly(msgspec.Struct, frozen=True):
    attempt: str = ""


def _attempt_of(tmp: str) -> str | None:
    marker = _read(os.path.join(tmp, ATTEMPT_MARKER), _AttemptOnly)
    return None if marker is None else marker.attempt


_T = TypeVar("_T")


def _read(path: str, kind: type[_T]) -> _T | None:
    """``path`` decoded as ``kind``; None if it is missing, unreadable or malformed."""
    fd = _open(path)
    if fd is None:
        return None
    try:
        return _decode(fd, kind)
    finally:
        os.close(fd)


def _open(path: str) -> int | None:
    """``path`` opened to read (never following a symlink, never blocking), or None."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None


def _decode(fd: int, kind: type[_T]) -> _T | None:
    """The open file ``fd`` decoded as ``kind``; None if unreadable or malformed."""
    try:
        chunks: list[bytes] = []
        total = 0
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
            total += len(chunk)
            if total > _MAX_MARKER:
                return None
    except OSError:
        return None
    try:
        return msgspec.json.decode(b"".join(chunks), type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def marker_for(
    save: SaveRecord, node: str, state: NodeState, reason: str = "", *, flushed: bool = False
) -> NodeMarker:
    """This node's marker for ``save`` in ``state`` (its local ranks' files once done).

    ``flushed``: those files were flushed here (:func:`check_files`).
    """
    files = {}
    if state == "done":
        files = {str(r): list(save.ranks[r].files) for r in sorted(save.local_ranks())}
    return NodeMarker(
        node=node,
        attempt=save.attempt,
        step=save.key.step,
        world_size=save.world_size,
        local_world_size=save.local_world_size,
        state=state,
        files=files,
        reason=reason,
        written=now_iso(),
        flushed=flushed,
    )


def spanning_attempt(root: RootConfig, step: int) -> AttemptMarker | None:
    """The attempt marker of ``tmp_step_N`` if the directory holds a spanning node marker.

    Node markers of fewer ranks than the step's are written only by a save that spans
    nodes: such a directory belongs to a multi-node attempt, live or left behind. None
    when there is no directory, no attempt marker, or no such node marker: a one-node
    save's own marker (written once its ranks were done) is not one, and neither is the
    temporary file of a marker whose write a crash cut short (it proves nothing).
    """
    tmp = root.tmp_dir(step)
    try:
        names = os.listdir(tmp)
    except (FileNotFoundError, NotADirectoryError):
        return None
    final = [n for n in names if n.startswith(NODE_PREFIX) and n.endswith(".json")]
    if ATTEMPT_MARKER not in names or not final:
        return None  # a marker's temporary file alone (a write cut short) proves nothing
    try:
        with open(os.path.join(tmp, ATTEMPT_MARKER), "rb") as fh:
            found = msgspec.json.decode(fh.read(65536), type=AttemptMarker)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    # A one-node save's marker (all its ranks on one node) is no sign of other nodes.
    markers = [m for m in read_markers_in(tmp, {}) if isinstance(m, NodeMarker)]
    if len(markers) == len(final) and all(m.local_world_size >= m.world_size for m in markers):
        return None
    return found

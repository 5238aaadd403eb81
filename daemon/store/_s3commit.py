"""The commit rule on an object store: verify an attempt's prefix, then one create-only write.

Layout of an ``s3://BUCKET/PREFIX`` root (``step_`` is the root's ``final_prefix``)::

    step_N/.ckptd-attempt         the attempt now writing step N (replaced per attempt)
    step_N/ATTEMPT/...            that attempt's objects: shards, .metadata, small files
    step_N/.ckptd-commit.json     the commit object: step N is a checkpoint iff it exists

Ranks write only under their attempt's own prefix, so a retry never mixes with, nor
deletes, a failed attempt's objects, and may begin at once. Verification is a paginated
LIST of that prefix, a GET of each DCP ``.metadata`` or ``__R.metadata`` (parsed by the
inert parser of :mod:`daemon.store._dcpmeta`), and the sizes against what ranks reported and what
``.metadata`` records. The commit is one ``PUT`` with ``If-None-Match: *`` of a
:class:`Commit` naming the attempt and every key with its size and ETag: a second
writer gets 412 and stands down. Readers trust a step only through that object.
"""

from __future__ import annotations

import posixpath
from datetime import UTC, datetime
from typing import Final

import msgspec

from orchestrator.protocol import ATTEMPT_MARKER, AttemptMarker, FileEntry

from ..base._errors import VerificationError
from ..config._config import RootConfig
from ._dcpdir import GLOBAL_METADATA as _GLOBAL
from ._dcpdir import rank_metadata_rank
from ._dcpmeta import DcpMetadataError, referenced_shards
from ._s3client import Bucket, Listed
from ._verify import Manifest

__all__ = [
    "COMMIT_NAME",
    "Commit",
    "attempt_name",
    "commit_name",
    "marker_name",
    "own_marker_name",
    "own_object",
    "read_commit",
    "scan_attempt",
    "step_name",
    "verify_commit",
]

COMMIT_NAME: Final = ".ckptd-commit.json"
"""The commit object's name in ``step_N/``."""
_OWN: Final = ".ckptd-"
_MAX_OBJECTS: Final = 1_000_000
_MAX_PROBLEMS: Final = 20
_MAX_METADATA: Final = 256 * 1024 * 1024


class Commit(msgspec.Struct, frozen=True, kw_only=True):
    """The commit object of one step: which attempt it is, and every object of it."""

    format: str = "ckptd-commit/1"
    root: str
    step: int
    attempt: str
    url: str
    """Where readers load the checkpoint (``FsspecReader(url)``)."""
    committed: str
    """When (ISO 8601, UTC)."""
    objects: dict[str, tuple[int, str]]
    """Every key of the attempt, relative to :attr:`url`, with its size and ETag."""
    metadata: dict[str, str]
    """Each DCP ``.metadata`` (relative) with the ETag it was verified at."""
    manifest: Manifest
    """What verification found, as a filesystem root's manifest records it."""


def step_name(root: RootConfig, step: int) -> str:
    """``step_N``: the prefix of step N, relative to the root."""
    return f"{root.final_prefix}{step}"


def commit_name(root: RootConfig, step: int) -> str:
    """The commit object of step N, relative to the root."""
    return f"{step_name(root, step)}/{COMMIT_NAME}"


def marker_name(root: RootConfig, step: int) -> str:
    """The attempt marker of step N, relative to the root."""
    return f"{step_name(root, step)}/{ATTEMPT_MARKER}"


def own_marker_name(root: RootConfig, step: int, attempt: str) -> str:
    """The attempt's own marker, in its prefix: never replaced by another attempt's."""
    return f"{attempt_name(root, step, attempt)}/{ATTEMPT_MARKER}"


def attempt_name(root: RootConfig, step: int, attempt: str) -> str:
    """The prefix of one attempt of step N, relative to the root."""
    return f"{step_name(root, step)}/{attempt}"


def own_object(relative: str) -> bool:
    """Whether a key (relative to an attempt) is ckptd's own (markers, verdicts)."""
    return posixpath.basename(relative).startswith(_OWN)


def read_commit(bucket: Bucket, root: RootConfig, step: int) -> tuple[Commit, str] | None:
    """Step N's commit object and its ETag; None if the step is not committed.

    Raises:
        StoreError: the store failed the read, or the object is not a commit of this step.
    """
    got = bucket.get(commit_name(root, step))
    if got is None:
        return None
    try:
        commit = msgspec.json.decode(got[0], type=Commit)
    except msgspec.DecodeError as exc:
        raise VerificationError(f"{bucket.url}/{commit_name(root, step)}: {exc}") from None
    if commit.step != step:
        raise VerificationError(f"{bucket.url}/{commit_name(root, step)} names step {commit.step}")
    return commit, got[1]


def read_marker(
    bucket: Bucket, root: RootConfig, step: int, attempt: str = ""
) -> AttemptMarker | None:
    """The attempt marker of step N (the current attempt's, or ``attempt``'s own)."""
    got = bucket.get(own_marker_name(root, step, attempt) if attempt else marker_name(root, step))
    if got is None:
        return None
    try:
        return msgspec.json.decode(got[0], type=AttemptMarker)
    except msgspec.DecodeError:
        return None


def scan_attempt(
    bucket: Bucket,
    root: RootConfig,
    step: int,
    world_size: int,
    reported: dict[int, tuple[FileEntry, ...]],
    attempt: str,
) -> tuple[Manifest, dict[str, Listed], dict[str, str]]:
    """Check that attempt ``attempt`` of step N is complete; its manifest, objects, metadata.

    Checks: the attempt's own marker names it; every file a rank reported is an object
    of at least its size; every directory with ``*.distcp`` shards has a ``.metadata``
    (or, saved without collectives, a ``__R.metadata`` per rank) whose referenced
    shards are objects of at least the sizes it records; an attempt with objects that
    no rank reported and no metadata covers is refused (an unknown save form).

    Raises:
        VerificationError: with every problem found (up to a bound), joined by ``; ``.
    """
    marker = read_marker(bucket, root, step, attempt)
    where = f"{bucket.url}/{attempt_name(root, step, attempt)}"
    if marker is None or marker.attempt != attempt or marker.step != step:
        raise VerificationError(f"{where} has no marker of attempt {attempt}: not ckptd's")
    base = attempt_name(root, step, attempt)
    objects: dict[str, Listed] = {}
    for item in bucket.listing(base):
        assert isinstance(item, Listed)
        rel = item.key[len(base) + 1 :]
        if not own_object(rel):
            objects[rel] = item
        if len(objects) > _MAX_OBJECTS:
            raise VerificationError(f"{where} holds more than {_MAX_OBJECTS} objects")
    problems: list[str] = []
    for rank, entries in sorted(reported.items()):
        for entry in entries:
            rel = posixpath.normpath(entry.path)
            got = objects.get(rel)
            if got is None:
                problems.append(f"rank {rank} reported {rel}, which is not in {where}")
            elif got.size < entry.size:
                problems.append(f"{rel} is {got.size} bytes; rank {rank} reported {entry.size}")
    dcp_dirs = sorted(
        {posixpath.dirname(r) or "." for r in objects if r.endswith(".distcp")}
        | {posixpath.dirname(r) or "." for r in objects if _is_metadata(posixpath.basename(r))}
    )
    etags: dict[str, str] = {}
    for d in dcp_dirs:
        problems += _check_dcp_dir(bucket, base, where, d, objects, etags)
    if objects and not dcp_dirs and not any(reported.values()):
        problems.append(
            f"{where}: unknown save form, nothing to verify: no rank reported a file, and "
            "it holds no DCP metadata (.metadata, __R.metadata)"
        )
    if not objects:
        problems.append(f"{where} holds no objects")
    if problems:
        shown = problems[:_MAX_PROBLEMS]
        more = len(problems) - len(shown)
        raise VerificationError("; ".join(shown) + (f"; and {more} more" if more else ""))
    manifest = Manifest(
        root=root.path,
        step=step,
        world_size=world_size,
        created=datetime.now(UTC).isoformat(),
        bytes=sum(o.size for o in objects.values()),
        files={rel: o.size for rel, o in sorted(objects.items())},
        dirs=sorted({posixpath.dirname(r) or "." for r in objects} | {"."}, reverse=True),
        dcp_dirs=dcp_dirs,
        ranks={str(r): sorted(e.path for e in es) for r, es in reported.items()},
        attempt=attempt,
    )
    return manifest, objects, etags


def _is_metadata(name: str) -> bool:
    return name == _GLOBAL or rank_metadata_rank(name) is not None


def _check_dcp_dir(
    bucket: Bucket,
    base: str,
    where: str,
    d: str,
    objects: dict[str, Listed],
    etags: dict[str, str],
) -> list[str]:
    """The problems of one DCP directory of the attempt.

    Its global ``.metadata``, or else each rank's ``__R.metadata``
    (``use_collectives=False``), which must then cover every ``__R_*.distcp`` shard.
    The ETag of each metadata read goes to ``etags``.
    """
    prefix = "" if d == "." else f"{d}/"
    names = {
        r[len(prefix) :] for r in objects if r.startswith(prefix) and "/" not in r[len(prefix) :]
    }
    per_rank = sorted(n for n in names if rank_metadata_rank(n) is not None)
    if _GLOBAL in names:
        metas = [_GLOBAL, *per_rank]
    elif per_rank:
        metas = per_rank
    else:
        return [f"{where}/{d}: shards without .metadata"]
    problems: list[str] = []
    for name in metas:
        meta = f"{prefix}{name}"
        got_meta = bucket.get(f"{base}/{meta}")
        if got_meta is None:
            problems.append(f"{where}/{meta} vanished while it was verified")
            continue
        data, etags[meta] = got_meta
        try:
            refs = referenced_shards(data, max_bytes=_MAX_METADATA)
        except DcpMetadataError as exc:
            problems.append(f"{where}/{meta}: {exc}")
            continue
        for ref in refs:
            rel = posixpath.normpath(f"{prefix}{ref.relative_path}")
            shard = objects.get(rel)
            if shard is None:
                problems.append(f"{where}/{meta} references {rel}, which is missing")
            elif shard.size < ref.min_size:
                problems.append(f"{rel} is {shard.size} bytes; {name} records {ref.min_size}")
    if _GLOBAL not in names:
        ranks = {rank_metadata_rank(n) for n in per_rank}
        for name in sorted(names):
            shard_rank = _shard_rank(name)
            if shard_rank is not None and shard_rank not in ranks:
                problems.append(f"{prefix}{name}: no __{shard_rank}.metadata covers it")
    return problems


def _shard_rank(name: str) -> int | None:
    """The rank of a DCP shard ``__R_N.distcp``; None for any other name."""
    if not (name.startswith("__") and name.endswith(".distcp")):
        return None
    rank, _, rest = name[2 : -len(".distcp")].partition("_")
    return int(rank) if rank.isdigit() and rest.isdigit() else None


def verify_commit(bucket: Bucket, commit: Commit, base: str) -> list[str]:
    """What is wrong with a committed attempt now (empty: nothing); one paginated LIST.

    Every object the commit names must be there with its size and ETag.
    """
    listed = {}
    for item in bucket.listing(base):
        assert isinstance(item, Listed)
        listed[item.key[len(base) + 1 :]] = item
    problems: list[str] = []
    for rel, (size, etag) in sorted(commit.objects.items()):
        got = listed.get(rel)
        if got is None:
            problems.append(f"{rel} is missing")
        elif got.size != size or (etag and got.etag and got.etag != etag):
            problems.append(f"{rel} changed since the commit ({got.size} bytes, ETag {got.etag})")
        if len(problems) >= _MAX_PROBLEMS:
            break
    return problems

"""Checking one DCP directory on disk against its metadata, in either of DCP's forms.

torch's ``FileSystemWriter`` finishes a save in one of two ways:

- **global metadata** (collectives on, the default): after gathering every rank's
  write results, the coordinator writes one ``.metadata`` naming every shard;
- **per-rank metadata** (``use_collectives=False``): each rank writes its own
  ``__R.metadata`` naming only its own shards (``__R_0.distcp``, ...), and there is
  no ``.metadata``; ``dcp.load`` falls back to the loading rank's file.

Both files are the same pickle of DCP's ``Metadata``, parsed here without executing
anything (:mod:`daemon.store._dcpmeta`). In the per-rank form nothing on disk says how
many ranks wrote: a rank that wrote nothing at all is caught by its own report (it
reports its ``__R.metadata``), not here. What is caught here: every metadata file
parses, every shard it references exists with the size it records, and every
``__R_*.distcp`` shard on disk is covered by its rank's metadata (or the global one).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from typing import Final

from ._dcpmeta import DEFAULT_MAX_BYTES, DcpMetadataError, ShardRef, referenced_shards

__all__ = ["GLOBAL_METADATA", "check_dcp_dir", "rank_metadata_rank"]

GLOBAL_METADATA: Final = ".metadata"
"""The coordinator's metadata file, naming every rank's shards."""
_RANK_METADATA: Final = re.compile(r"__(\d{1,9})\.metadata")
_SHARD: Final = re.compile(r"__(\d{1,9})_\d{1,9}\.distcp")
_MAX_SHOWN: Final = 200  # characters of a hostile path shown in a problem string


def rank_metadata_rank(name: str) -> int | None:
    """The rank whose per-rank metadata file ``name`` is (``__3.metadata``: 3), else None."""
    found = _RANK_METADATA.fullmatch(name)
    return int(found.group(1)) if found else None


def _show(path: str) -> str:
    return path if path.isprintable() and len(path) <= _MAX_SHOWN else ascii(path[:_MAX_SHOWN])


def _read_metadata(path: str) -> bytes:
    """Read a regular file of at most DEFAULT_MAX_BYTES without blocking on FIFOs."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        data = f.read(DEFAULT_MAX_BYTES + 1)
    if len(data) > DEFAULT_MAX_BYTES:
        raise DcpMetadataError(f"larger than {DEFAULT_MAX_BYTES} bytes")
    return data


def _shard_problem(root: str, ref: ShardRef) -> str | None:
    rel = ref.relative_path
    if not rel or "\0" in rel:
        return "invalid path in metadata"
    if os.path.isabs(rel):
        return "absolute path in metadata"
    if ".." in rel.split(os.sep):
        return "path escapes the checkpoint directory"
    real = os.path.realpath(os.path.join(root, rel))
    if os.path.commonpath([root, real]) != root:
        return "path resolves outside the checkpoint directory"
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_size < ref.min_size:
        return f"{st.st_size} bytes on disk, metadata needs at least {ref.min_size}"
    return None


def _check_metadata(path: str, root: str, name: str) -> tuple[list[str], set[str]]:
    """The problems of one metadata file ``name`` in ``path``, and the shards it names."""
    try:
        shards = referenced_shards(_read_metadata(os.path.join(path, name)))
    except FileNotFoundError:
        return [f"{name}: missing"], set()
    except OSError as exc:
        return [f"{name}: unreadable ({exc.strerror or exc})"], set()
    except DcpMetadataError as exc:
        return [f"{name}: unparseable ({exc})"], set()
    problems = []
    for ref in shards:
        problem = _shard_problem(root, ref)
        if problem is not None:
            problems.append(f"{_show(ref.relative_path)}: {problem}")
    return problems, {os.path.normpath(ref.relative_path) for ref in shards}


def _names(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []  # the metadata's own read says why (missing, not a directory, ...)


def check_dcp_dir(path: str) -> list[str]:
    """Return the problems (empty list = OK) found in one DCP directory.

    The directory's form is read from what it holds: a ``.metadata`` (global form), or
    else ``__R.metadata`` files (per-rank form; each is checked, and every
    ``__R_*.distcp`` must have its rank's). A directory with neither reports
    ``.metadata: missing``. Reported besides: a metadata file unreadable or
    unparseable; a referenced file missing, not a regular file, or smaller than its
    ``min_size``; a ``relative_path`` that is absolute or escapes the directory (a
    ``..`` component, or a symlink that resolves outside it). Subdirectories inside
    the directory are allowed. This does blocking filesystem I/O; callers run it in a
    worker thread.

    Args:
        path: The DCP checkpoint directory (the one holding the metadata).

    Returns:
        Human-readable problems, each prefixed with the offending path relative to
        ``path``, e.g. ``"__1_0.distcp: 1024 bytes on disk, metadata needs at least
        4096"``.
    """
    names = _names(path)
    per_rank = sorted((r, n) for n in names if (r := rank_metadata_rank(n)) is not None)
    root = os.path.realpath(path)
    if GLOBAL_METADATA in names or not per_rank:
        problems, _ = _check_metadata(path, root, GLOBAL_METADATA)
        for _rank, name in per_rank:  # stale beside a global one? they must hold too
            problems += _check_metadata(path, root, name)[0]
        return problems
    problems = []
    covered: set[str] = set()
    for _rank, name in per_rank:
        found, named = _check_metadata(path, root, name)
        problems += found
        covered |= named
    ranks = {rank for rank, _ in per_rank}
    for name in sorted(names):
        shard = _SHARD.fullmatch(name)
        if shard is None or name in covered:
            continue
        rank = int(shard.group(1))
        if rank not in ranks:  # a rank's shards whose metadata never landed
            problems.append(f"{name}: no __{rank}.metadata (rank {rank}'s metadata) covers it")
    return problems

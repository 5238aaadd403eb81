"""Proof that a save is complete on disk, and the manifest that records it.

Blocking filesystem reads only; the server runs these in worker threads. Nothing here
unpickles or imports torch: DCP ``.metadata`` and ``__R.metadata`` are parsed by
:mod:`daemon.store._dcpmeta` (checked by :mod:`daemon.store._dcpdir`), safetensors
headers and their index by :mod:`daemon.store._safetensors`.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Final, NoReturn

import msgspec

from orchestrator.protocol import ATTEMPT_MARKER, FileEntry

from ..base._errors import VerificationError
from ..config._config import RootConfig
from ._attempts import TRASH, read_marker
from ._dcpdir import check_dcp_dir
from ._markers import CLAIM, is_marker_name
from ._origin import Origin
from ._safetensors import check_index, check_safetensors, is_index, is_safetensors

__all__ = ["MANIFEST_NAME", "Manifest", "read_manifest", "scan_save", "verify_checkpoint"]

MANIFEST_NAME: Final = ".ckptd-manifest.json"
"""Written inside every promoted checkpoint; ``ckptd verify`` checks against it."""

_MAX_FILES: Final = 1_000_000
_MAX_PROBLEMS: Final = 20
_MAX_LISTED: Final = 5  # files named in the refusal of a step with nothing to verify


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """What a promoted checkpoint held at promotion: every file and its size."""

    format: str = "ckptd-manifest/1"
    root: str
    step: int
    world_size: int
    created: str
    bytes: int
    origin: Origin | None = None
    """The directory the manifest was written in (:mod:`daemon.store._origin`), set at
    promotion: a ``step_N`` whose own origin differs is a copy. None: promoted before
    manifests recorded it (such a checkpoint is taken as the daemon's, as then)."""
    files: dict[str, int]
    """Every regular file, relative to the checkpoint directory, with its size."""
    dirs: list[str]
    """Every directory, relative (``.`` is the checkpoint itself), deepest first."""
    dcp_dirs: list[str]
    """Directories holding DCP shards; each had a ``.metadata`` covering its shards."""
    ranks: dict[str, list[str]] = msgspec.field(default_factory=dict)
    """The files each rank reported in its ``done``."""
    attempt: str = ""
    """The attempt whose files these are ("" if promoted before attempts had ids)."""


def scan_save(
    root: RootConfig,
    step: int,
    world_size: int,
    reported: dict[int, tuple[FileEntry, ...]],
    attempt: str = "",
    source: str | None = None,
) -> Manifest:
    """Check that ``tmp_step_N`` holds a complete checkpoint; describe it.

    Checks: the tmp directory is a real directory inside the root; it is attempt
    ``attempt``'s (its marker names it; not checked for ""); it holds no symlink leading
    outside it and no special files; every file a rank reported exists with at least its
    size; every directory with ``*.distcp`` shards has a ``.metadata`` (or, saved
    without collectives, a ``__R.metadata`` per rank) whose referenced shards exist with
    the sizes it records; every ``*.safetensors`` file's header is well-formed and its
    tensors' data lies within the file; every safetensors index names files that exist
    and hold its tensors. A step with nothing to verify (no rank reported a file and
    none of those forms is there) is refused: its save form is unknown.

    Raises:
        VerificationError: with every problem found (up to a bound), joined by ``; ``.
    """
    tmp = source or root.tmp_dir(step)
    real_tmp = _checked_tmp(root, tmp)
    files: dict[str, int] = {}
    dirs: list[str] = []
    dcp_dirs: list[str] = []
    problems: list[str] = []
    if attempt:
        marker = read_marker(tmp)
        owner = "no attempt" if marker is None else f"attempt {marker.attempt}"
        if marker is None or marker.attempt != attempt:
            # Never promote one attempt's ledger over another attempt's files.
            raise VerificationError(f"{tmp} belongs to {owner}, not to attempt {attempt}")
    for dirpath, listed in _walk(tmp):
        rel_dir = os.path.relpath(dirpath, tmp)
        dirs.append(rel_dir)
        has_shards = False
        for item in listed:
            rel = os.path.normpath(os.path.join(rel_dir, item.name))
            if _bookkeeping(rel) and item.is_file(follow_symlinks=False):
                # The daemon's own file (a node marker, thousands on a large job): its
                # kind, which the listing gives, is all that is checked, with no stat.
                continue
            try:
                st = item.stat(follow_symlinks=False)
            except OSError as exc:  # removed or replaced while the save is scanned
                problems.append(f"{rel}: changed during verification ({exc.strerror})")
                continue
            if stat.S_ISLNK(st.st_mode):
                if not _inside(os.path.realpath(item.path), real_tmp):
                    target = os.readlink(item.path)
                    problems.append(f"{rel}: symlink to {target!r} leaves the save")
            elif stat.S_ISREG(st.st_mode):
                if not _bookkeeping(rel):
                    files[rel] = st.st_size
                    problems += _form_problems(rel, item.path)
                has_shards = has_shards or item.name.endswith(".distcp")
            elif not stat.S_ISDIR(st.st_mode):
                problems.append(f"{rel}: not a regular file or directory")
        if has_shards:
            dcp_dirs.append(rel_dir)
            problems += [_join(rel_dir, p) for p in check_dcp_dir(dirpath)]
        if len(files) > _MAX_FILES:
            raise VerificationError(f"{tmp} holds more than {_MAX_FILES} files")
    for rank, entries in sorted(reported.items()):
        for entry in entries:
            size = files.get(os.path.normpath(entry.path))
            if size is None and _bookkeeping(os.path.normpath(entry.path)):
                size = _size(os.path.join(tmp, entry.path))  # e.g. a rank listing every file
            if size is None:
                problems.append(f"{entry.path}: reported by rank {rank} but missing")
            elif size < entry.size:
                problems.append(
                    f"{entry.path}: {size} bytes on disk, rank {rank} reported {entry.size}"
                )
    if not problems and not dcp_dirs and not any(reported.values()):
        if not any(is_safetensors(os.path.basename(rel)) for rel in files):
            problems.append(_nothing_to_verify(tmp, files))
    if problems:
        more = len(problems) - _MAX_PROBLEMS
        shown = problems[:_MAX_PROBLEMS] + ([f"... and {more} more"] if more > 0 else [])
        raise VerificationError("; ".join(shown))
    return Manifest(
        root=root.path,
        step=step,
        world_size=world_size,
        created=datetime.now(UTC).isoformat(),
        bytes=sum(files.values()),
        files=dict(sorted(files.items())),
        dirs=dirs,
        dcp_dirs=sorted(dcp_dirs),
        ranks={str(r): [e.path for e in es] for r, es in sorted(reported.items())},
        attempt=attempt,
    )


def read_manifest(path: str) -> Manifest:
    """The manifest of the promoted checkpoint at ``path``. Blocking I/O.

    Raises:
        VerificationError: it is missing or unreadable.
    """
    manifest_path = os.path.join(path, MANIFEST_NAME)
    try:
        with open(manifest_path, "rb") as fh:
            return msgspec.json.decode(fh.read(), type=Manifest)
    except FileNotFoundError:
        raise VerificationError(f"{manifest_path}: missing (not promoted by ckptd?)") from None
    except (OSError, msgspec.DecodeError) as exc:
        raise VerificationError(f"{manifest_path}: unreadable: {exc}") from exc


def _form_problems(rel: str, path: str) -> list[str]:
    """The problems of one file that its save form's own rules find (safetensors)."""
    name = os.path.basename(rel)
    if is_safetensors(name):
        return [f"{rel}: {p}" for p in check_safetensors(path)]
    if is_index(name):
        return [f"{rel}: {p}" for p in check_index(path)]
    return []


def _nothing_to_verify(tmp: str, files: dict[str, int]) -> str:
    """Why a step no report and no metadata vouch for is refused: its form is unknown."""
    listed = ", ".join(sorted(files)[:_MAX_LISTED])
    more = len(files) - _MAX_LISTED
    held = f"it holds {listed}" + (f" and {more} more" if more > 0 else "") if files else "empty"
    return (
        f"{tmp}: unknown save form, nothing to verify: no rank reported a file, and it "
        f"holds no DCP metadata (.metadata, __R.metadata) and no safetensors file ({held})"
    )


def _bookkeeping(rel: str) -> bool:
    """Whether ``rel`` is the daemon's own file, not one of the checkpoint's.

    The manifest, the attempt marker, the promotion claim, node markers, and the temp
    file of any of them left by a crash.
    """
    if "/" in rel:
        return False
    return is_marker_name(rel) or any(
        rel == name or (rel.startswith(f"{name}.") and rel.endswith(".tmp"))
        for name in (MANIFEST_NAME, ATTEMPT_MARKER, CLAIM)
    )


def verify_checkpoint(path: str) -> list[str]:
    """Offline check of a promoted checkpoint against its manifest.

    Returns:
        Problems found; empty when every recorded file is present with its recorded
        size and every DCP directory's ``.metadata`` is satisfied.
    """
    try:
        manifest = read_manifest(path)
    except VerificationError as exc:
        return [str(exc)]
    problems: list[str] = []
    real = os.path.realpath(path)
    for rel, size in manifest.files.items():
        full = os.path.join(path, rel)
        if not _inside(os.path.realpath(full), real):
            problems.append(f"{rel}: leaves the checkpoint")
            continue
        try:
            actual = os.stat(full).st_size
        except OSError as exc:
            problems.append(f"{rel}: {exc.strerror or exc}")
            continue
        if actual != size:
            problems.append(f"{rel}: {actual} bytes, manifest records {size}")
        else:
            problems += _form_problems(rel, full)
    for rel_dir in manifest.dcp_dirs:
        full = os.path.normpath(os.path.join(path, rel_dir))
        if not _inside(os.path.realpath(full), real):
            problems.append(f"{rel_dir}: leaves the checkpoint")
            continue
        problems += [_join(rel_dir, p) for p in check_dcp_dir(full)]
    return problems


def _walk(top: str) -> Iterator[tuple[str, list[os.DirEntry[str]]]]:
    """Each directory under ``top`` (``top`` last, deepest first) with its entries.

    Like ``os.walk(top, topdown=False)``, never following a symlink, but each entry is
    a :class:`os.DirEntry`, whose kind the listing gives without a stat.

    Raises:
        VerificationError: a directory cannot be listed.
    """
    try:
        with os.scandir(top) as it:
            entries = list(it)
    except OSError as exc:
        _raise(exc)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            yield from _walk(entry.path)
    yield top, entries


def _size(path: str) -> int | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _checked_tmp(root: RootConfig, tmp: str) -> str:
    try:
        st = os.lstat(tmp)
    except FileNotFoundError:
        raise VerificationError(f"{tmp} does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise VerificationError(f"{tmp} is a symlink; refusing to promote through it")
    if not stat.S_ISDIR(st.st_mode):
        raise VerificationError(f"{tmp} is not a directory")
    real_tmp = os.path.realpath(tmp)
    real_root = os.path.realpath(root.path)
    real_staging = os.path.realpath(root.staging_dir)
    # The save's own tmp directory, or a failed attempt's set aside in the root's trash.
    if os.path.dirname(real_tmp) not in (real_staging, os.path.join(real_root, TRASH)):
        raise VerificationError(f"{tmp} resolves to {real_tmp}, outside root {root.path}")
    return real_tmp


def _inside(real: str, real_base: str) -> bool:
    return real == real_base or real.startswith(real_base + os.sep)


def _join(rel_dir: str, problem: str) -> str:
    return problem if rel_dir == "." else f"{rel_dir}/{problem}"


def _raise(exc: OSError) -> NoReturn:
    raise VerificationError(f"cannot read {exc.filename}: {exc.strerror}") from exc

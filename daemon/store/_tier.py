"""A root's fast tier on one node: its save directories, parts, promotions and space.

The fast tier (:class:`daemon.config._tiers.FastTier`) is a node-local directory laid
out like a root: ranks write step N into ``FAST/tmp_step_N``; once every node's part is
there and verified the step is promoted locally to ``FAST/step_N`` and ``FAST/latest``
names the newest one. Each node's part is described by its *part file*
(``.ckptd-tier/part.json`` in the step's directory): the run, the ranks, every file with
its size and SHA-256, computed here once, after the ranks' ``done`` and off the training
path. The tier's *incarnation* (``FAST/.ckptd-tier-id``) changes when the directory is
wiped or the node replaced, so that no other node counts what it held before.

Every call is blocking; the daemon runs them in worker threads.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

import msgspec

from orchestrator.protocol import TIER_RUN_FILE, FileEntry

from ..base._errors import VerificationError
from ..config._root import RootConfig
from ._durable import fsync_dir, write_atomic

__all__ = [
    "PART",
    "holds",
    "DrainRecord",
    "read_drain",
    "write_drain",
    "open_steps",
    "part_paths",
    "Part",
    "PartFile",
    "TierFullError",
    "free_bytes",
    "hash_file",
    "incarnation",
    "local_steps",
    "point_latest",
    "prepare",
    "promote_local",
    "read_part",
    "remove_step",
    "seal",
    "tier_root",
]

PART: Final = os.path.join(".ckptd-tier", "part.json")
"""The node's part file, relative to a fast-tier step directory."""
_ID: Final = ".ckptd-tier-id"
_CHUNK: Final = 4 << 20


class TierFullError(OSError):
    """The fast tier has no room for the save."""


class PartFile(msgspec.Struct, frozen=True):
    """One file of a node's part: path relative to the step, size and SHA-256."""

    path: str
    size: int
    sha256: str


class Part(msgspec.Struct, frozen=True, kw_only=True):
    """What one node holds of a step in its fast tier, verified and checksummed."""

    format: str = "ckptd-tier-part/1"
    node: str
    run: str
    step: int
    world_size: int
    incarnation: str
    ranks: dict[str, list[PartFile]]
    """The files each of this node's ranks wrote."""
    bytes: int = 0
    hash_s: float = 0.0
    unreported: list[PartFile] = []
    """The step directory's other files at the seal, which no rank reported: a
    driver's, written before its workers' ``begin`` (NeMo-RL's ``training_info.json``,
    ``config.yaml``), counted as the durable root counts every file of its attempt."""

    def files(self) -> list[PartFile]:
        """Every file of the part, once, sorted by path."""
        seen = {f.path: f for files in self.ranks.values() for f in files}
        seen.update((f.path, f) for f in self.unreported)
        return [seen[k] for k in sorted(seen)]


def tier_root(root: RootConfig) -> RootConfig:
    """A root description of ``root``'s fast tier (same directory names)."""
    assert root.fast is not None
    return RootConfig(
        path=root.fast.path,
        real=root.fast.path,
        tmp_prefix=root.tmp_prefix,
        final_prefix=root.final_prefix,
        pointer=root.pointer,
    )


def incarnation(fast: str) -> str:
    """The tier directory's incarnation id, made on first use (a wiped tier gets anew)."""
    path = os.path.join(fast, _ID)
    try:
        with open(path, encoding="ascii") as f:
            value = f.read().strip()
        if value:
            return value
    except FileNotFoundError:
        pass
    value = uuid.uuid4().hex
    write_atomic(path, value.encode())
    return value


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def prepare(tier: RootConfig, step: int, run: str, need: int, *, fresh: bool = False) -> str:
    """Make ``tmp_step_N`` of the fast tier run ``run``'s, with room for ``need`` bytes.

    A directory another run left there, or one no run marked (or, ``fresh``, a failed
    save of this run) is removed first: attempts never mix, and the fast tier keeps no
    failed attempts (its space is the scarce thing). One this run marked
    (:data:`~orchestrator.protocol.TIER_RUN_FILE`: its driver's files, written before the
    first ``begin``) is kept with them.

    Raises:
        TierFullError: fewer than ``need`` bytes are free.
    """
    free = free_bytes(tier.path)
    if free < need:
        raise TierFullError(
            errno.ENOSPC,
            f"fast tier {tier.path} is full: {free} bytes free, this save needs about "
            f"{need} (the node's part of the last step, or min_free_mb)",
        )
    tmp = tier.tmp_dir(step)
    owner = os.path.join(tmp, TIER_RUN_FILE)
    try:
        with open(owner, encoding="utf-8") as f:
            if f.read() == run and not fresh:
                return tmp
    except (FileNotFoundError, NotADirectoryError):
        pass
    if os.path.lexists(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, ".ckptd-tier"), exist_ok=True)
    write_atomic(owner, run.encode())
    fsync_dir(tier.path)
    return tmp


def hash_file(path: str) -> tuple[int, str]:
    """Size and SHA-256 of the file at ``path``."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


def seal(
    tier: RootConfig,
    step: int,
    *,
    node: str,
    run: str,
    world_size: int,
    reported: Mapping[int, Sequence[FileEntry]],
) -> Part:
    """Check this node's ranks' files, hash each once, and write the part file.

    Each file's size is what is on disk, at least what its rank reported (a size
    reported is a minimum, as for DCP's ``.metadata``). The directory's other regular
    files (a driver's, written before the first ``begin``) are hashed into the part as
    :attr:`Part.unreported`; the daemon's own ``.ckptd-tier/`` is not.

    Raises:
        VerificationError: a reported file is missing or shorter than reported.
    """
    start = time.monotonic()
    tmp = tier.tmp_dir(step)
    ranks: dict[str, list[PartFile]] = {}
    hashed: dict[str, PartFile] = {}
    problems: list[str] = []
    for rank, entries in sorted(reported.items()):
        own: list[PartFile] = []
        for entry in entries:
            if entry.path not in hashed:
                try:
                    size, sha = hash_file(os.path.join(tmp, entry.path))
                except OSError as exc:
                    problems.append(f"{entry.path} (rank {rank}): {exc.strerror or exc}")
                    continue
                if size < entry.size:  # ranks report sizes as minimums (DCP's .metadata)
                    problems.append(
                        f"{entry.path}: {size} bytes on disk, rank {rank} reported {entry.size}"
                    )
                    continue
                hashed[entry.path] = PartFile(entry.path, size, sha)
            own.append(hashed[entry.path])
        ranks[str(rank)] = own
    unreported: list[PartFile] = []
    for rel in _regular_files(tmp):
        if rel not in hashed:
            try:
                size, sha = hash_file(os.path.join(tmp, rel))
            except OSError as exc:
                problems.append(f"{rel}: {exc.strerror or exc}")
                continue
            hashed[rel] = PartFile(rel, size, sha)
            unreported.append(hashed[rel])
    if problems:
        raise VerificationError(f"fast tier {tmp}: " + "; ".join(problems[:5]))
    part = Part(
        node=node,
        run=run,
        step=step,
        world_size=world_size,
        incarnation=incarnation(tier.path),
        ranks=ranks,
        unreported=unreported,
        bytes=sum(f.size for f in hashed.values()),
        hash_s=round(time.monotonic() - start, 3),
    )
    for f in hashed.values():  # the data is durable on this node before it counts
        fd = os.open(os.path.join(tmp, f.path), os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    write_atomic(os.path.join(tmp, PART), msgspec.json.encode(part))
    return part


def _regular_files(top: str) -> list[str]:
    """Every regular file under ``top``, relative, sorted (no symlink followed).

    The daemon's own ``.ckptd-tier/`` is left out.
    """
    found: list[str] = []
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        try:
            entries = list(os.scandir(os.path.join(top, rel_dir)))
        except OSError:
            continue
        for entry in entries:
            rel = os.path.join(rel_dir, entry.name) if rel_dir else entry.name
            if entry.is_dir(follow_symlinks=False):
                if rel != ".ckptd-tier":
                    stack.append(rel)
            elif entry.is_file(follow_symlinks=False):
                found.append(rel)
    return sorted(found)


def read_part(directory: str) -> Part | None:
    """The part file of the fast-tier step directory ``directory``; None if absent/bad."""
    try:
        with open(os.path.join(directory, PART), "rb") as f:
            return msgspec.json.decode(f.read(), type=Part)
    except (OSError, msgspec.ValidationError, msgspec.DecodeError):
        return None


def promote_local(tier: RootConfig, step: int) -> str:
    """Rename the sealed ``tmp_step_N`` to ``step_N`` durably, and move ``latest``.

    Idempotent: a step already promoted (no ``tmp_step_N`` left) is left as it is. A
    ``step_N`` of an earlier run (a job that resumed from an older step and saved this
    one again) is replaced.
    """
    tmp, final = tier.tmp_dir(step), tier.final_dir(step)
    if os.path.isdir(tmp) or not os.path.isdir(final):
        if read_part(tmp) is None:
            raise VerificationError(f"{tmp} has no sealed part to promote")
        if os.path.lexists(final):
            remove_step(tier, step)
        os.rename(tmp, final)
        fsync_dir(tier.path)
    newest = max(local_steps(tier), default=step)
    point_latest(tier, newest)
    return final


def point_latest(tier: RootConfig, step: int | None) -> None:
    """Point the tier's ``latest`` at ``step_N`` (remove it for None), atomically."""
    link = os.path.join(tier.path, tier.pointer)
    if step is None:
        try:
            os.unlink(link)
        except FileNotFoundError:
            pass
        return
    target = os.path.basename(tier.final_dir(step))
    if os.path.islink(link) and os.readlink(link) == target:
        return
    tmp = f"{link}.{uuid.uuid4().hex}.tmp"
    os.symlink(target, tmp)
    os.replace(tmp, link)
    fsync_dir(tier.path)


def local_steps(tier: RootConfig) -> list[int]:
    """The locally promoted steps (``step_N`` with a part file), ascending."""
    steps = []
    try:
        names = os.listdir(tier.path)
    except FileNotFoundError:
        return []
    for name in names:
        step = tier.parse_step(name, tier.final_prefix)
        if step is not None and os.path.isfile(os.path.join(tier.path, name, PART)):
            steps.append(step)
    return sorted(steps)


def open_steps(tier: RootConfig) -> list[int]:
    """The fast tier's save directories (``tmp_step_N``), ascending."""
    try:
        names = os.listdir(tier.path)
    except FileNotFoundError:
        return []
    return sorted(s for n in names if (s := tier.parse_step(n, tier.tmp_prefix)) is not None)


def remove_step(tier: RootConfig, step: int, *, promoted: bool = True) -> None:
    """Remove ``step_N`` (or ``tmp_step_N``) from the fast tier."""
    path = tier.final_dir(step) if promoted else tier.tmp_dir(step)
    if not os.path.lexists(path):
        return
    aside = os.path.join(tier.path, f".ckptd-evicting.{uuid.uuid4().hex}")
    os.rename(path, aside)  # gone from every listing at once
    shutil.rmtree(aside, ignore_errors=True)


def part_paths(parts: Iterable[Part]) -> set[str]:
    """Every file path the parts name."""
    return {f.path for part in parts for f in part.files()}


class DrainRecord(msgspec.Struct, frozen=True, kw_only=True):
    """This node's drain of one local step (``.ckptd-tier/drain.json``), for resuming."""

    state: str
    """``copying``, ``done`` or ``failed``."""
    run: str = ""
    attempt: str = ""
    tries: int = 0
    reason: str = ""


_DRAIN: Final = os.path.join(".ckptd-tier", "drain.json")


def read_drain(tier: RootConfig, step: int) -> DrainRecord | None:
    """The drain record of local ``step_N``; None if it was never drained."""
    try:
        with open(os.path.join(tier.final_dir(step), _DRAIN), "rb") as f:
            return msgspec.json.decode(f.read(), type=DrainRecord)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def write_drain(tier: RootConfig, step: int, record: DrainRecord) -> None:
    """Record the drain of local ``step_N`` durably (nothing if the step is gone)."""
    directory = tier.final_dir(step)
    if os.path.isdir(directory):
        write_atomic(os.path.join(directory, _DRAIN), msgspec.json.encode(record))


def holds(tier: RootConfig, step: int, ranks: Iterable[int]) -> bool:
    """Whether local ``step_N`` holds every file ``ranks`` wrote, each at its size.

    And the part's unreported files (a driver's, which the restoring job reads too).
    """
    part = read_part(tier.final_dir(step))
    if part is None:
        return False
    wanted: list[list[PartFile]] = [part.unreported]
    for rank in ranks:
        files = part.ranks.get(str(rank))
        if files is None:
            return False
        wanted.append(files)
    for files in wanted:
        for f in files:
            try:
                if os.stat(os.path.join(tier.final_dir(step), f.path)).st_size != f.size:
                    return False
            except OSError:
                return False
    return True

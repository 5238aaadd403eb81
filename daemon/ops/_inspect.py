"""``ckptd ls``, ``latest`` and ``verify``: what a root holds, read from the root itself.

They work with the daemon down (the root is the truth); a running daemon only adds its
layout and the state of saves in flight. A path that does not exist or is no root is
refused with its name (:mod:`daemon.ops._roots`). ``verify`` prints what it compared
and what it never does (contents), so that its OK is not read as more than it is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Final

from orchestrator import protocol as p

from ..base._errors import VerificationError
from ..config._config import RootConfig
from ..config._root import abspath
from ..config._s3 import is_s3_url
from ..store._attempts import TRASH
from ..store._routed import RoutedStorage
from ..store._safetensors import is_index, is_safetensors
from ..store._storage import Storage
from ..store._tier import read_part
from ..store._tierverify import deep_verify, deep_verify_url
from ..store._verify import Manifest
from . import _retention_cmds as retention_cli
from ._queries import Unreachable, call, daemon_status, refused, retention, socket_of, table
from ._roots import require_present, resolve_root

__all__ = ["NOT_CHECKED", "NOT_CHECKED_S3", "latest", "ls", "verify"]


def ls(args: argparse.Namespace) -> int:
    """``ckptd ls ROOT``: the root's checkpoints, saves in flight and set-aside attempts."""
    status = daemon_status(args)
    storage = RoutedStorage()
    root = resolve_root(storage, args.root, status, socket_of(args))
    known = {s["step"]: s for s in (status or {}).get("saves", []) if s["root"] == root.path}
    latest = storage.read_pointer(root)
    kept = retention_cli.kept_column(retention(args, root) if status else None)
    rows: list[dict[str, Any]] = []
    for name, full in _entries(storage, root):
        if (step := root.parse_step(name, root.final_prefix)) is not None:
            manifest = _manifest(storage, full)
            rows.append(
                {
                    "step": step,
                    "state": "promoted",
                    # On an object store, the committed attempt's prefix readers load.
                    "path": storage.locate(root, step) if root.on_object_store else full,
                    "bytes": manifest.bytes if manifest else None,
                    "files": len(manifest.files) if manifest else None,
                    "latest": step == latest,
                    **({"kept": kept[step]} if step in kept else {}),
                }
            )
        elif (step := root.parse_step(name, root.tmp_prefix)) is not None:
            save = known.get(step)
            if root.on_object_store:  # no tmp_step_N there: the step's attempt prefixes
                full = (save or {}).get("path") or f"{root.final_dir(step)}/"
            rows.append(
                {
                    "step": step,
                    "state": save["state"] if save else "unknown",
                    "path": full,
                    "reason": save.get("reason") if save else None,
                    "latest": False,
                }
            )
    promoted = {r["step"] for r in rows if r["state"] == "promoted"}
    rows += _set_aside_rows(storage, root, known, promoted)
    rows.sort(key=lambda r: (r["step"], r["state"] != "promoted", r["state"]))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table(
        ["STEP", "STATE", "SIZE", "FILES", *(["KEPT"] if kept else []), "PATH"],
        [
            [
                str(r["step"]) + (" *" if r["latest"] else ""),
                r["state"],
                _human(r.get("bytes")),
                "" if r.get("files") is None else str(r["files"]),
                *([r.get("kept", "")] if kept else []),
                r["path"] + (f"  ({r['reason']})" if r.get("reason") else ""),
            ]
            for r in rows
        ],
    )
    return 0


def _entries(storage: Storage, root: RootConfig) -> list[tuple[str, str]]:
    """The root's entries and, when it stages elsewhere, its staging directory's steps."""
    found = [(name, os.path.join(root.path, name)) for name in storage.entries(root)]
    if root.staging:
        staging = RootConfig(
            path=root.staging,
            real=root.staging,
            tmp_prefix=root.tmp_prefix,
            final_prefix=root.final_prefix,
        )
        found = [(n, f) for n, f in found if root.parse_step(n, root.tmp_prefix) is None]
        found += [
            (name, os.path.join(root.staging, name))
            for name in storage.entries(staging)
            if root.parse_step(name, root.tmp_prefix) is not None
        ]
    return found


def _set_aside_rows(
    storage: Storage, root: RootConfig, known: dict[int, dict[str, Any]], promoted: set[int]
) -> list[dict[str, Any]]:
    """Failed attempts' directories in the root's trash, kept until ``gc``.

    The attempt of a step promoted since (saved again) is an ``old attempt``: the step
    itself is no longer set aside.
    """
    trash = os.path.join(root.path, TRASH)
    try:
        names = storage.set_aside_entries(root)
    except OSError:
        return []
    rows = []
    for name in names:
        head, sep, tail = name.partition(".attempt-")
        step = root.parse_step(head, root.tmp_prefix) if sep else None
        if step is None:
            continue
        full = os.path.join(trash, name)
        save = known.get(step)
        ours = save is not None and save.get("set_aside") == full
        state = "old attempt" if step in promoted else "set aside"
        rows.append(
            {
                "step": step,
                "state": save["state"] if ours and save else state,
                "path": full,
                "attempt": tail.rsplit("-", 1)[0],
                "reason": save.get("reason") if ours and save else None,
                "latest": False,
            }
        )
    return rows


def _manifest(storage: Storage, path: str) -> Manifest | None:
    try:
        return storage.read_manifest(path)
    except VerificationError:
        return None


def latest(args: argparse.Namespace) -> int:
    """``ckptd latest ROOT``: the newest promoted checkpoint, from the daemon or the root."""
    status = daemon_status(args)
    storage = RoutedStorage()
    root = resolve_root(storage, args.root, status, socket_of(args))
    served = any(layout["path"] == root.path for layout in (status or {}).get("layouts", []))
    reply = None
    if served:
        try:
            reply = call(args, p.Latest(id=1, root=root.path), 5.0)
        except Unreachable:
            reply = None  # the pointer in the root is the truth; the daemon only adds layout
    if reply is not None and reply["ok"]:
        print(reply["path"])
        return 0
    if reply is not None:
        return refused(reply)
    step = storage.latest_promoted(root)
    if step is None:
        print(f"ckptd: {root.path} has no promoted checkpoint", file=sys.stderr)
        return 1
    print(storage.locate(root, step))
    return 0


NOT_CHECKED: Final = (
    "contents: no file is read whole and no checksum is compared, so a changed byte "
    "that keeps a file's size is not found"
)
"""What ``verify`` never checks on a filesystem root, printed with every verdict so that
OK is not misread."""
NOT_CHECKED_S3: Final = (
    "contents: no object is read and no checksum is computed; an ETag shows an object "
    "replaced since the commit, not bytes written wrong before it"
)
"""What ``verify`` never checks on an ``s3://`` root."""


def verify(args: argparse.Namespace) -> int:
    """``ckptd verify PATH``: what was checked, and each problem found (exit 1) or OK."""
    storage = RoutedStorage()
    path = abspath(args.path)
    require_present(storage, path)
    deep = getattr(args, "deep", False)
    s3 = is_s3_url(path)
    tier_part = deep and not s3 and read_part(path) is not None
    problems = [] if tier_part else storage.verify_checkpoint(path)
    checked = [] if problems or tier_part else _checked(storage, path)
    if deep:
        hashed, wrong = _deep(storage, path) if s3 else deep_verify(path)
        problems += wrong
        if not wrong:
            checked.append(f"{hashed} files: each re-hashed, matching its recorded SHA-256")
    unchecked = NOT_CHECKED_S3 if s3 else NOT_CHECKED
    if deep:
        unchecked = "the daemon's own files (manifest, markers, part), which no checksum covers"
        if s3:
            unchecked = "the daemon's own objects (commit, markers), which no checksum covers"
    if args.json:
        report = {"path": args.path, "ok": not problems, "problems": problems}
        print(json.dumps({**report, "checked": checked, "not_checked": [unchecked]}))
        return 1 if problems else 0
    for problem in problems:
        print(f"{args.path}: {problem}")
    if not problems:
        print(f"{args.path}: OK")
        for line in checked:
            print(f"  checked: {line}")
    print(f"  not checked: {unchecked}")
    return 1 if problems else 0


def _deep(storage: RoutedStorage, path: str) -> tuple[int, list[str]]:
    """``--deep`` on an ``s3://`` step: each object streamed and re-hashed."""
    from ..store._s3 import S3Storage

    s3 = storage.s3
    assert isinstance(s3, S3Storage)
    try:
        return deep_verify_url(s3, path)
    except OSError as exc:
        return 0, [f"the store could not be read: {exc}"]


def _checked(storage: Storage, path: str) -> list[str]:
    """What :meth:`Storage.verify_checkpoint` compared, read back from the manifest."""
    manifest = _manifest(storage, path)
    if manifest is None:
        return []
    size = f"{len(manifest.files)} files, {_human(manifest.bytes)}"
    if is_s3_url(path):
        return [
            (
                f"{size}: each object its commit object names is present with the size "
                "and ETag recorded at the commit"
            )
        ]
    names = [os.path.basename(rel) for rel in manifest.files]
    tensors = sum(1 for name in names if is_safetensors(name))
    indexes = sum(1 for name in names if is_index(name))
    lines = [f"{size}: each present, inside the checkpoint, with the size its manifest records"]
    if manifest.dcp_dirs:
        lines.append(
            f"DCP metadata: {len(manifest.dcp_dirs)} directories, each with metadata "
            "naming shards that are present and at least the sizes it records"
        )
    if tensors or indexes:
        lines.append(
            f"safetensors: the headers of {tensors} files and {indexes} index files "
            "parse, and every tensor lies within its file"
        )
    return lines


def _human(n: int | None) -> str:
    if n is None:
        return ""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)  # pragma: no cover

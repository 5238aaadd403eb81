"""``ckptd ls``, ``latest`` and ``verify``: what a root holds, read from the root itself.

They work with the daemon down (the root is the truth); a running daemon only adds its
layout and the state of saves in flight.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from orchestrator import protocol as p

from ..base._errors import VerificationError
from ..config._config import RootConfig
from ..config._root import abspath
from ..config._s3 import is_s3_url
from ..store._attempts import TRASH
from ..store._routed import RoutedStorage
from ..store._storage import Storage
from ..store._verify import Manifest
from . import _retention_cmds as retention_cli
from ._queries import Unreachable, call, daemon_status, refused, retention, table

__all__ = ["latest", "ls", "root_layout", "verify"]


def root_layout(args: argparse.Namespace, status: dict[str, Any] | None) -> RootConfig:
    """The root's directory names: the daemon's configuration when it answers."""
    path = abspath(args.root)
    real = path if is_s3_url(path) else os.path.realpath(path)
    names = {"tmp_prefix": args.tmp_prefix, "final_prefix": args.final_prefix}
    names["pointer"] = args.pointer
    for layout in (status or {}).get("layouts", []):
        if layout["path"] in (path, real):
            names = {k: layout[k] for k in ("tmp_prefix", "final_prefix", "pointer")}
    return RootConfig(path=real, real=real, **names)


def ls(args: argparse.Namespace) -> int:
    status = daemon_status(args)
    root = root_layout(args, status)
    known = {s["step"]: s for s in (status or {}).get("saves", []) if s["root"] == root.path}
    storage = RoutedStorage()
    latest = storage.read_pointer(root)
    kept = retention_cli.kept_column(retention(args, root) if status else None)
    rows: list[dict[str, Any]] = []
    for name in storage.entries(root):
        full = os.path.join(root.path, name)
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
            rows.append(
                {
                    "step": step,
                    "state": save["state"] if save else "unknown",
                    "path": full,
                    "reason": save.get("reason") if save else None,
                    "latest": False,
                }
            )
    rows += _set_aside_rows(storage, root, known)
    rows.sort(key=lambda r: (r["step"], r["state"]))
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


def _set_aside_rows(
    storage: Storage, root: RootConfig, known: dict[int, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Failed attempts' directories in the root's trash, kept until ``gc``."""
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
        rows.append(
            {
                "step": step,
                "state": save["state"] if ours and save else "set aside",
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
    root = root_layout(args, None)
    try:
        reply = call(args, p.Latest(id=1, root=root.path), 5.0)
    except Unreachable:
        reply = None  # the pointer on disk is the truth; the daemon only adds layout
    if reply is not None and reply["ok"]:
        print(reply["path"])
        return 0
    if reply is not None and reply["error"]["code"] != p.ErrorCode.ROOT_NOT_CONFIGURED:
        return refused(reply)
    storage = RoutedStorage()
    step = storage.latest_promoted(root)
    if step is None:
        print(f"ckptd: {root.path} has no promoted checkpoint", file=sys.stderr)
        return 1
    print(storage.locate(root, step))
    return 0


def verify(args: argparse.Namespace) -> int:
    problems = RoutedStorage().verify_checkpoint(abspath(args.path))
    if args.json:
        print(json.dumps({"path": args.path, "ok": not problems, "problems": problems}))
    elif problems:
        for problem in problems:
            print(f"{args.path}: {problem}")
    else:
        print(f"{args.path}: OK")
    return 1 if problems else 0


def _human(n: int | None) -> str:
    if n is None:
        return ""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)  # pragma: no cover

"""``ckptd status``, ``tail``, ``promote`` and ``gc``: the commands that ask the daemon.

Each sends requests over the daemon's socket (:func:`call`) and prints the answer; exit
codes as for every ``ckptd`` command: 0 done, 1 refused or unreachable.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from collections.abc import Iterator
from datetime import datetime
from typing import Any, Final

import msgspec

from orchestrator import protocol as p

from ..config._config import RootConfig, default_socket_path
from ..config._root import abspath
from ..store._routed import RoutedStorage
from . import _retention_cmds as retention_cli

__all__ = [
    "Unreachable",
    "call",
    "daemon_status",
    "gc",
    "promote",
    "refused",
    "retention",
    "socket_of",
    "status",
    "table",
    "tail",
]


class Unreachable(Exception):
    """The daemon's socket cannot be reached, or it closed before replying."""


def requests(path: str, request: p.Request, timeout: float | None) -> Iterator[dict[str, Any]]:
    """Send one request; yield every object the daemon sends back."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError as exc:
        sock.close()
        raise Unreachable(f"{path}: {exc.strerror or exc}") from None
    with sock, sock.makefile("rb") as stream:
        sock.sendall(p.encode(request))
        for line in stream:
            yield msgspec.json.decode(line)


def socket_of(args: argparse.Namespace) -> str:
    """The daemon socket a command talks to: ``--socket``, else the default."""
    return str(args.socket or default_socket_path())


def call(args: argparse.Namespace, request: p.Request, timeout: float = 10.0) -> dict[str, Any]:
    """Send ``request``; the daemon's reply to it.

    Raises:
        Unreachable: the socket cannot be reached, or closed before the reply.
    """
    path = socket_of(args)
    for reply in requests(path, request, timeout):
        if reply.get("id") == request.id:
            return reply
    raise Unreachable(f"{path}: connection closed before the reply")


def refused(reply: dict[str, Any]) -> int:
    error = reply.get("error") or {}
    print(f"ckptd: {error.get('code')}: {error.get('message')}", file=sys.stderr)
    return 1


def status(args: argparse.Namespace) -> int:
    """``ckptd status``: the saves in flight by step (``--all``: settled ones too)."""
    reply = call(args, p.Status(id=1))
    if not reply["ok"]:
        return refused(reply)
    if args.json:
        print(json.dumps(reply, indent=2))
        return 0
    print(f"ckptd {reply['version']}  pid {reply['pid']}  up {reply['uptime_s']:.0f}s")
    print(f"roots: {', '.join(reply['roots'])}")
    for stall in reply.get("stalled", []):
        print(
            f"stalled: {stall['root'] or 'journal'}: {stall['call']} blocked "
            f"{stall['blocked_s']:.1f}s ({stall['running']} running, {stall['queued']} queued)"
        )
    saves = sorted(reply["saves"], key=lambda s: (s["root"], s["step"]))
    settled = [s for s in saves if s["state"] in _SETTLED]
    shown = saves if args.all else [s for s in saves if s["state"] not in _SETTLED]
    gone = _deleted(reply, settled) if args.all else set()
    rows = [
        [
            s["root"],
            str(s["step"]),
            "deleted" if (s["root"], s["step"]) in gone else s["state"],
            _ranks_summary(s),
            f"{s['age_s']:.1f}s",
            "promoted, since removed from the root"
            if (s["root"], s["step"]) in gone
            else s.get("reason") or s.get("path") or "",
        ]
        for s in shown
    ]
    if rows:
        table(["ROOT", "STEP", "STATE", "RANKS DONE", "AGE", "PATH / REASON"], rows)
    else:
        print("no saves in flight")
    if settled and not args.all:
        print(
            f"{len(settled)} settled saves (promoted or failed) not shown; "
            "`ckptd status --all` shows them"
        )
    return 0


_SETTLED: Final = frozenset({p.SaveState.PROMOTED, p.SaveState.FAILED})


def _deleted(reply: dict[str, Any], settled: list[dict[str, Any]]) -> set[tuple[str, int]]:
    """The promoted saves whose checkpoint is no longer in the root (removed since)."""
    storage = RoutedStorage()
    layouts = {layout["path"]: layout for layout in reply.get("layouts", [])}
    gone: set[tuple[str, int]] = set()
    for path in {s["root"] for s in settled if s["state"] == p.SaveState.PROMOTED}:
        layout = layouts.get(path)
        names = {k: layout[k] for k in ("tmp_prefix", "final_prefix", "pointer")} if layout else {}
        root = RootConfig(path=path, real=path, **names)
        try:
            present = set(storage.entries(root))
        except OSError:
            continue  # an unreadable root: the daemon's word stands
        gone |= {
            (path, s["step"])
            for s in settled
            if s["root"] == path
            and s["state"] == p.SaveState.PROMOTED
            and f"{root.final_prefix}{s['step']}" not in present
        }
    return gone


def _ranks_summary(save: dict[str, Any]) -> str:
    done = sum(1 for r in save["ranks"] if r["state"] == "done")
    return f"{done}/{save['world_size']}"


def daemon_status(args: argparse.Namespace) -> dict[str, Any] | None:
    try:
        reply = call(args, p.Status(id=1), 5.0)
    except Unreachable:
        return None
    return reply if reply.get("ok") else None


def retention(args: argparse.Namespace, root: RootConfig) -> dict[str, Any] | None:
    """The daemon's judgement of the root's steps (``retention``), if it answers."""
    try:
        return call(args, p.Retention(id=1, root=root.path), 30.0)
    except Unreachable:
        return None


def tail(args: argparse.Namespace) -> int:
    path = args.socket or default_socket_path()
    for event in requests(path, p.Subscribe(id=1), None):
        if "event" not in event:
            if event.get("ok") is False:
                return refused(event)
            continue
        if args.json:
            print(json.dumps(event), flush=True)
        else:
            print(_human_event(event), flush=True)
    print("ckptd: the daemon closed the event stream", file=sys.stderr)
    return 1


def _human_event(event: dict[str, Any]) -> str:
    stamp = event.get("timestamp", "")
    try:
        stamp = datetime.fromisoformat(stamp.replace("Z", "+00:00")).strftime("%H:%M:%S.%f")[:-3]
    except ValueError:
        pass
    fields = " ".join(
        f"{k}={v}" for k, v in event.items() if k not in ("event", "timestamp", "level")
    )
    return f"{stamp} {event.get('level', 'info'):<7} {event['event']:<24} {fields}"


def promote(args: argparse.Namespace) -> int:
    root = abspath(args.root)
    reply = call(args, p.Promote(id=1, root=root, step=args.step), 700.0)
    if not reply["ok"]:
        return refused(reply)
    if reply["state"] == "promoted":
        print(reply["path"])
        return 0
    print(f"ckptd: step {args.step} {reply['state']}: {reply.get('reason') or ''}", file=sys.stderr)
    return 1


def gc(args: argparse.Namespace) -> int:
    if args.policy:
        return retention_cli.policy_report(args, call, refused)
    root = abspath(args.root)
    reply = call(args, p.Gc(id=1, root=root, remove=args.yes), 600.0)
    if not reply["ok"]:
        return refused(reply)
    absent = reply.get("absent", [])
    paths = [c for c in reply["candidates"] if c not in absent] + reply.get("set_aside", [])
    if not paths and not absent:
        print(f"{root}: nothing to collect")
        return 0
    done = reply["removed"]
    for path in paths:
        print(f"removed: {path}" if done else f"would remove (pass --yes): {path}")
    for path in absent:  # the daemon forgets the step; there are no files to remove
        if done:
            print(f"forgot: {path} (a failed step; none of its files were left)")
        else:
            print(f"would forget (pass --yes): {path} (a failed step; none of its files are left)")
    return 0


def table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    for row in (header, *rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)).rstrip())

"""``ckptd score``, ``pin``, ``unpin``, ``hold`` and ``gc --policy``: retention from the shell.

Each sends one request to the daemon (``daemon.cli`` adds the commands to its parser and
provides the call); exit codes as for every ``ckptd`` command: 0 done, 1 refused or
unreachable, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from typing import Any

from orchestrator import protocol as p

from ..config._root import abspath

__all__ = ["add_commands", "kept_column", "policy_report"]

Call = Callable[[argparse.Namespace, p.Request, float], dict[str, Any]]
Command = Callable[[str, str, Any], argparse.ArgumentParser]


def add_commands(command: Command, call: Call, refused: Callable[[dict[str, Any]], int]) -> None:
    """Add ``score``, ``pin``, ``unpin`` and ``hold`` to the ``ckptd`` parser."""

    def send(args: argparse.Namespace, request: p.Request) -> int:
        reply = call(args, request, 30.0)
        if not reply["ok"]:
            return refused(reply)
        return 0

    def score(args: argparse.Namespace) -> int:
        metrics: dict[str, float] = {}
        for pair in args.metrics:
            name, eq, value = pair.partition("=")
            try:
                number = float(value)
            except ValueError:
                number = math.nan
            if not eq or not name or not math.isfinite(number):
                print(f"ckptd: {pair!r} is not NAME=NUMBER", file=sys.stderr)
                return 2
            metrics[name] = number
        root = abspath(args.root)
        code = send(args, p.Score(id=1, root=root, step=args.step, metrics=metrics))
        if code == 0:
            shown = " ".join(f"{k}={v:g}" for k, v in metrics.items())
            print(f"scored step {args.step}: {shown}")
        return code

    def pin(args: argparse.Namespace) -> int:
        root = abspath(args.root)
        code = send(args, p.Pin(id=1, root=root, step=args.step))
        if code == 0:
            print(f"pinned step {args.step}: never retired until unpinned")
        return code

    def unpin(args: argparse.Namespace) -> int:
        root = abspath(args.root)
        code = send(args, p.Unpin(id=1, root=root, step=args.step))
        if code == 0:
            print(f"unpinned step {args.step}")
        return code

    def hold(args: argparse.Namespace) -> int:
        if not 0 <= args.ttl <= 30 * 24 * 3600:
            print("ckptd: --ttl must be 0 to 2592000 seconds (30 days)", file=sys.stderr)
            return 2
        root = abspath(args.root)
        code = send(args, p.Hold(id=1, root=root, step=args.step, ttl=args.ttl))
        if code == 0 and args.ttl > 0:
            print(f"held step {args.step} for {args.ttl:g}s")
        elif code == 0:
            print(f"released step {args.step}")
        return code

    cmd = command("score", "record metrics of a promoted step (NAME=VALUE ...)", score)
    cmd.add_argument("root")
    cmd.add_argument("step", type=int)
    cmd.add_argument("metrics", nargs="+", metavar="NAME=VALUE")
    for name, help_text, func in (
        ("pin", "keep STEP of ROOT whatever the retention policy says", pin),
        ("unpin", "let the retention policy judge STEP of ROOT again", unpin),
    ):
        cmd = command(name, help_text, func)
        cmd.add_argument("root")
        cmd.add_argument("step", type=int)
    cmd = command("hold", "keep STEP of ROOT for --ttl seconds (a reader using it)", hold)
    cmd.add_argument("root")
    cmd.add_argument("step", type=int)
    cmd.add_argument(
        "--ttl", type=float, required=True, metavar="SECONDS", help="how long; 0 releases"
    )


def kept_column(reply: dict[str, Any] | None) -> dict[int, str]:
    """Why each step is kept, as ``ckptd ls`` shows it, from a ``retention`` reply."""
    if reply is None or not reply.get("ok") or not reply["info"].get("policy"):
        return {}
    out = {}
    for step in reply["steps"]:
        kept = step.get("kept") or []
        out[step["step"]] = ",".join(kept) if kept else "retire"
    return out


def policy_report(args: argparse.Namespace, call: Call, refused: Callable[..., int]) -> int:
    """``ckptd gc ROOT --policy [--yes]``: what the policy would retire (retire it)."""
    root = abspath(args.root)
    reply = call(args, p.Retention(id=1, root=root, apply=args.yes), 600.0)
    if not reply["ok"]:
        return refused(reply)
    if getattr(args, "json", False):
        print(json.dumps(reply, indent=2))
        return 0
    info = reply["info"]
    if not info.get("policy"):
        print(f"{root}: no retention policy; nothing is ever retired")
        return 0
    print(
        f"{root}: policy {info['policy']}"
        + ("" if info.get("prunes", True) else " (not pruned here)")
    )
    going = [s for s in reply["steps"] if not s.get("kept")]
    done = set(reply.get("retired", []))
    for step in going:
        if step["step"] in done:
            verb = "retired"
        elif not info.get("prunes", True):
            verb = "would retire (by the leader's daemon)"
        else:
            verb = "would retire (pass --yes)"
        print(f"{verb}: step {step['step']}  ({step.get('retire')})")
    for step in sorted(done - {s["step"] for s in going}):
        print(f"retired: step {step}")
    if not going and not done:
        print("nothing to retire")
    return 0

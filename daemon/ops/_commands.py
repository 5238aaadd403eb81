"""``ckptd health`` and ``ckptd check-config``: the commands probes and operators run.

``health`` exits 0 only when the daemon answers a ``health`` request and says it can do
its job (its journal can be written); otherwise 1, with one line on stderr saying why.
It never looks at a checkpoint root. ``check-config FILE`` loads the file exactly as
``ckptd serve --config FILE`` would and prints a summary (exit 0), or the error naming
the field and how to fix it (exit 2).
"""

from __future__ import annotations

import argparse
import socket
import sys
from typing import Any, Final

import msgspec

from orchestrator import protocol as p

from ..config._config import Config, RootConfig, default_socket_path, load_config

__all__ = ["HEALTH_TIMEOUT", "add_commands", "check_config", "health"]

_COMMIT: Final = ".ckptd-commit.json"
"""An ``s3://`` root's commit object (``store._s3commit.COMMIT_NAME``, not imported: it
would load botocore into every ``ckptd health``)."""

HEALTH_TIMEOUT: Final = 5.0
"""Seconds ``health`` waits for the daemon by default (below a probe's usual timeout)."""


def add_commands(sub: Any, command: Any) -> None:
    """Add ``health`` and ``check-config`` to the ``ckptd`` parser.

    Args:
        sub: The parser's subparsers.
        command: ``cli``'s helper adding a command with a ``--socket`` option.
    """
    cmd = command("health", "exit 0 if the daemon answers and its journal is writable", health)
    cmd.add_argument(
        "--timeout",
        type=float,
        default=HEALTH_TIMEOUT,
        metavar="SECONDS",
        help=f"give up waiting for the daemon after this long (default {HEALTH_TIMEOUT:g})",
    )
    check = sub.add_parser(
        "check-config",
        help="validate a TOML configuration file",
        description="validate a TOML configuration file as `ckptd serve --config` reads it",
    )
    check.add_argument("file", metavar="FILE")
    check.set_defaults(func=check_config)


def health(args: argparse.Namespace) -> int:
    """``ckptd health``: 0 when healthy, else 1 with the reason on stderr."""
    path = args.socket or default_socket_path()
    try:
        reply = _ask(path, p.Health(id=1), args.timeout)
    except TimeoutError:
        return _unhealthy(f"{path}: no answer within {args.timeout:g}s")
    except OSError as exc:
        return _unhealthy(f"{path}: {exc.strerror or exc}")
    except (msgspec.DecodeError, ValueError) as exc:
        return _unhealthy(f"{path}: unreadable reply: {exc}")
    if not reply.get("ok"):
        error = reply.get("error") or {}
        return _unhealthy(f"daemon refused health: {error.get('code')}: {error.get('message')}")
    if not reply.get("healthy"):
        return _unhealthy(str(reply.get("problem") or "the daemon says it is not healthy"))
    print(f"ckptd {reply.get('version')}: healthy")
    return 0


def _unhealthy(why: str) -> int:
    print(f"ckptd: unhealthy: {why}", file=sys.stderr)
    return 1


def _ask(path: str, request: p.Request, timeout: float) -> dict[str, Any]:
    """One request, one reply, all within ``timeout`` seconds."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(p.encode(request))
        with sock.makefile("rb") as stream:
            for line in stream:
                reply = msgspec.json.decode(line)
                if isinstance(reply, dict) and reply.get("id") == request.id:
                    return reply
    raise ValueError("the daemon closed the connection before replying")


def check_config(args: argparse.Namespace) -> int:
    """``ckptd check-config FILE``: a summary and 0, or (raised) ``ConfigError`` for 2."""
    config = load_config(config_file=args.file)
    for line in summary(config):
        print(line)
    return 0


def summary(config: Config) -> list[str]:
    """What ``config`` sets up, a line each."""
    lines = [
        "configuration OK",
        f"socket: {config.socket} (mode {config.socket_mode:#o})",
        f"state_dir: {config.state_dir}",
        f"lease: {config.lease:g}s  save_timeout: "
        + ("never" if config.save_timeout is None else f"{config.save_timeout:g}s"),
        f"log_level: {config.log_level}",
        f"allowed_uids: {list(config.allowed_uids)}  allowed_gids: {list(config.allowed_gids)}",
        f"metrics_listen: {config.metrics_listen or 'off'}",
        f"metrics_textfile: {config.metrics_textfile or 'off'}",
        f"roots: {len(config.roots)}",
    ]
    for root in config.roots:
        named = f" (configured as {root.named})" if root.named else ""
        if root.on_object_store:  # nothing is renamed there: a commit object decides
            lines.append(
                f"  {root.path}{named}: each attempt writes {root.final_prefix}N/ATTEMPT/, "
                f"committed by {root.final_prefix}N/{_COMMIT}, pointer {root.pointer} "
                "(an object)"
            )
        else:
            staged = f"{root.staging}/{root.tmp_prefix}N" if root.staging else f"{root.tmp_prefix}N"
            lines.append(
                f"  {root.path}{named}: {staged} -> {root.final_prefix}N, pointer {root.pointer}"
            )
        if root.fast is not None:
            lines.append(f"    fast tier: {_describe_fast(root)}")
        if root.retention is not None:
            lines.append(
                f"    retention: {root.retention.policy.describe()}"
                + (
                    f", best pointer {root.retention.best_pointer}"
                    if root.retention.policy.keep_best is not None
                    else ""
                )
            )
    return lines


def _describe_fast(root: RootConfig) -> str:
    """A root's fast tier and drain policy, in one line (``check-config``)."""
    fast = root.fast
    assert fast is not None
    rules = []
    if fast.drain_every_steps:
        rules.append(f"every {fast.drain_every_steps} steps")
    if fast.drain_every_minutes:
        rules.append(f"every {fast.drain_every_minutes:g} min")
    if fast.drain_on_stop:
        rules.append(f"the newest on stop (within {fast.stop_grace:g}s)")
    rate = f"{fast.drain_rate_mb_s:g} MB/s" if fast.drain_rate_mb_s else "uncapped"
    return (
        f"{fast.path}/{root.tmp_prefix}N -> {fast.path}/{root.final_prefix}N, keep "
        f"{fast.keep}; drains {', '.join(rules) or 'never'}; {rate}, IO class "
        f"{fast.drain_ionice}"
    )

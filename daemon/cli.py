"""``ckptd``: run the daemon and inspect checkpoints.

Exit codes: 0 success; 1 a negative answer (no latest checkpoint, verification
problems, daemon unreachable, request refused); 2 bad usage or configuration, or a
path that does not exist or is no checkpoint root (the message names it).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
from collections.abc import Sequence
from typing import Any

import anyio

from .base._errors import ConfigError
from .base._events import configure_logging
from .config._config import Config, load_config
from .config._root import abspath
from .ops import _inspect as inspect
from .ops import _queries as queries
from .ops import _retention_cmds as retention_cmds
from .ops._commands import add_commands
from .ops._roots import require_present
from .server._lifecycle import serve
from .server._server import VERSION
from .store._routed import RoutedStorage

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ckptd`` command line; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        if isinstance(getattr(args, "root", None), str):  # serve's --root is a list
            require_present(RoutedStorage(), abspath(args.root))
        return int(args.func(args))
    except ConfigError as exc:
        print(f"ckptd: {exc}", file=sys.stderr)
        return 2
    except queries.Unreachable as exc:
        print(f"ckptd: daemon unreachable: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0
    except OSError as exc:  # a root that cannot be read (an object store's error says why)
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"ckptd: {where}{exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptd", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"ckptd {VERSION}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str, func: Any) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.set_defaults(func=func)
        if name != "verify":
            cmd.add_argument("--socket", help="daemon socket (default: $CKPTD_SOCKET or ...)")
        return cmd

    serve_cmd = command("serve", "run the daemon in the foreground", _serve)
    serve_cmd.add_argument(
        "--root",
        action="append",
        default=[],
        metavar="DIR",
        help="checkpoint root to manage (repeatable)",
    )
    serve_cmd.add_argument("--config", metavar="FILE", help="TOML configuration file")
    serve_cmd.add_argument(
        "--lease",
        type=float,
        metavar="SECONDS",
        help="time a disconnected rank has to reconnect (default 30)",
    )
    serve_cmd.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve_cmd.add_argument(
        "--state-dir",
        metavar="DIR",
        help="journal directory (default /var/lib/ckptd as root, else $XDG_STATE_HOME/ckptd)",
    )
    serve_cmd.add_argument(
        "--allow-uid",
        type=int,
        action="append",
        metavar="UID",
        help="also accept connections from this uid (repeatable; own uid and root always)",
    )
    serve_cmd.add_argument(
        "--allow-gid",
        type=int,
        action="append",
        metavar="GID",
        help="also accept connections from processes with this primary gid (repeatable)",
    )
    serve_cmd.add_argument(
        "--node",
        metavar="NAME",
        help="this node's name in multi-node saves (default: the hostname)",
    )
    serve_cmd.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve Prometheus metrics over HTTP here (TOML metrics_listen; default off)",
    )

    status = command(
        "status", "show the daemon's saves in flight, by root and step", queries.status
    )
    status.add_argument("--json", action="store_true", help="print the raw status object")
    status.add_argument(
        "--all",
        action="store_true",
        help="also show settled saves (promoted, failed, deleted since); they are counted "
        "otherwise",
    )

    ls = command("ls", "list a root's checkpoints and in-flight saves", inspect.ls)
    ls.add_argument("root")
    ls.add_argument("--json", action="store_true")

    latest = command("latest", "print the newest promoted checkpoint of ROOT", inspect.latest)
    latest.add_argument("root")

    tail = command("tail", "follow the daemon's events", queries.tail)
    tail.add_argument("--json", action="store_true", help="print events as JSON lines")

    verify = command(
        "verify",
        "check that a promoted checkpoint's files are present with the sizes its manifest "
        "records (DCP metadata and safetensors headers too); contents are not checksummed",
        inspect.verify,
    )
    verify.add_argument("path")
    verify.add_argument(
        "--deep",
        action="store_true",
        help="also re-hash every file against the checksums a fast tier recorded "
        "(a step in a fast tier, or drained from one; docs/tiers.md)",
    )
    verify.add_argument("--json", action="store_true")

    rescue = command(
        "promote",
        "promote STEP of ROOT whose trainer died after its writes landed (verified first)",
        queries.promote,
    )
    rescue.add_argument("root")
    rescue.add_argument("step", type=int)

    gc = command(
        "gc",
        "list set-aside failed attempts and failed or orphaned tmp dirs; remove with --yes",
        queries.gc,
    )
    gc.add_argument("root")
    gc.add_argument("--yes", action="store_true", help="remove them")
    gc.add_argument(
        "--policy",
        action="store_true",
        help="show the checkpoints the retention policy would retire (retire them with --yes)",
    )
    retention_cmds.add_commands(command, queries.call, queries.refused)
    add_commands(sub, command)
    return parser


# -- serve --------------------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    load = functools.partial(
        load_config,
        config_file=args.config,
        socket=args.socket,
        roots=args.root,
        lease=args.lease,
        log_level=args.log_level,
        state_dir=args.state_dir,
        allow_uids=args.allow_uid,
        allow_gids=args.allow_gid,
        node=args.node,
        metrics_listen=args.metrics_listen,
    )
    config = load()
    configure_logging(config.log_level)
    run = functools.partial(serve, config, reload_config=load)  # SIGHUP loads afresh
    anyio.run(run, backend_options={"use_uvloop": _uvloop_wanted(config)})
    return 0


def _uvloop_wanted(config: Config) -> bool:
    """Whether to serve on uvloop: configured (the default) and installed."""
    return config.event_loop == "uvloop" and importlib.util.find_spec("uvloop") is not None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

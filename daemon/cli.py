"""``ckptd``: run the daemon and inspect checkpoints.

Exit codes: 0 success; 1 a negative answer (no latest checkpoint, verification
problems, daemon unreachable, request refused); 2 bad usage or configuration.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import socket
import sys
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

import anyio
import msgspec

from orchestrator import protocol as p

from .base._errors import ConfigError
from .base._events import configure_logging
from .config._config import Config, RootConfig, default_socket_path, load_config
from .ops._commands import add_commands
from .retention import cli as retention_cli
from .server._lifecycle import serve
from .server._server import VERSION
from .store._attempts import TRASH
from .store._promote import latest_promoted, read_pointer
from .store._verify import MANIFEST_NAME, Manifest, verify_checkpoint

__all__ = ["main"]


class _Unreachable(Exception):
    pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ckptd`` command line; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"ckptd: {exc}", file=sys.stderr)
        return 2
    except _Unreachable as exc:
        print(f"ckptd: daemon unreachable: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0
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

    status = command("status", "show every save the daemon knows", _status)
    status.add_argument("--json", action="store_true", help="print the raw status object")

    ls = command("ls", "list a root's checkpoints and in-flight saves", _ls)
    ls.add_argument("root")
    ls.add_argument("--json", action="store_true")
    _layout_flags(ls)

    latest = command("latest", "print the newest promoted checkpoint of ROOT", _latest)
    latest.add_argument("root")
    _layout_flags(latest)

    tail = command("tail", "follow the daemon's events", _tail)
    tail.add_argument("--json", action="store_true", help="print events as JSON lines")

    verify = command("verify", "check a promoted checkpoint against its manifest", _verify)
    verify.add_argument("path")
    verify.add_argument("--json", action="store_true")

    rescue = command(
        "promote",
        "promote STEP of ROOT whose trainer died after its writes landed (verified first)",
        _promote,
    )
    rescue.add_argument("root")
    rescue.add_argument("step", type=int)

    gc = command(
        "gc",
        "list set-aside failed attempts and failed or orphaned tmp dirs; remove with --yes",
        _gc,
    )
    gc.add_argument("root")
    gc.add_argument("--yes", action="store_true", help="remove them")
    gc.add_argument(
        "--policy",
        action="store_true",
        help="show the checkpoints the retention policy would retire (retire them with --yes)",
    )
    retention_cli.add_commands(command, _call, _refused)
    add_commands(sub, command)
    return parser


def _layout_flags(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--tmp-prefix", default="tmp_step_", help=argparse.SUPPRESS)
    cmd.add_argument("--final-prefix", default="step_", help=argparse.SUPPRESS)
    cmd.add_argument("--pointer", default="latest", help=argparse.SUPPRESS)


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


# -- queries --------------------------------------------------------------------------------


def _requests(path: str, request: p.Request, timeout: float | None) -> Iterator[dict[str, Any]]:
    """Send one request; yield every object the daemon sends back."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError as exc:
        sock.close()
        raise _Unreachable(f"{path}: {exc.strerror or exc}") from None
    with sock, sock.makefile("rb") as stream:
        sock.sendall(p.encode(request))
        for line in stream:
            yield msgspec.json.decode(line)


def _call(args: argparse.Namespace, request: p.Request, timeout: float = 10.0) -> dict[str, Any]:
    path = args.socket or default_socket_path()
    for reply in _requests(path, request, timeout):
        if reply.get("id") == request.id:
            return reply
    raise _Unreachable(f"{path}: connection closed before the reply")


def _refused(reply: dict[str, Any]) -> int:
    error = reply.get("error") or {}
    print(f"ckptd: {error.get('code')}: {error.get('message')}", file=sys.stderr)
    return 1


def _status(args: argparse.Namespace) -> int:
    reply = _call(args, p.Status(id=1))
    if not reply["ok"]:
        return _refused(reply)
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
    rows = [
        [
            s["root"],
            str(s["step"]),
            s["state"],
            _ranks_summary(s),
            f"{s['age_s']:.1f}s",
            s.get("reason") or s.get("path") or "",
        ]
        for s in reply["saves"]
    ]
    _table(["ROOT", "STEP", "STATE", "RANKS DONE", "AGE", "PATH / REASON"], rows)
    return 0


def _ranks_summary(save: dict[str, Any]) -> str:
    done = sum(1 for r in save["ranks"] if r["state"] == "done")
    return f"{done}/{save['world_size']}"


def _root_layout(args: argparse.Namespace, status: dict[str, Any] | None) -> RootConfig:
    """The root's directory names: the daemon's configuration when it answers."""
    path = os.path.abspath(args.root)
    real = os.path.realpath(path)
    names = {"tmp_prefix": args.tmp_prefix, "final_prefix": args.final_prefix}
    names["pointer"] = args.pointer
    for layout in (status or {}).get("layouts", []):
        if layout["path"] in (path, real):
            names = {k: layout[k] for k in ("tmp_prefix", "final_prefix", "pointer")}
    return RootConfig(path=real, real=real, **names)


def _daemon_status(args: argparse.Namespace) -> dict[str, Any] | None:
    try:
        reply = _call(args, p.Status(id=1), 5.0)
    except _Unreachable:
        return None
    return reply if reply.get("ok") else None


def _ls(args: argparse.Namespace) -> int:
    status = _daemon_status(args)
    root = _root_layout(args, status)
    known = {s["step"]: s for s in (status or {}).get("saves", []) if s["root"] == root.path}
    latest = read_pointer(root)
    kept = retention_cli.kept_column(_retention(args, root) if status else None)
    rows: list[dict[str, Any]] = []
    for name in sorted(os.listdir(root.path)):
        full = os.path.join(root.path, name)
        if (step := root.parse_step(name, root.final_prefix)) is not None:
            manifest = _manifest(full)
            rows.append(
                {
                    "step": step,
                    "state": "promoted",
                    "path": full,
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
    rows += _set_aside_rows(root, known)
    rows.sort(key=lambda r: (r["step"], r["state"]))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    _table(
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


def _retention(args: argparse.Namespace, root: RootConfig) -> dict[str, Any] | None:
    """The daemon's judgement of the root's steps (``retention``), if it answers."""
    try:
        return _call(args, p.Retention(id=1, root=root.path), 30.0)
    except _Unreachable:
        return None


def _set_aside_rows(root: RootConfig, known: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Failed attempts' directories in the root's trash, kept until ``gc``."""
    trash = os.path.join(root.path, TRASH)
    try:
        names = sorted(os.listdir(trash))
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


def _manifest(path: str) -> Manifest | None:
    try:
        with open(os.path.join(path, MANIFEST_NAME), "rb") as fh:
            return msgspec.json.decode(fh.read(), type=Manifest)
    except (OSError, msgspec.DecodeError):
        return None


def _latest(args: argparse.Namespace) -> int:
    root = _root_layout(args, None)
    try:
        reply = _call(args, p.Latest(id=1, root=root.path), 5.0)
    except _Unreachable:
        reply = None  # the pointer on disk is the truth; the daemon only adds layout
    if reply is not None and reply["ok"]:
        print(reply["path"])
        return 0
    if reply is not None and reply["error"]["code"] != p.ErrorCode.ROOT_NOT_CONFIGURED:
        return _refused(reply)
    step = latest_promoted(root)
    if step is None:
        print(f"ckptd: {root.path} has no promoted checkpoint", file=sys.stderr)
        return 1
    print(root.final_dir(step))
    return 0


def _tail(args: argparse.Namespace) -> int:
    path = args.socket or default_socket_path()
    for event in _requests(path, p.Subscribe(id=1), None):
        if "event" not in event:
            if event.get("ok") is False:
                return _refused(event)
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


def _verify(args: argparse.Namespace) -> int:
    problems = verify_checkpoint(os.path.abspath(args.path))
    if args.json:
        print(json.dumps({"path": args.path, "ok": not problems, "problems": problems}))
    elif problems:
        for problem in problems:
            print(f"{args.path}: {problem}")
    else:
        print(f"{args.path}: OK")
    return 1 if problems else 0


def _promote(args: argparse.Namespace) -> int:
    root = os.path.abspath(args.root)
    reply = _call(args, p.Promote(id=1, root=root, step=args.step), 700.0)
    if not reply["ok"]:
        return _refused(reply)
    if reply["state"] == "promoted":
        print(reply["path"])
        return 0
    print(f"ckptd: step {args.step} {reply['state']}: {reply.get('reason') or ''}", file=sys.stderr)
    return 1


def _gc(args: argparse.Namespace) -> int:
    if args.policy:
        return retention_cli.policy_report(args, _call, _refused)
    root = os.path.abspath(args.root)
    reply = _call(args, p.Gc(id=1, root=root, remove=args.yes), 600.0)
    if not reply["ok"]:
        return _refused(reply)
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


def _table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    for row in (header, *rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)).rstrip())


def _human(n: int | None) -> str:
    if n is None:
        return ""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

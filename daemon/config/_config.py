"""Daemon configuration: flags, a TOML file and the environment, validated in one place."""

from __future__ import annotations

import os
import re
import socket as _socket
import tomllib
from dataclasses import dataclass, field
from typing import Any

from orchestrator.protocol import default_socket_path

from ..base._errors import ConfigError
from ._root import RootConfig, abspath, build_root, check_disjoint
from ._types import check_types

__all__ = ["Config", "RootConfig", "default_socket_path", "default_state_dir", "load_config"]

_LOG_LEVELS = ("debug", "info", "warning", "error")
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def default_node() -> str:
    """This node's name: the hostname up to its first dot (``--node`` overrides it)."""
    return _socket.gethostname().split(".")[0] or "localhost"


def default_state_dir(env: dict[str, str] | None = None) -> str:
    """Where the journal lives.

    ``/var/lib/ckptd`` as root, else ``$XDG_STATE_HOME/ckptd`` (``~/.local/state/ckptd``).
    """
    env = dict(os.environ) if env is None else env
    if os.getuid() == 0:
        return "/var/lib/ckptd"
    base = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "ckptd")


@dataclass(kw_only=True, slots=True)
class Config:
    """Everything ``ckptd serve`` needs."""

    socket: str = field(default_factory=default_socket_path)
    """Path of the Unix socket to listen on (ignored when systemd passes one in)."""
    roots: tuple[RootConfig, ...] = ()
    """The configured checkpoint roots."""
    lease: float = 30.0
    """Seconds a rank whose connection dropped mid-save has to reconnect and finish."""
    save_timeout: float | None = 3600.0
    """Seconds from a save's first begin until an incomplete save fails; None (0 in the
    TOML file): never."""
    log_level: str = "info"
    """Lowest event level written to stdout: debug, info, warning or error."""
    max_connections: int = 4096
    """Connections served at once; more are closed on accept with an error line."""
    max_open_saves: int = 10_000
    """Saves in flight at once; a ``begin`` for another new step gets ``too_busy``."""
    socket_mode: int = 0o660
    """Permission bits of the socket file (TOML: ``socket_mode = 0o660``)."""
    state_dir: str = field(default_factory=default_state_dir)
    """Directory of the journal; one daemon per state directory."""
    allowed_uids: tuple[int, ...] = field(default_factory=lambda: tuple({os.getuid(), 0}))
    """Peers (``SO_PEERCRED``) whose uid is here may connect: by default the daemon's own
    uid and root."""
    allowed_gids: tuple[int, ...] = ()
    """Peers whose primary gid is here may connect too (e.g. the trainers' group)."""
    stall_timeout: float = 30.0
    """Seconds a client may take to finish a line it started before it is dropped."""
    event_loop: str = "uvloop"
    """``uvloop`` (served faster; falls back to ``asyncio`` where uvloop is not
    installed) or ``asyncio`` (the standard library's loop)."""
    root_threads: int = 8
    """Blocking filesystem calls that run at once for one root, each in a thread that
    serves only that root; more wait their turn. A hung filesystem holds at most this
    many threads, and delays only its own root's requests."""
    fs_stall_after: float = 30.0
    """Seconds a filesystem call for a root (or a journal write) may run before the
    daemon reports the root (``root.stalled``) or the journal (``journal.stalled``)."""
    node: str = field(default_factory=default_node)
    """This node's name in node markers (``--node``); unique among a job's nodes."""
    node_timeout: float = 600.0
    """Seconds the leader of a save that spans nodes waits, once its own ranks are done,
    for the other nodes' markers before it fails the save (naming who is missing)."""
    metrics_listen: str = ""
    """``HOST:PORT`` to serve Prometheus metrics on over HTTP (``:9464``: every address;
    ``[::1]:9464``: IPv6); empty: no HTTP listener."""
    metrics_textfile: str = ""
    """Path of a node_exporter textfile (``*.prom``) the metrics are written to, by an
    atomic rename; empty: none."""

    def __post_init__(self) -> None:
        if not self.roots:
            raise ConfigError("no checkpoint root configured: pass --root DIR (repeatable)")
        check_disjoint(self.roots)
        if not self.lease > 0:
            raise ConfigError(f"lease must be > 0 seconds, got {self.lease}")
        if self.save_timeout is not None and not self.save_timeout > 0:
            raise ConfigError(f"save_timeout must be > 0 seconds, got {self.save_timeout}")
        if self.log_level not in _LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {_LOG_LEVELS}, got {self.log_level!r}")
        if not isinstance(self.socket_mode, int) or not 0 <= self.socket_mode <= 0o777:
            raise ConfigError(
                f"socket_mode must be permission bits like 0o660, got {self.socket_mode!r}"
            )
        if self.max_open_saves < 1:
            raise ConfigError(f"max_open_saves must be >= 1, got {self.max_open_saves}")
        if self.max_connections < 1:
            raise ConfigError(f"max_connections must be >= 1, got {self.max_connections}")
        for name in ("allowed_uids", "allowed_gids"):
            ids = getattr(self, name)
            if not all(isinstance(i, int) and i >= 0 for i in ids):
                raise ConfigError(f"{name} must be non-negative integers, got {ids!r}")
        if not self.stall_timeout > 0:
            raise ConfigError(f"stall_timeout must be > 0 seconds, got {self.stall_timeout}")
        if self.event_loop not in ("uvloop", "asyncio"):
            raise ConfigError(f"event_loop must be uvloop or asyncio, got {self.event_loop!r}")
        if not isinstance(self.root_threads, int) or not 1 <= self.root_threads <= 1024:
            raise ConfigError(
                f"root_threads must be an integer from 1 to 1024, got {self.root_threads!r}; "
                "8 suits most roots, a few more a high-latency network filesystem"
            )
        if not self.fs_stall_after > 0:
            raise ConfigError(
                f"fs_stall_after must be > 0 seconds, got {self.fs_stall_after}; set it above "
                "the longest a healthy filesystem call takes (a large checkpoint's flush)"
            )
        if not isinstance(self.node, str) or not _NODE_NAME.match(self.node):
            raise ConfigError(
                f"node {self.node!r} must be 1-64 letters, digits, '.', '_' or '-' (it names "
                "a file in each checkpoint); pass --node NAME"
            )
        if not self.node_timeout > 0:
            raise ConfigError(
                f"node_timeout must be > 0 seconds, got {self.node_timeout}; allow for the "
                "slowest node's writes to land after the leader's"
            )
        if not os.path.isabs(self.state_dir):
            raise ConfigError(f"state_dir {self.state_dir!r} must be an absolute path")
        if not self.socket or len(os.fsencode(self.socket)) > 107:
            raise ConfigError(
                f"socket path {self.socket!r} is empty or longer than the 107 bytes AF_UNIX "
                "allows; choose a shorter path"
            )
        _check_metrics(self.metrics_listen, self.metrics_textfile)

    def root_for(self, path: str) -> RootConfig | None:
        """The configured root a request names, by its configured or its resolved path."""
        for root in self.roots:
            if path in (root.path, root.real) or (root.named and path == root.named):
                return root
        return None


def load_config(
    *,
    config_file: str | None = None,
    socket: str | None = None,
    roots: list[str] | None = None,
    lease: float | None = None,
    log_level: str | None = None,
    state_dir: str | None = None,
    allow_uids: list[int] | None = None,
    allow_gids: list[int] | None = None,
    node: str | None = None,
    env: dict[str, str] | None = None,
    metrics_listen: str | None = None,
) -> Config:
    """Merge defaults, the TOML file, the environment and flags (later wins).

    Raises:
        ConfigError: anything is missing, malformed or points nowhere.
    """
    data: dict[str, Any] = {}
    if config_file is not None:
        try:
            with open(config_file, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {config_file}: {exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {config_file} is not valid TOML: {exc}") from exc
    env = dict(os.environ) if env is None else env
    known = {
        "socket",
        "roots",
        "lease",
        "save_timeout",
        "log_level",
        "max_connections",
        "max_open_saves",
        "socket_mode",
        "state_dir",
        "allowed_uids",
        "allowed_gids",
        "stall_timeout",
        "event_loop",
        "root_threads",
        "fs_stall_after",
        "node",
        "node_timeout",
        "metrics_listen",
        "metrics_textfile",
    }
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown keys in {config_file}: {unknown}; known: {sorted(known)}")
    check_types(Config, data, config_file or "the configuration")

    root_tables: list[dict[str, Any]] = list(data.get("roots", []))
    # A --root the file already lists is that root, with the file's settings (a Slurm
    # prolog names the job's roots; the site's file may give one a retention policy).
    listed = {abspath(t["path"]) for t in root_tables if isinstance(t, dict) and "path" in t}
    root_tables += [{"path": r} for r in roots or [] if abspath(r) not in listed]
    built = tuple(build_root(table, config_file) for table in root_tables)

    kwargs: dict[str, Any] = {k: v for k, v in data.items() if k != "roots"}
    for name in ("allowed_uids", "allowed_gids"):
        if name in kwargs:
            kwargs[name] = tuple(kwargs[name])
    # Flags add to the file's lists; the daemon's own uid and root always stay allowed.
    uids = {os.getuid(), 0, *kwargs.get("allowed_uids", ()), *(allow_uids or [])}
    kwargs["allowed_uids"] = tuple(sorted(uids))
    kwargs["allowed_gids"] = tuple(sorted({*kwargs.get("allowed_gids", ()), *(allow_gids or [])}))
    if kwargs.get("save_timeout") == 0:
        kwargs["save_timeout"] = None  # TOML has no null: 0 turns the limit off
    if "CKPTD_SOCKET" in env and env["CKPTD_SOCKET"]:
        kwargs["socket"] = env["CKPTD_SOCKET"]
    elif "socket" not in kwargs:
        kwargs["socket"] = default_socket_path(env)
    flags = {
        "socket": socket,
        "lease": lease,
        "log_level": log_level,
        "state_dir": state_dir,
        "node": node,
    }
    if state_dir is not None:
        flags["state_dir"] = os.path.abspath(state_dir)
    flags["metrics_listen"] = metrics_listen
    kwargs.update({k: v for k, v in flags.items() if v is not None})
    try:
        return Config(roots=built, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"bad value in {config_file}: {exc}") from exc


def _check_metrics(listen: str, textfile: str) -> None:
    """Validate ``metrics_listen`` and ``metrics_textfile``.

    Raises:
        ConfigError: naming the field and the form it takes.
    """
    if listen:
        parse_listen(listen)
    if textfile and (not os.path.isabs(textfile) or not textfile.endswith(".prom")):
        raise ConfigError(
            f"metrics_textfile {textfile!r} must be an absolute path ending in .prom (the "
            "name node_exporter's textfile collector reads), e.g. "
            "/var/lib/node_exporter/textfile/ckptd.prom"
        )


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``:PORT`` for every address, ``[V6]:PORT``) as ``(host, port)``.

    Raises:
        ConfigError: ``text`` is not of that form.
    """
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535 or "[" in host:
        raise ConfigError(
            f"metrics_listen {text!r} must be HOST:PORT, e.g. 127.0.0.1:9464, :9464 (every "
            "address) or [::1]:9464"
        )
    return host or "0.0.0.0", int(port)

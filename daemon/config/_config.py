"""Daemon configuration: flags, a TOML file and the environment, validated in one place."""

from __future__ import annotations

import os
import re
import socket as _socket
import tomllib
from dataclasses import dataclass, field, fields
from typing import Any

from orchestrator.protocol import default_socket_path

from ..base._errors import ConfigError
from ._retention import RetentionConfig, parse_retention
from ._types import check_types

__all__ = ["Config", "RootConfig", "default_socket_path", "default_state_dir", "load_config"]

_LOG_LEVELS = ("debug", "info", "warning", "error")
_WATCH_MODES = ("auto", "inotify", "poll")
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


@dataclass(kw_only=True, slots=True, frozen=True)
class RootConfig:
    """One checkpoint root: the only kind of directory the daemon renames in."""

    path: str
    """Absolute, normalised path of the root, as trainers name it in requests."""
    tmp_prefix: str = "tmp_step_"
    """Step N is written into ``<path>/<tmp_prefix>N``."""
    final_prefix: str = "step_"
    """Step N is promoted to ``<path>/<final_prefix>N``."""
    pointer: str = "latest"
    """Name of the symlink (or ``<pointer>.txt`` fallback) naming the newest promoted step."""
    real: str = ""
    """The root with symlinks resolved; filled in by :func:`load_config`."""
    named: str = ""
    """The path as configured, when it is a symlink to :attr:`path` (requests may name
    either). The daemon renames only in the resolved directory, so a symlink re-pointed
    while it runs never moves its work elsewhere."""
    retention: RetentionConfig | None = None
    """The root's retention policy (TOML ``[roots.retention]``); None: nothing is ever
    retired."""
    watch: str = "auto"
    """How the daemon sees other nodes' markers in this root: ``inotify`` (watchfiles;
    sees only this machine's writes), ``poll`` (every ``poll_interval``; sees every
    node's), or ``auto``: inotify on a local filesystem, polling on a network or FUSE
    one."""
    poll_interval: float = 0.25
    """Seconds between looks at a spanning save's shared directory when polling."""
    poll_budget: float = 1500.0
    """Looks a second that all the nodes of one job together may spend waiting for a
    spanning save's outcome. Each node other than the leader looks every
    ``max(poll_interval, nodes / poll_budget)`` seconds, so the load on the shared
    filesystem's server stays near ``poll_budget`` lookups a second however many nodes
    the job has (4,096 nodes: a look every 2.7 s); see docs/multinode.md."""

    def __post_init__(self) -> None:
        if not os.path.isabs(self.path) or os.path.normpath(self.path) != self.path:
            raise ConfigError(
                f"root {self.path!r} must be an absolute, normalised path (no '..', no "
                "trailing '/'); write it as os.path.abspath would"
            )
        for name in ("tmp_prefix", "final_prefix", "pointer"):
            value = getattr(self, name)
            if not value or "/" in value or value in (".", "..") or "\0" in value:
                raise ConfigError(f"{name} {value!r} of root {self.path} must be a plain name")
        if self.watch not in _WATCH_MODES:
            raise ConfigError(
                f"watch {self.watch!r} of root {self.path} must be one of {_WATCH_MODES}; "
                "poll on a shared filesystem (NFS, Lustre, FUSE), auto otherwise"
            )
        if not (isinstance(self.poll_interval, int | float) and 0.01 <= self.poll_interval <= 60):
            raise ConfigError(
                f"poll_interval {self.poll_interval!r} of root {self.path} must be from 0.01 "
                "to 60 seconds"
            )
        if not (isinstance(self.poll_budget, int | float) and 10 <= self.poll_budget <= 1e6):
            raise ConfigError(
                f"poll_budget {self.poll_budget!r} of root {self.path} must be from 10 to "
                "1000000 looks a second (what the shared filesystem's server can take)"
            )
        if self.tmp_prefix.startswith(self.final_prefix) or self.final_prefix.startswith(
            self.tmp_prefix
        ):
            # Otherwise a directory name would not say whether it is promoted.
            raise ConfigError(
                f"root {self.path}: tmp_prefix {self.tmp_prefix!r} and final_prefix "
                f"{self.final_prefix!r} must not be prefixes of each other"
            )

    def tmp_dir(self, step: int) -> str:
        """Directory step ``step`` is written into."""
        return os.path.join(self.path, f"{self.tmp_prefix}{step}")

    def final_dir(self, step: int) -> str:
        """Directory step ``step`` is promoted to."""
        return os.path.join(self.path, f"{self.final_prefix}{step}")

    def parse_step(self, name: str, prefix: str) -> int | None:
        """The step of a directory entry ``name`` with ``prefix``, or None.

        Only the name the daemon gives a step (:meth:`final_dir`, :meth:`tmp_dir`: the
        step in plain decimal) is one: ``step_03``, a copy made by hand, is no second
        ``step_3`` and is never counted, judged or touched as a checkpoint.
        """
        digits = name[len(prefix) :] if name.startswith(prefix) else ""
        if not (digits.isdigit() and digits.isascii()) or (digits[0] == "0" and digits != "0"):
            return None
        return int(digits)


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
        _check_disjoint(self.roots)
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
    listed = {_abspath(t["path"]) for t in root_tables if isinstance(t, dict) and "path" in t}
    root_tables += [{"path": r} for r in roots or [] if _abspath(r) not in listed]
    built = tuple(_root(table, config_file) for table in root_tables)

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


def _abspath(path: object) -> str:
    return os.path.abspath(os.path.expanduser(str(path)))


def _root(table: dict[str, Any], source: str | None) -> RootConfig:
    if not isinstance(table, dict) or "path" not in table:
        raise ConfigError(f"each [[roots]] entry in {source} needs a path")
    path = _abspath(table["path"])
    if not os.path.isdir(path):
        raise ConfigError(f"root {path} is not an existing directory; create it first")
    check_types(RootConfig, table, f"[[roots]] {table['path']} of {source}")
    extra = {k: v for k, v in table.items() if k != "path"}
    options = {f.name for f in fields(RootConfig)} - {"path", "real", "named"}
    if set(extra) - options:
        raise ConfigError(
            f"unknown keys in [[roots]] {path} of {source}: {sorted(set(extra) - options)}; "
            f"known: {sorted(options | {'path'})}"
        )
    if "retention" in extra:  # the [roots.retention] sub-table
        prefixes = (
            str(extra.get("tmp_prefix", "tmp_step_")),
            str(extra.get("final_prefix", "step_")),
        )
        extra["retention"] = parse_retention(
            extra["retention"], path, str(extra.get("pointer", "latest")), prefixes
        )
    real = os.path.realpath(path)
    named = path if real != path else ""
    try:
        return RootConfig(path=real, real=real, named=named, **extra)
    except TypeError as exc:
        raise ConfigError(f"root {path}: {exc}") from exc


def _check_disjoint(roots: tuple[RootConfig, ...]) -> None:
    """Refuse roots that are one directory under two names, or that nest.

    Two names of one directory would get two locks, two promoters and two pointers for
    the same files; a root inside another would have its checkpoints counted, pruned
    or removed as the outer root's entries.

    Raises:
        ConfigError: naming both roots and how to fix it.
    """
    resolved = [(r, r.real or r.path) for r in roots]
    for i, (a, ra) in enumerate(resolved):
        for b, rb in resolved[i + 1 :]:
            if (a.named or a.path) == (b.named or b.path):
                raise ConfigError(f"a root is configured twice: {a.named or a.path}")
            if ra == rb or _same_directory(ra, rb):
                raise ConfigError(
                    f"roots {a.named or a.path} and {b.named or b.path} are the same "
                    f"directory ({ra}); configure it once"
                )
            for outer, inner, ro, ri in ((a, b, ra, rb), (b, a, rb, ra)):
                if ri.startswith(ro.rstrip(os.sep) + os.sep):
                    raise ConfigError(
                        f"root {inner.named or inner.path} is inside root "
                        f"{outer.named or outer.path}; roots must not nest (give each run "
                        "its own directory side by side)"
                    )


def _same_directory(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` are one directory (a bind mount under two paths)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False

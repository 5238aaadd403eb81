"""One checkpoint root: its settings, how it is built from TOML, and that roots stay apart."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Final

from ..base._errors import ConfigError
from ._retention import RetentionConfig, parse_retention
from ._s3 import S3Options, is_s3_url, parse_s3_options, split_s3_url
from ._tiers import FastTier, parse_fast
from ._types import check_types

__all__ = ["RootConfig", "abspath", "build_root", "check_disjoint"]

_WATCH_MODES: Final = ("auto", "inotify", "poll")


@dataclass(kw_only=True, slots=True, frozen=True)
class RootConfig:
    """One checkpoint root: the only kind of directory the daemon renames in."""

    path: str
    """Absolute, normalised path of the root, as trainers name it in requests; or
    ``s3://BUCKET/PREFIX`` for a root on an object store (:mod:`daemon.config._s3`)."""
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
    s3: S3Options | None = None
    """Where and as whom an ``s3://`` root is reached (TOML ``[roots.s3]``); None: from
    the AWS environment alone. Only for ``s3://`` roots."""
    staging: str = ""
    """Where step N is written (``<staging>/<tmp_prefix>N``) when not in the root: an
    absolute directory on the root's filesystem, outside it (a trainer that lists its
    output directory, such as transformers' ``Trainer``, never sees a save in flight).
    "": in the root. The promotion renames from here into the root, so the two must be
    one filesystem; they are checked to be one device when the configuration is
    loaded."""
    fast: FastTier | None = None
    """The root's node-local fast tier (TOML ``[roots.fast]``, docs/tiers.md); None:
    ranks write into the root itself."""

    def __post_init__(self) -> None:
        if is_s3_url(self.path):
            split_s3_url(self.path)
        elif self.s3 is not None:
            raise ConfigError(f"root {self.path}: [roots.s3] is only for s3:// roots")
        elif not os.path.isabs(self.path) or os.path.normpath(self.path) != self.path:
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
        if self.staging:
            self._check_staging()
        if self.tmp_prefix.startswith(self.final_prefix) or self.final_prefix.startswith(
            self.tmp_prefix
        ):
            # Otherwise a directory name would not say whether it is promoted.
            raise ConfigError(
                f"root {self.path}: tmp_prefix {self.tmp_prefix!r} and final_prefix "
                f"{self.final_prefix!r} must not be prefixes of each other"
            )

    def _check_staging(self) -> None:
        where = f"staging {self.staging!r} of root {self.path}"
        if is_s3_url(self.path):
            raise ConfigError(
                f"{where}: an s3:// root has no staging directory (nothing is renamed)"
            )
        if not os.path.isabs(self.staging) or os.path.normpath(self.staging) != self.staging:
            raise ConfigError(
                f"{where} must be an absolute, normalised path (no '..', no trailing '/')"
            )
        for a, b in ((self.staging, self.path), (self.path, self.staging)):
            if a == b or a.startswith(b.rstrip(os.sep) + os.sep):
                raise ConfigError(
                    f"{where} must be outside the root and must not hold it (a directory "
                    "beside the root, e.g. ROOT.staging)"
                )

    @property
    def staging_dir(self) -> str:
        """The directory that holds the steps being written: :attr:`staging`, else the root."""
        return self.staging or self.path

    def tmp_dir(self, step: int) -> str:
        """Directory step ``step`` is written into."""
        return os.path.join(self.staging_dir, f"{self.tmp_prefix}{step}")

    def final_dir(self, step: int) -> str:
        """Directory step ``step`` is promoted to."""
        return os.path.join(self.path, f"{self.final_prefix}{step}")

    @property
    def on_object_store(self) -> bool:
        """Whether the root is an ``s3://`` URL: attempts are prefixes, nothing is renamed."""
        return is_s3_url(self.path)

    def save_dir(self, step: int, attempt: str) -> str:
        """Where the ranks of ``attempt`` write step ``step``.

        ``tmp_step_N`` on a filesystem (renamed into place once complete); on an object
        store the attempt's own prefix ``step_N/ATTEMPT``, which is never moved: its
        commit object (:mod:`daemon.store._s3commit`) makes it the checkpoint.
        """
        if self.on_object_store and attempt:
            return f"{self.final_dir(step)}/{attempt}"
        return self.tmp_dir(step)

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


def abspath(path: object) -> str:
    if is_s3_url(str(path)):
        return str(path)
    return os.path.abspath(os.path.expanduser(str(path)))


def build_root(table: dict[str, Any], source: str | None) -> RootConfig:
    """The root a ``[[roots]]`` table (or a ``--root``'s ``{"path": ...}``) describes.

    Raises:
        ConfigError: the root is missing, not a directory (nor an ``s3://`` URL), or a
            setting is unknown or malformed.
    """
    if not isinstance(table, dict) or "path" not in table:
        raise ConfigError(f"each [[roots]] entry in {source} needs a path")
    path = abspath(table["path"])
    s3 = is_s3_url(path)
    if not s3 and not os.path.isdir(path):
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
    if "s3" in extra:  # the [roots.s3] sub-table
        extra["s3"] = parse_s3_options(extra["s3"], path)
    if extra.get("staging") and not s3:
        extra["staging"] = _staging(path, str(extra["staging"]))
    if "fast" in extra:  # the [roots.fast] sub-table
        extra["fast"] = parse_fast(extra["fast"], path, s3=s3)
    # An object store has no symlinks: the URL is the root's one name.
    real = path if s3 else os.path.realpath(path)
    named = path if real != path else ""
    try:
        return RootConfig(path=real, real=real, named=named, **extra)
    except TypeError as exc:
        raise ConfigError(f"root {path}: {exc}") from exc


def _staging(root: str, staging: str) -> str:
    """A root's staging directory, resolved, once it is shown to be on the root's device.

    Raises:
        ConfigError: it is not absolute, not an existing directory, or on another
            filesystem than the root (the promotion's rename could not cross).
    """
    if not os.path.isabs(staging):
        raise ConfigError(
            f"staging {staging!r} of root {root} must be an absolute path (a directory "
            "beside the root on its filesystem)"
        )
    if not os.path.isdir(staging):
        raise ConfigError(
            f"staging {staging} of root {root} is not an existing directory; create it first"
        )
    if os.stat(staging).st_dev != os.stat(root).st_dev:
        raise ConfigError(
            f"staging {staging} of root {root} is on another filesystem than the root; the "
            "promotion renames from one into the other, which only works on one filesystem: "
            "put it beside the root"
        )
    return os.path.realpath(staging)


def check_disjoint(roots: tuple[RootConfig, ...]) -> None:
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
    _check_stagings(roots)


def _check_stagings(roots: tuple[RootConfig, ...]) -> None:
    """Refuse a staging directory that is, holds or is inside another root or staging.

    Each root's gc, recovery and set-asides treat every ``tmp_prefix`` entry of its
    staging directory as its own; a directory shared with another root would have one
    root's saves in flight removed as the other's orphans.
    """
    places = [(r, r.real or r.path, "root") for r in roots]
    places += [(r, r.staging, "staging") for r in roots if r.staging]
    for i, (a, pa, ka) in enumerate(places):
        for b, pb, kb in places[i + 1 :]:
            if a is b or "staging" not in (ka, kb):
                continue
            inside = pa.startswith(pb.rstrip(os.sep) + os.sep) or pb.startswith(
                pa.rstrip(os.sep) + os.sep
            )
            if pa == pb or inside or _same_directory(pa, pb):
                raise ConfigError(
                    f"{ka} {pa} of root {a.named or a.path} and {kb} {pb} of root "
                    f"{b.named or b.path} overlap; give each root its own staging directory, "
                    "outside every root"
                )


def _same_directory(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` are one directory (a bind mount under two paths)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False

"""A root's fast tier: a node-local directory ranks write into at local speed.

TOML ``[roots.fast]`` under a ``[[roots]]`` entry. The root itself stays the durable
tier; the fast tier holds the newest steps on each node, and the daemon drains the
steps this policy selects to the root (docs/tiers.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Final

from ..base._errors import ConfigError
from ._types import check_types

__all__ = ["FastTier", "parse_fast"]

_IONICE: Final = ("idle", "best-effort", "none")


@dataclass(kw_only=True, slots=True, frozen=True)
class FastTier:
    """The fast tier of one root and its drain policy."""

    path: str
    """Absolute node-local directory (NVMe, or tmpfs such as ``/dev/shm/ckpt``); the
    same path on every node. Steps are written into ``<path>/tmp_step_N`` and promoted
    to ``<path>/step_N``, with the tier's own ``latest``."""
    keep: int = 2
    """How many locally promoted steps each node keeps (the newest ones)."""
    drain_every_steps: int = 0
    """Drain a step whose number is a multiple of this; 0: no step-count rule."""
    drain_every_minutes: float = 0.0
    """Drain the newest local step once this long has passed since the last drain was
    ordered; 0: no time rule."""
    drain_on_stop: bool = True
    """On a clean stop (SIGTERM), drain the newest local step if it is not durable."""
    stop_grace: float = 60.0
    """Seconds a clean stop may spend on that drain; what is left is reported."""
    drain_rate_mb_s: float = 0.0
    """The drain's bandwidth cap per node in MB/s (10**6 bytes); 0: uncapped."""
    drain_ionice: str = "idle"
    """The drain threads' IO priority: ``idle`` (only when the disk is otherwise idle),
    ``best-effort`` (lowest best-effort level) or ``none`` (unchanged)."""
    drain_threads: int = 2
    """Files a node copies at once during a drain."""
    evict_undrained: bool = False
    """Whether local retention may evict a step selected for draining that is not yet
    durable (never the newest local step)."""
    min_free_mb: float = 0.0
    """Refuse a save when the tier has less free space than this (MB), or than the
    node's part of the last local step, whichever is more."""
    node_timeout: float = 120.0
    """Seconds a node waits for every node's part of a step (local promotion) and for
    every node's answer when a restart asks where to restore from."""

    def __post_init__(self) -> None:
        if not os.path.isabs(self.path) or os.path.normpath(self.path) != self.path:
            raise ConfigError(f"fast tier path {self.path!r} must be an absolute, normalised path")
        checks = (
            ("keep", self.keep, 1, 10_000),
            ("drain_every_steps", self.drain_every_steps, 0, 10**9),
            ("drain_every_minutes", self.drain_every_minutes, 0, 10**6),
            ("stop_grace", self.stop_grace, 0, 86_400),
            ("drain_rate_mb_s", self.drain_rate_mb_s, 0, 10**6),
            ("drain_threads", self.drain_threads, 1, 64),
            ("min_free_mb", self.min_free_mb, 0, 10**9),
            ("node_timeout", self.node_timeout, 1, 86_400),
        )
        for name, value, low, high in checks:
            if isinstance(value, bool) or not (low <= value <= high):
                raise ConfigError(
                    f"fast tier {self.path}: {name} {value!r} must be from {low} to {high}"
                )
        if self.drain_ionice not in _IONICE:
            raise ConfigError(
                f"fast tier {self.path}: drain_ionice {self.drain_ionice!r} must be one of "
                f"{_IONICE}"
            )

    def selects(self, step: int) -> bool:
        """Whether the step-count rule selects ``step`` for draining."""
        return self.drain_every_steps > 0 and step % self.drain_every_steps == 0

    def due(self, step: int, since_order: float | None) -> bool:
        """Whether ``step``, just promoted locally, is selected for draining.

        ``since_order``: seconds since the last drain of the root was ordered (None:
        none yet). Either rule selects: the step count, or ``drain_every_minutes`` passed
        (the first step promoted counts as due).
        """
        every = self.drain_every_minutes * 60
        timely = every > 0 and (since_order is None or since_order >= every)
        return self.selects(step) or timely


def parse_fast(table: object, root: str, *, s3: bool) -> FastTier:
    """The fast tier a ``[roots.fast]`` table describes.

    Raises:
        ConfigError: a key is unknown or malformed, the path is not a directory, or it
            is inside the root.
    """
    if not isinstance(table, dict) or "path" not in table:
        raise ConfigError(f"[roots.fast] of root {root} must be a table with a path")
    check_types(FastTier, table, f"[roots.fast] of root {root}")
    known = {f.name for f in fields(FastTier)}
    unknown = set(table) - known
    if unknown:
        raise ConfigError(
            f"unknown keys in [roots.fast] of root {root}: {sorted(unknown)}; known: "
            f"{sorted(known)}"
        )
    values: dict[str, Any] = dict(table)
    path = os.path.abspath(os.path.expanduser(str(values.pop("path"))))
    if not os.path.isdir(path):
        raise ConfigError(f"fast tier {path} of root {root} is not a directory; create it")
    real = os.path.realpath(path)
    if not s3 and (real + os.sep).startswith(os.path.realpath(root).rstrip(os.sep) + os.sep):
        raise ConfigError(f"fast tier {path} must not be inside its root {root}")
    return FastTier(path=real, **values)

"""``[roots.retention]``: a root's retention policy in the TOML file, validated.

```toml
[[roots]]
path = "/ckpt/run-42"

[roots.retention]
keep_last = 3
keep_every_steps = 1000
keep_best = { k = 2, metric = "val_loss", mode = "min", grace_s = 3600 }
best_pointer = "best"
```

``keep_best`` may also say which steps compete (``every_steps = N``: multiples of N
only) and what a step without the metric is (``unscored = "grace"``, the default: kept
for ``grace_s`` then judged by the other rules; ``"worst"``: ranked after every scored
step, newer first, so it can fill a free place among the k, as NeMo-RL's
``keep_top_k`` does). With ``unscored = "worst"`` the metric may be left out: every step
is then unscored and the k newest competitors are kept.

A root without the table has no policy: nothing of it is ever retired.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from ..base._errors import ConfigError

__all__ = [
    "DEFAULT_GRACE_S",
    "MAX_METRICS",
    "KeepBest",
    "Policy",
    "RetentionConfig",
    "parse_retention",
]

MAX_METRICS: Final = 256
"""Metrics kept per step; more are refused (``score``, ``done``) or ignored (files)."""

DEFAULT_GRACE_S: Final = 3600.0
"""Seconds an unscored checkpoint is kept for an evaluation job to score it."""


@dataclass(frozen=True, slots=True)
class KeepBest:
    """Keep the ``k`` best complete checkpoints by ``metric``."""

    k: int
    """How many to keep (at least 1)."""
    metric: str
    """The metric's name, as ``done``, ``score`` or ``training_info.json`` give it; ""
    (only with ``unscored = "worst"``): none, so every step is unscored."""
    mode: Literal["min", "max"]
    """``min``: lower is better (a loss); ``max``: higher is better (a reward)."""
    grace_s: float = DEFAULT_GRACE_S
    """Seconds after its promotion an unscored checkpoint is kept, awaiting a score
    (0 with ``unscored = "worst"``, where it does not apply)."""
    every_steps: int | None = None
    """Only steps that are multiples of this compete (None: every complete step)."""
    unscored: Literal["grace", "worst"] = "grace"
    """A step without a finite value of ``metric``: ``grace``, kept ``grace_s`` and not
    ranked; ``worst``, ranked after every scored step (newer first), no grace."""

    def describe(self) -> str:
        """The rule as ``ckptd ls`` and events show it: ``keep_best=2:val_loss:min``.

        The options that are not their defaults follow, comma-separated:
        ``keep_best=2:val_loss:min,every=10,unscored=worst`` (``-`` for no metric).
        """
        text = f"keep_best={self.k}:{self.metric or '-'}:{self.mode}"
        if self.every_steps is not None:
            text += f",every={self.every_steps}"
        if self.unscored != "grace":
            text += f",unscored={self.unscored}"
        return text


@dataclass(frozen=True, slots=True)
class Policy:
    """A root's keep rules; a rule left None does not keep anything."""

    keep_last: int | None = None
    keep_every_steps: int | None = None
    keep_best: KeepBest | None = None

    def describe(self) -> str:
        """The rules in one line, e.g. ``keep_last=3 keep_every_steps=1000``."""
        parts = []
        if self.keep_last is not None:
            parts.append(f"keep_last={self.keep_last}")
        if self.keep_every_steps is not None:
            parts.append(f"keep_every_steps={self.keep_every_steps}")
        if self.keep_best is not None:
            parts.append(self.keep_best.describe())
        return " ".join(parts)


_METRIC: Final = re.compile(r"^[A-Za-z0-9_.:/@+-]{1,128}$")
_KEYS: Final = ("keep_last", "keep_every_steps", "keep_best", "best_pointer")
_BEST_KEYS: Final = ("k", "metric", "mode", "grace_s", "every_steps", "unscored")


@dataclass(kw_only=True, slots=True, frozen=True)
class RetentionConfig:
    """A root's retention: its keep rules and the name of its ``best`` pointer."""

    policy: Policy
    """The keep rules (a union)."""
    best_pointer: str = "best"
    """Name of the symlink (or ``<name>.txt`` fallback) naming the best checkpoint by
    ``keep_best``'s metric; written only when ``keep_best`` is set."""


def _int(value: Any, name: str, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def parse_retention(
    table: Any, root: str, pointer: str, prefixes: tuple[str, ...] = ("tmp_step_", "step_")
) -> RetentionConfig:
    """Build a root's :class:`RetentionConfig` from its ``[roots.retention]`` table.

    Args:
        table: The table as TOML parsed it.
        root: The root's path (for messages).
        pointer: The root's ``latest`` pointer name (the best pointer must differ).
        prefixes: The root's ``tmp_prefix`` and ``final_prefix``: the best pointer
            must not be a name a step's directory could have.

    Raises:
        ConfigError: a key is unknown, missing or out of range; the message says how
            to fix it.
    """
    where = f"[roots.retention] of root {root}"
    if isinstance(table, RetentionConfig):
        return table
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where} must be a table, got {table!r}")
    unknown = sorted(set(table) - set(_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; known: {list(_KEYS)}")
    keep_last = table.get("keep_last")
    if keep_last is not None:
        keep_last = _int(keep_last, "keep_last", where, 0)
    every = table.get("keep_every_steps")
    if every is not None:
        every = _int(every, "keep_every_steps", where, 1)
    best = None
    if "keep_best" in table:
        best = _keep_best(table["keep_best"], where)
    if keep_last is None and every is None and best is None:
        raise ConfigError(
            f"{where} has no keep rule: set keep_last, keep_every_steps or keep_best "
            "(or remove the table: a root without it keeps every checkpoint)"
        )
    best_pointer = table.get("best_pointer", "best")
    if (
        not isinstance(best_pointer, str)
        or not best_pointer
        or "/" in best_pointer
        or "\0" in best_pointer
        or best_pointer in (".", "..")
    ):
        raise ConfigError(f"{where}: best_pointer {best_pointer!r} must be a plain name")
    if best_pointer.startswith(".ckptd"):
        raise ConfigError(
            f"{where}: best_pointer {best_pointer!r}: names starting with '.ckptd' are the "
            "daemon's own files; choose another"
        )
    for prefix in prefixes:
        digits = best_pointer[len(prefix) :] if best_pointer.startswith(prefix) else ""
        if digits.isdigit():
            raise ConfigError(
                f"{where}: best_pointer {best_pointer!r} is a step's directory name "
                f"({prefix}N); choose another, such as 'best'"
            )
    if best_pointer == pointer:
        raise ConfigError(
            f"{where}: best_pointer {best_pointer!r} is the root's pointer too; name it apart"
        )
    return RetentionConfig(
        policy=Policy(keep_last=keep_last, keep_every_steps=every, keep_best=best),
        best_pointer=best_pointer,
    )


def _keep_best(value: Any, where: str) -> KeepBest:
    if not isinstance(value, Mapping):
        raise ConfigError(
            f'{where}: keep_best must be a table like {{ k = 2, metric = "val_loss", '
            f'mode = "min" }}, got {value!r}'
        )
    unknown = sorted(set(value) - set(_BEST_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown keys in keep_best {unknown}; known: {_BEST_KEYS}")
    unscored = value.get("unscored", "grace")
    if unscored not in ("grace", "worst"):
        raise ConfigError(
            f'{where}: keep_best.unscored must be "grace" (a step without the metric is '
            'kept grace_s, not ranked) or "worst" (ranked after every scored step), got '
            f"{unscored!r}"
        )
    needed = ("k", "metric", "mode") if unscored == "grace" else ("k",)
    for name in needed:
        if name not in value:
            raise ConfigError(f"{where}: keep_best needs {name} (k, metric and mode)")
    k = _int(value["k"], "keep_best.k", where, 1)
    metric = value.get("metric", "")  # left out (with "worst"): no metric, by recency
    if "metric" in value and (not isinstance(metric, str) or not _METRIC.match(metric)):
        raise ConfigError(
            f"{where}: keep_best.metric {metric!r} must be 1-128 of A-Za-z0-9_.:/@+- "
            "(the metric's name as training_info.json, done or score give it)"
        )
    mode = value.get("mode", "max")
    if mode not in ("min", "max"):
        raise ConfigError(
            f'{where}: keep_best.mode must be "min" (lower is better, a loss) or "max" '
            f"(higher is better, a reward), got {mode!r}"
        )
    every = value.get("every_steps")
    if every is not None:
        every = _int(every, "keep_best.every_steps", where, 1)
    if unscored == "worst" and "grace_s" in value:
        raise ConfigError(
            f'{where}: keep_best.grace_s applies only with unscored = "grace"; with '
            '"worst" a step without the metric is ranked at once: remove grace_s'
        )
    grace = value.get("grace_s", DEFAULT_GRACE_S if unscored == "grace" else 0.0)
    if (
        isinstance(grace, bool)
        or not isinstance(grace, int | float)
        or not math.isfinite(grace)
        or grace < 0
    ):
        raise ConfigError(f"{where}: keep_best.grace_s must be seconds >= 0, got {grace!r}")
    return KeepBest(
        k=k,
        metric=metric,
        mode=mode,
        grace_s=float(grace),
        every_steps=every,
        unscored=unscored,
    )

"""What a configuration reload changes: a pure comparison of the old and the new config.

:func:`plan_reload` compares every field of :class:`Config` and, root by root, every
field of :class:`RootConfig`, so options added to either later are compared (and, for
roots, applied) without a change here. A top-level field is applied live only if it is
in :data:`LIVE`: the daemon reads it afresh on each use. Any other top-level field (the
socket, the state directory, the lanes' threads, the metrics endpoint, and fields this
module does not know) keeps its old value until a restart, and the plan says so.

:func:`refusal` says why a plan must not be applied at all: a root's directory names
changing while saves are in flight there, whose directories carry the old names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Final

from orchestrator import protocol as p

from ..base._errors import RequestError
from ..config._config import Config, RootConfig

__all__ = [
    "LAYOUT",
    "LIVE",
    "ReloadPlan",
    "RootChange",
    "plan_reload",
    "refusal",
    "reloaded_root_check",
    "summary",
]

LIVE: Final = frozenset(
    {
        "roots",
        "log_level",
        "allowed_uids",
        "allowed_gids",
        "max_connections",
        "max_open_saves",
        "stall_timeout",
    }
)
"""Top-level fields a reload applies at once; every other one needs a restart."""

LAYOUT: Final = ("tmp_prefix", "final_prefix", "pointer", "staging")
"""Root fields that name directories on disk."""

_DERIVED: Final = frozenset({"real", "named"})
"""Root fields filled in by ``load_config``, not written in the file."""


@dataclasses.dataclass(frozen=True, slots=True)
class RootChange:
    """A root in both configurations whose options differ."""

    old: RootConfig
    new: RootConfig
    fields: tuple[str, ...]
    """The names of the fields that differ, sorted."""

    @property
    def layout(self) -> bool:
        """Whether a directory name (:data:`LAYOUT`) changes."""
        return any(name in LAYOUT for name in self.fields)


@dataclasses.dataclass(frozen=True, slots=True)
class ReloadPlan:
    """The difference between the running configuration and the reloaded file."""

    config: Config
    """The configuration to run with: the new one, with the fields that need a restart
    kept at their old values."""
    added: tuple[RootConfig, ...] = ()
    removed: tuple[RootConfig, ...] = ()
    changed: tuple[RootChange, ...] = ()
    live: tuple[str, ...] = ()
    """Top-level fields (other than ``roots``) that change now, sorted."""
    restart: tuple[str, ...] = ()
    """Top-level fields that differ but keep their old value until a restart, sorted."""

    @property
    def empty(self) -> bool:
        """Whether nothing at all differs."""
        return not (self.added or self.removed or self.changed or self.live or self.restart)


def plan_reload(old: Config, new: Config) -> ReloadPlan:
    """Compare ``old`` (running) with ``new`` (just loaded and validated)."""
    live: list[str] = []
    restart: list[str] = []
    for f in dataclasses.fields(old):
        if f.name == "roots" or getattr(old, f.name) == getattr(new, f.name):
            continue
        (live if f.name in LIVE else restart).append(f.name)
    before = {r.path: r for r in old.roots}
    after = {r.path: r for r in new.roots}
    added = tuple(r for path, r in after.items() if path not in before)
    removed = tuple(r for path, r in before.items() if path not in after)
    changed = []
    for path, root in after.items():
        previous = before.get(path)
        if previous is None or previous == root:
            continue
        names = tuple(
            sorted(
                f.name
                for f in dataclasses.fields(root)
                if getattr(previous, f.name) != getattr(root, f.name)
            )
        )
        changed.append(RootChange(old=previous, new=root, fields=names))
    kept = {name: getattr(old, name) for name in restart}
    config = dataclasses.replace(new, **kept) if kept else new
    return ReloadPlan(
        config=config,
        added=added,
        removed=removed,
        changed=tuple(changed),
        live=tuple(sorted(live)),
        restart=tuple(sorted(restart)),
    )


def refusal(plan: ReloadPlan, in_flight: Mapping[str, int]) -> str | None:
    """Why ``plan`` must not be applied, or None.

    Args:
        plan: The reload.
        in_flight: Saves not yet settled, by root path.
    """
    for change in plan.changed:
        count = in_flight.get(change.new.path, 0)
        if change.layout and count:
            names = ", ".join(n for n in change.fields if n in LAYOUT)
            return (
                f"root {change.new.path}: {names} cannot change while {count} save(s) are "
                "in flight there (their directories carry the old names); reload again once "
                "they have settled"
            )
    return None


def reloaded_root_check(
    config: Config, retiring: Mapping[str, RootConfig], root: RootConfig
) -> None:
    """Refuse a new save in ``root`` if a reload removed it, or renamed its directories.

    Called by ``begin`` after its last ``await`` before the save is recorded: ``root``
    was looked up when the request came in, and a reload may have run since.

    Raises:
        RequestError: ``root_not_configured`` (removed) or ``invalid_state`` (renamed).
    """
    current = config.root_for(root.path)
    if current is None or root.path in retiring:
        raise RequestError(
            p.ErrorCode.ROOT_NOT_CONFIGURED,
            f"{root.path} was removed from the configuration; saves in flight there "
            "finish, new saves are refused",
        )
    if any(getattr(current, name) != getattr(root, name) for name in LAYOUT):
        raise RequestError(
            p.ErrorCode.INVALID_STATE,
            f"a configuration reload changed the directory names of {root.path} while this "
            "begin was served; retry",
        )


def summary(plan: ReloadPlan) -> dict[str, Any]:
    """The plan as event fields (``config.reloaded``)."""
    return {
        "added": [r.path for r in plan.added],
        "removed": [r.path for r in plan.removed],
        "changed": {c.new.path: [n for n in c.fields if n not in _DERIVED] for c in plan.changed},
        "applied": list(plan.live),
        "restart_required": list(plan.restart),
    }

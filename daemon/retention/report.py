"""What a root's last applied pass found: for the metrics, read at scrape time. Pure.

A pass that applies the policy (after a promotion, a pin, a start, ``gc --yes``) leaves a
:class:`PassReport` per root in :attr:`daemon.retention.applier.Retention.passes`; the
metrics (``ckptd_retention_*``) read it when a scrape asks, so a pass costs no more
than building it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from .policy import Verdict

__all__ = ["PassReport", "report"]


@dataclass(frozen=True, slots=True)
class PassReport:
    """One root's last applied pass."""

    at: float
    """When it ended (wall-clock seconds)."""
    checkpoints: int
    """Complete checkpoints left in the root."""
    kept: dict[str, int] = field(default_factory=dict)
    """Steps kept, by reason as ``ckptd ls`` shows it (``newest``, a pointer's name,
    ``last-K``...); a step kept for several reasons counts under each."""
    retired: int = 0
    """Steps it renamed into the trash."""
    prunes: bool = True
    """Whether this daemon prunes the root (on a shared root, only the leader does)."""
    avail_bytes: int = 0
    """Bytes of the root's filesystem available to the daemon, as the pass found it."""
    size_bytes: int = 0
    """The size of the root's filesystem."""


def report(
    verdicts: Iterable[Verdict],
    gone: Collection[int],
    *,
    at: float,
    prunes: bool,
    space: tuple[int, int],
) -> PassReport:
    """The report of a pass that judged ``verdicts`` and retired the steps ``gone``."""
    kept: dict[str, int] = {}
    checkpoints = 0
    for verdict in verdicts:
        if verdict.step in gone:
            continue
        if "incomplete" not in verdict.kept:
            checkpoints += 1
        for reason in verdict.kept:
            kept[reason] = kept.get(reason, 0) + 1
    return PassReport(
        at=at,
        checkpoints=checkpoints,
        kept=kept,
        retired=len(gone),
        prunes=prunes,
        avail_bytes=space[0],
        size_bytes=space[1],
    )

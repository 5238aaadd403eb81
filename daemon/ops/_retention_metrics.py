"""Retention's Prometheus metrics: counted from its events, its last pass read at scrape.

Counters come from ``checkpoint.retired``, ``checkpoint.deleted``, ``retention.failed``
and ``retention.refused``, each at 0 from the start for every root with a policy (so an
alert on nothing retired fires for a root that never retired). Gauges come from each
root's last applied pass (:class:`daemon.retention.report.PassReport`), read on the
event loop when a scrape asks: when it ran, what it kept and why, how many checkpoints
are left, whether this daemon prunes the root, and the root's free space as the pass
found it (a ``statvfs`` in the root's lane, never on a scrape: a hung root never holds
one up).

Labels stay bounded: ``root`` is a configured root, ``reason`` one of
:data:`KEPT_REASONS`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final, Protocol

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric

from ..config._config import RootConfig

__all__ = ["KEPT_REASONS", "RetentionMetrics", "kept_reason"]

KEPT_REASONS: Final = (
    "newest",
    "latest",
    "best",
    "pinned",
    "held",
    "keep_last",
    "keep_every_steps",
    "keep_best",
    "unscored",
    "incomplete",
    "other",
)
"""The values of ``ckptd_retention_kept``'s ``reason`` label."""

_RULES: Final = (("last-", "keep_last"), ("every-", "keep_every_steps"), ("best-", "keep_best"))


def kept_reason(reason: str, root: RootConfig) -> str:
    """The bounded class (one of :data:`KEPT_REASONS`) of a reason a step is kept.

    ``reason`` is as ``ckptd ls`` shows it: ``newest``, a pointer's configured name
    (``latest``'s and ``best``'s become those words), ``last-K``, ``every-N``, ``best-k``,
    ``unscored``, ``pinned``, ``held`` or ``incomplete``.
    """
    if reason == root.pointer:
        return "latest"
    if root.retention is not None and reason == root.retention.best_pointer:
        return "best"
    for prefix, name in _RULES:
        if reason.startswith(prefix) and reason[len(prefix) :].isdigit():
            return name
    return reason if reason in KEPT_REASONS else "other"


class Report(Protocol):
    """A root's last applied pass (:class:`daemon.retention.report.PassReport`)."""

    @property
    def at(self) -> float: ...
    @property
    def checkpoints(self) -> int: ...
    @property
    def kept(self) -> Mapping[str, int]: ...
    @property
    def prunes(self) -> bool: ...
    @property
    def avail_bytes(self) -> int: ...
    @property
    def size_bytes(self) -> int: ...


class RetentionMetrics:
    """The ``ckptd_retention_*`` series of one daemon.

    Args:
        registry: Where the counters go.
        roots: The roots configured at start; those with a policy get their counters.
    """

    def __init__(self, registry: CollectorRegistry, roots: Iterable[RootConfig]) -> None:
        self.retired = Counter(
            "ckptd_retention_retired",
            "Steps retention renamed into the trash (checkpoint.retired).",
            ["root"],
            registry=registry,
        )
        self.deleted_bytes = Counter(
            "ckptd_retention_deleted_bytes",
            "Bytes of retired checkpoints deleted (checkpoint.deleted).",
            ["root"],
            registry=registry,
        )
        self.errors = Counter(
            "ckptd_retention_errors",
            "Retention passes that failed, and steps a pass could not retire.",
            ["root"],
            registry=registry,
        )
        for root in roots:
            if root.retention is not None:
                for counter in (self.retired, self.deleted_bytes, self.errors):
                    counter.labels(root=root.path)
        self.handlers: Mapping[str, Callable[[dict[str, Any]], None]] = {
            "checkpoint.retired": lambda f: self.retired.labels(root=f["root"]).inc(),
            "checkpoint.deleted": lambda f: self.deleted_bytes.labels(root=f["root"]).inc(
                max(0, int(f.get("bytes") or 0))
            ),
            "retention.failed": lambda f: self.errors.labels(root=f["root"]).inc(),
            "retention.refused": lambda f: self.errors.labels(root=f["root"]).inc(),
        }
        """What each retention event counts (merged into the daemon's event handlers)."""

    def sample(self, roots: Iterable[RootConfig], passes: Mapping[str, Report]) -> Iterator[Metric]:
        """The gauges of every configured root that has had a pass."""
        reports = [(r, passes[r.path]) for r in roots if r.retention and r.path in passes]
        stamp = GaugeMetricFamily(
            "ckptd_retention_last_pass_timestamp_seconds",
            "Unix time the root's last retention pass ended (after a promotion, pin, start...).",
            labels=["root"],
        )
        checkpoints = GaugeMetricFamily(
            "ckptd_retention_checkpoints",
            "Complete checkpoints in the root after its last retention pass.",
            labels=["root"],
        )
        kept = GaugeMetricFamily(
            "ckptd_retention_kept",
            "Steps the last pass kept, by reason (a step kept for several counts in each).",
            labels=["root", "reason"],
        )
        prunes = GaugeMetricFamily(
            "ckptd_retention_prunes",
            "1 if this daemon retires the root's steps (on a shared root: the leader's).",
            labels=["root"],
        )
        avail = GaugeMetricFamily(
            "ckptd_root_filesystem_avail_bytes",
            "Bytes of the root's filesystem available to the daemon, at its last pass.",
            labels=["root"],
        )
        size = GaugeMetricFamily(
            "ckptd_root_filesystem_size_bytes",
            "Size of the root's filesystem, at its last retention pass.",
            labels=["root"],
        )
        for root, report in reports:
            stamp.add_metric([root.path], round(report.at, 3))
            checkpoints.add_metric([root.path], report.checkpoints)
            counts = dict.fromkeys(KEPT_REASONS, 0)
            for reason, count in report.kept.items():
                counts[kept_reason(reason, root)] += count
            for reason, count in counts.items():
                kept.add_metric([root.path, reason], count)
            prunes.add_metric([root.path], 1 if report.prunes else 0)
            avail.add_metric([root.path], report.avail_bytes)
            size.add_metric([root.path], report.size_bytes)
        yield from (stamp, checkpoints, kept, prunes, avail, size)

"""Fast tiers' Prometheus metrics, counted from their events (docs/tiers.md, "Ops").

Labels stay bounded: ``root`` is a configured root, ``result`` and ``source`` fixed
words.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = ["TierMetrics"]


class TierMetrics:
    """The counters and gauges of fast tiers, and the events that feed them."""

    def __init__(self, reg: CollectorRegistry) -> None:
        self.promotions = Counter(
            "ckptd_tier_promotions", "Steps promoted in a fast tier.", ["root"], registry=reg
        )
        self.local_step = Gauge(
            "ckptd_tier_local_step", "The newest step promoted in the fast tier.", ["root"],
            registry=reg,
        )  # fmt: skip
        self.durable_step = Gauge(
            "ckptd_tier_durable_step", "The newest step drained and committed durably.",
            ["root"], registry=reg,
        )  # fmt: skip
        self.drain_lag = Gauge(
            "ckptd_tier_drain_lag_steps",
            "Steps between the newest local step and the newest durable one.",
            ["root"],
            registry=reg,
        )
        self.drained_bytes = Counter(
            "ckptd_tier_drained_bytes", "Bytes this node copied to the durable root.", ["root"],
            registry=reg,
        )  # fmt: skip
        self.drains = Counter(
            "ckptd_tier_drains", "Drains by result (drained, failed, skipped).",
            ["root", "result"], registry=reg,
        )  # fmt: skip
        self.restores = Counter(
            "ckptd_tier_restores", "Restore decisions by source (fast, durable, none).",
            ["root", "source"], registry=reg,
        )  # fmt: skip
        self.full = Counter(
            "ckptd_tier_full", "Saves refused because the fast tier was full.", ["root"],
            registry=reg,
        )  # fmt: skip
        self._local: dict[str, int] = {}
        self._durable: dict[str, int] = {}
        self.handlers: Mapping[str, Callable[[dict[str, Any]], None]] = {
            "tier.promoted": self._promoted,
            "tier.drained": self._drained,
            "tier.drain_failed": lambda f: self.drains.labels(f["root"], "failed").inc(),
            "tier.drain_skipped": lambda f: self.drains.labels(f["root"], "skipped").inc(),
            "tier.restore": lambda f: self.restores.labels(f["root"], f["source"]).inc(),
            "tier.full": lambda f: self.full.labels(f["root"]).inc(),
        }

    def _lag(self, root: str) -> None:
        local = self._local.get(root)
        if local is not None:
            self.drain_lag.labels(root).set(max(0, local - self._durable.get(root, 0)))

    def _promoted(self, fields: dict[str, Any]) -> None:
        root = fields["root"]
        self.promotions.labels(root).inc()
        self._local[root] = max(self._local.get(root, 0), int(fields["step"]))
        self.local_step.labels(root).set(self._local[root])
        self._lag(root)

    def _drained(self, fields: dict[str, Any]) -> None:
        root = fields["root"]
        self.drains.labels(root, "drained").inc()
        self.drained_bytes.labels(root).inc(fields.get("bytes", 0))
        self._durable[root] = max(self._durable.get(root, 0), int(fields["step"]))
        self.durable_step.labels(root).set(self._durable[root])
        self._lag(root)

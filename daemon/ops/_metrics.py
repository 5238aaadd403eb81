"""Prometheus metrics: counted from the daemon's events, sampled from its state.

Counters and histograms are fed by :meth:`Metrics.observe`, which the event layer calls
with every event it emits (``Events.observer``), and by the journal's flush hook: the
request path pays one dictionary lookup per event and nothing per request. Gauges
(saves in flight, stalled roots, the last promotion) are read from the ledger and the
lanes when a scrape asks for them, on the event loop, so they are exact at scrape time
and cost nothing between scrapes.

Labels stay bounded: ``root`` is a configured root, ``reason`` a fixed class of failure
(or of why retention kept a step), ``code`` a protocol error code; never a step, rank,
path or free text. Retention's series are :mod:`daemon.ops._retention_metrics`'.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final, Protocol

import anyio
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from orchestrator import protocol as p

from ..config._config import Config
from ..ledger._ledger import Ledger
from ._retention_metrics import Report, RetentionMetrics
from ._tier_metrics import TierMetrics

__all__ = ["FAILURE_REASONS", "Metrics", "failure_reason"]

FAILURE_REASONS: Final = (
    "writer_failed",
    "lease_expired",
    "timeout",
    "verification",
    "promotion",
    "journal",
    "internal",
    "other",
)
"""The values of ``ckptd_failures_total``'s ``reason`` label."""

_PREFIXES: Final = (
    ("verification failed", "verification"),
    ("promotion failed", "promotion"),
    ("promotion not started", "journal"),
    ("timed out after", "timeout"),
    ("internal error", "internal"),
)

_SNAPSHOT_WAIT: Final = 5.0
"""Seconds a scrape waits for the event loop to sample the gauges."""

_PROMOTION_BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_SAVE_BUCKETS: Final = (1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)
_FLUSH_BUCKETS: Final = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
)


def failure_reason(reason: str) -> str:
    """The bounded class (one of :data:`FAILURE_REASONS`) of a ``checkpoint.failed`` reason."""
    if reason.startswith("rank "):
        return "lease_expired" if " disconnected " in reason else "writer_failed"
    for prefix, name in _PREFIXES:
        if reason.startswith(prefix):
            return name
    return "other"


class _Stalls(Protocol):
    def stalled(self, root: str | None = None) -> list[p.StallInfo]: ...


class _Journal(Protocol):
    @property
    def size(self) -> int: ...


class Observed(Protocol):
    """What the gauges are read from (``daemon.server._server.Daemon``)."""

    @property
    def config(self) -> Config: ...

    @property
    def ledger(self) -> Ledger: ...

    @property
    def lanes(self) -> _Stalls: ...

    @property
    def journal(self) -> _Journal | None: ...

    @property
    def waits(self) -> int: ...

    @property
    def retiring(self) -> Mapping[str, object]:
        """Roots a reload removed whose saves in flight still run."""
        ...

    @property
    def retention(self) -> _Passes: ...


class _Passes(Protocol):
    @property
    def passes(self) -> Mapping[str, Report]: ...


class Metrics(Collector):
    """The metrics of one daemon, in a registry of their own.

    Args:
        daemon: Where the gauges are read from.
        version: The daemon's version, for ``ckptd_build_info``.
        clock: The daemon's monotonic clock (the ledger's times are on it).
    """

    def __init__(
        self, daemon: Observed, *, version: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._daemon = daemon
        self._clock = clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._last: list[Metric] = []
        disable_created_metrics()  # type: ignore[no-untyped-call]  # *_created: noise
        self.registry = CollectorRegistry(auto_describe=True)
        """Every ckptd metric, plus the process, platform and GC collectors'."""
        reg = self.registry
        self.changed = anyio.Event()
        """Set when an event changed a counter (the textfile writer waits on it)."""
        self.connections = 0
        self.promotions = Counter(
            "ckptd_promotions", "Steps promoted to checkpoints.", ["root"], registry=reg
        )
        self.failures = Counter(
            "ckptd_failures",
            "Saves that failed and were not promoted, by class of reason.",
            ["root", "reason"],
            registry=reg,
        )
        self.promoted_bytes = Counter(
            "ckptd_promoted_bytes", "Bytes of the checkpoints promoted.", ["root"], registry=reg
        )
        for root in daemon.config.roots:
            # A series from the start, at 0: an alert on no promotion for an hour
            # (CkptdSavesStuck) then fires for a root that never promoted at all.
            self.promotions.labels(root=root.path)
            self.promoted_bytes.labels(root=root.path)
        self.promotion_duration = Histogram(
            "ckptd_promotion_duration_seconds",
            "Time to verify, fsync, rename and move the pointer of one checkpoint.",
            ["root"],
            buckets=_PROMOTION_BUCKETS,
            registry=reg,
        )
        self.save_duration = Histogram(
            "ckptd_save_duration_seconds",
            "Time from a step's first begin to its promotion.",
            ["root"],
            buckets=_SAVE_BUCKETS,
            registry=reg,
        )
        self.flush_duration = Histogram(
            "ckptd_journal_flush_duration_seconds",
            "Time one journal batch took to write and fsync.",
            buckets=_FLUSH_BUCKETS,
            registry=reg,
        )
        self.journal_errors = Counter(
            "ckptd_journal_errors", "Journal writes that failed (journal.failed).", registry=reg
        )
        self.connections_total = Counter(
            "ckptd_connections", "Client connections accepted.", registry=reg
        )
        self.refused = Counter(
            "ckptd_connections_refused",
            "Connections refused: peer not allowed (client.refused).",
            registry=reg,
        )
        self.dropped = Counter(
            "ckptd_clients_dropped", "Clients dropped (client.dropped).", registry=reg
        )
        self.rejected = Counter(
            "ckptd_requests_rejected", "Requests refused, by error code.", ["code"], registry=reg
        )
        self.stalls = Counter(
            "ckptd_root_stalls", "Times a root was reported stalled.", ["root"], registry=reg
        )
        self.trash_failures = Counter(
            "ckptd_trash_failures",
            "Trash entries that could not be deleted.",
            ["root"],
            registry=reg,
        )
        self.pointer_failures = Counter(
            "ckptd_pointer_failures", "Pointer updates that failed.", ["root"], registry=reg
        )
        self.reloads = Counter(
            "ckptd_config_reloads",
            "Configuration reloads (SIGHUP), by result.",
            ["result"],
            registry=reg,
        )
        self.reload_ok = Gauge(
            "ckptd_config_last_reload_successful",
            "Whether the last configuration reload succeeded (1 before any reload).",
            registry=reg,
        )
        self.reload_ok.set(1)
        self.reload_at = Gauge(
            "ckptd_config_last_reload_success_timestamp_seconds",
            "When the configuration was last loaded successfully (start or reload).",
            registry=reg,
        )
        self.reload_at.set(time.time())
        info = Gauge(
            "ckptd_build_info", "The daemon's version; always 1.", ["version"], registry=reg
        )
        info.labels(version=version).set(1)
        self.retention = RetentionMetrics(reg, daemon.config.roots)
        self.tiers = TierMetrics(reg)
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        GCCollector(registry=reg)
        reg.register(self)
        self._handlers: Mapping[str, Callable[[dict[str, Any]], None]] = {
            "checkpoint.promoted": self._promoted,
            "checkpoint.failed": self._failed,
            "client.connected": self._connected,
            "client.disconnected": self._disconnected,
            "client.refused": lambda _f: self.refused.inc(),
            "client.dropped": lambda _f: self.dropped.inc(),
            "request.rejected": lambda f: self.rejected.labels(code=str(f.get("code"))).inc(),
            "journal.failed": lambda _f: self.journal_errors.inc(),
            "root.stalled": lambda f: self.stalls.labels(root=f["root"]).inc(),
            "trash.failed": lambda f: self.trash_failures.labels(root=f["root"]).inc(),
            "pointer.failed": lambda f: self.pointer_failures.labels(root=f["root"]).inc(),
            "config.reloaded": self._reloaded,
            "config.reload_failed": self._reload_failed,
            **self.retention.handlers,
            **self.tiers.handlers,
        }

    def bind_loop(self) -> None:
        """Sample gauges on the running event loop (call from it, before serving)."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()

    # -- counters, from events ----------------------------------------------------------

    def observe(self, name: str, fields: dict[str, Any]) -> None:
        """Count event ``name`` (``Events.observer``); events without a metric cost a lookup."""
        handler = self._handlers.get(name)
        if handler is not None:
            handler(fields)
            self.changed.set()

    def flushed(self, seconds: float) -> None:
        """One journal batch took ``seconds`` (``Journal.on_flush``)."""
        self.flush_duration.observe(seconds)

    def _promoted(self, fields: dict[str, Any]) -> None:
        root = fields["root"]
        self.promotions.labels(root=root).inc()
        self.promoted_bytes.labels(root=root).inc(fields.get("bytes", 0))
        if "promotion_ms" in fields:
            self.promotion_duration.labels(root=root).observe(fields["promotion_ms"] / 1000)
        if "duration_s" in fields:
            self.save_duration.labels(root=root).observe(fields["duration_s"])

    def _failed(self, fields: dict[str, Any]) -> None:
        reason = failure_reason(str(fields.get("reason", "")))
        self.failures.labels(root=fields["root"], reason=reason).inc()

    def _connected(self, _fields: dict[str, Any]) -> None:
        self.connections += 1
        self.connections_total.inc()

    def _disconnected(self, _fields: dict[str, Any]) -> None:
        self.connections -= 1

    def _reloaded(self, _fields: dict[str, Any]) -> None:
        self.reloads.labels(result="success").inc()
        self.reload_ok.set(1)
        self.reload_at.set(time.time())

    def _reload_failed(self, _fields: dict[str, Any]) -> None:
        self.reloads.labels(result="failure").inc()
        self.reload_ok.set(0)

    # -- gauges, sampled at scrape time -------------------------------------------------

    def collect(self) -> Iterable[Metric]:
        """The gauges read from the daemon's state (``Collector`` protocol)."""
        loop = self._loop
        if loop is None or threading.get_ident() == self._loop_thread:
            self._last = list(self._sample())
            return self._last
        done = threading.Event()
        result: list[list[Metric]] = []

        def sample() -> None:
            result.append(list(self._sample()))
            done.set()

        try:
            loop.call_soon_threadsafe(sample)
        except RuntimeError:  # the loop is closed: the daemon is gone
            return self._last
        # A blocked event loop does not answer: the scrape gets the last sample.
        if done.wait(_SNAPSHOT_WAIT) and result:
            self._last = result[0]
        return self._last

    def describe(self) -> Iterable[Metric]:
        """Nothing: the sampled gauges' label values are known only at scrape time."""
        return []

    def _sample(self) -> Iterator[Metric]:
        daemon = self._daemon
        roots = [r.path for r in daemon.config.roots]
        # A removed root's saves in flight still count until they settle (root.retired).
        in_flight = dict.fromkeys([*roots, *daemon.retiring], 0)
        last: dict[str, float] = {}
        for save in daemon.ledger:
            root = save.key.root
            if root not in in_flight:
                continue
            if save.state is p.SaveState.PROMOTED and save.settled_at is not None:
                last[root] = max(last.get(root, 0.0), save.settled_at)
            elif save.state is not p.SaveState.FAILED:
                in_flight[root] += 1
        flight = GaugeMetricFamily(
            "ckptd_saves_in_flight", "Saves begun and not yet settled.", labels=["root"]
        )
        for root, count in in_flight.items():
            flight.add_metric([root], count)
        yield flight
        stamp = GaugeMetricFamily(
            "ckptd_last_promotion_timestamp_seconds",
            "Unix time of the root's newest promotion this daemon knows (journal included).",
            labels=["root"],
        )
        offset = time.time() - self._clock()
        for root, when in last.items():
            stamp.add_metric([root], round(when + offset, 3))
        yield stamp
        stalled = {s.root: s.blocked_s for s in daemon.lanes.stalled()}
        gauge = GaugeMetricFamily(
            "ckptd_root_stalled",
            "1 while a filesystem call for the root has run past fs_stall_after.",
            labels=["root"],
        )
        for root in roots:
            gauge.add_metric([root], 1 if root in stalled else 0)
        yield gauge
        yield GaugeMetricFamily(
            "ckptd_journal_stalled",
            "1 while a journal write or fsync has run past fs_stall_after.",
            value=1 if None in stalled else 0,
        )
        journal = daemon.journal
        if journal is not None:
            yield GaugeMetricFamily(
                "ckptd_journal_bytes", "Size of the journal file.", value=journal.size
            )
        yield GaugeMetricFamily(
            "ckptd_connections_open", "Client connections open now.", value=self.connections
        )
        yield GaugeMetricFamily("ckptd_waits", "wait requests pending now.", value=daemon.waits)
        yield GaugeMetricFamily("ckptd_roots", "Checkpoint roots configured.", value=len(roots))
        yield from self.retention.sample(daemon.config.roots, daemon.retention.passes)

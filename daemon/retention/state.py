"""What retention knows beyond the disk: metrics, pins and holds. Pure: no I/O, no clock.

Every change queues a journal record (:meth:`RetentionState.drain_records`), written
with the ledger's in the same commit; :meth:`RetentionState.replay` applies those
records after a restart, and :meth:`RetentionState.snapshot` gives the records that
rebuild the state when the journal is compacted. Times are wall-clock seconds, passed
in, so a hold outlives a restart of the daemon.

Metrics a step's ranks report in their ``done`` belong to that attempt: they become the
step's only once that attempt's checkpoint is found promoted (its manifest names the
attempt), so a failed attempt's numbers never judge the attempt that replaced it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Iterable, Mapping

from orchestrator.protocol import ErrorCode

from ..base._errors import RequestError
from ..config._retention import MAX_METRICS
from ..ledger._records import JHold, JMetrics, JournalRecord, JPin, JRetired
from ..ledger._saves import SaveKey
from ..store._facts import StepRetention

__all__ = ["MAX_METRICS", "RetentionState", "RetentionRecord", "checked_metrics"]

RetentionRecord = JMetrics | JPin | JHold | JRetired
"""The journal records this state reads and writes."""


def checked_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """``metrics`` as finite floats.

    Raises:
        RequestError: (``invalid_field``) a value is not a finite number.
    """
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RequestError(ErrorCode.INVALID_FIELD, f"metric {name!r} is not a number")
        if not math.isfinite(value):
            raise RequestError(ErrorCode.INVALID_FIELD, f"metric {name!r} is not finite")
        out[name] = float(value)
    return out


class RetentionState:
    """Metrics, pins and holds of every configured root's steps."""

    def __init__(self) -> None:
        self._metrics: dict[SaveKey, dict[str, float]] = {}
        self._pending: dict[SaveKey, tuple[str, dict[str, float]]] = {}
        self._pins: set[SaveKey] = set()
        self._holds: dict[SaveKey, float] = {}
        self._outbox: list[JournalRecord] = []
        self._facts_seen: dict[SaveKey, int] = {}  # the newest facts written or taken

    # -- queries -----------------------------------------------------------------------

    def metrics(self, key: SaveKey) -> dict[str, float]:
        """The promoted checkpoint's metrics (empty if none are known)."""
        return dict(self._metrics.get(key, {}))

    def has_metrics(self, key: SaveKey) -> bool:
        """Whether any metric of the promoted checkpoint is known."""
        return key in self._metrics

    def pending(self, key: SaveKey) -> tuple[str, dict[str, float]] | None:
        """Metrics an attempt reported in its ``done``s, not yet the step's: (attempt, them)."""
        found = self._pending.get(key)
        return None if found is None else (found[0], dict(found[1]))

    def pinned(self, key: SaveKey) -> bool:
        """Whether the step is pinned."""
        return key in self._pins

    def held_until(self, key: SaveKey, now: float) -> float | None:
        """Until when the step is held, if it is held at ``now``."""
        until = self._holds.get(key)
        return until if until is not None and until > now else None

    def next_expiry(self, root: str, now: float) -> float | None:
        """The earliest hold of ``root`` that ends after ``now``."""
        ends = [u for k, u in self._holds.items() if k.root == root and u > now]
        return min(ends) if ends else None

    # -- changes -----------------------------------------------------------------------

    def reported(self, key: SaveKey, attempt: str, metrics: Mapping[str, float]) -> None:
        """A rank's ``done`` of attempt ``attempt`` carried ``metrics``.

        Check them first (:func:`checked_metrics`): this never refuses, so the ``done``
        it came with stands. Names beyond :data:`MAX_METRICS` for the step are left out.

        Raises:
            RequestError: a value is not finite (nothing was changed).
        """
        held = self._pending.get(key)
        merged = dict(held[1]) if held is not None and held[0] == attempt else {}
        values: dict[str, float] = {}
        for name, value in checked_metrics(metrics).items():
            if name in merged or len(merged) < MAX_METRICS:
                merged[name] = values[name] = value
        if not values:
            return
        self._pending[key] = (attempt, merged)
        self._record(JMetrics(key.root, key.step, values, attempt))

    def adopt(self, key: SaveKey, attempt: str, found: Mapping[str, float]) -> dict[str, float]:
        """The step is promoted as ``attempt``: give it its metrics.

        ``found`` (from its files), overridden by what that attempt's ranks reported;
        neither overrides a value already acknowledged for the step (a ``score`` that
        came between the promotion and this adoption: the evaluation job's word is the
        newer). Returns what was added.
        """
        added = checked_metrics(found)
        held = self._pending.pop(key, None)
        if held is not None and held[0] == attempt:
            added.update(held[1])
        known = self._metrics.get(key, {})
        added = {name: value for name, value in added.items() if name not in known}
        if added or held is not None:
            self._merge(key, added)
            self._record(JMetrics(key.root, key.step, added, adopted=True))
        return added

    def scored(self, key: SaveKey, metrics: Mapping[str, float]) -> dict[str, float]:
        """The step's metrics once :meth:`score` took ``metrics``; changes nothing.

        Raises:
            RequestError: as :meth:`score` would.
        """
        merged = {**self._metrics.get(key, {}), **checked_metrics(metrics)}
        _bounded(merged)
        return merged

    def score(self, key: SaveKey, metrics: Mapping[str, float]) -> None:
        """An evaluation job scored the promoted step (``ckptd score``).

        Raises:
            RequestError: a value is not finite, or the step would hold too many.
        """
        values = checked_metrics(metrics)
        merged = {**self._metrics.get(key, {}), **values}
        _bounded(merged)
        self._merge(key, values)
        self._record(JMetrics(key.root, key.step, values))

    def pin(self, key: SaveKey, pinned: bool) -> bool:
        """Pin or unpin the step; returns whether that changed anything."""
        if (key in self._pins) == pinned:
            return False
        if pinned:
            self._pins.add(key)
        else:
            self._pins.discard(key)
        self._record(JPin(key.root, key.step, pinned))
        return True

    def hold(self, key: SaveKey, until: float, now: float) -> None:
        """A reader holds the step until ``until`` (``until <= now`` releases it)."""
        if until > now:
            self._holds[key] = until
        else:
            self._holds.pop(key, None)
        self._record(JHold(key.root, key.step, until))

    def facts(self, key: SaveKey, attempt: str, now: float) -> StepRetention:
        """What the root is to record of ``key`` (promoted as ``attempt``), stamped now."""
        written = max(time.time_ns(), self._facts_seen.get(key, 0) + 1)
        self._facts_seen[key] = written
        return StepRetention(
            step=key.step,
            attempt=attempt,
            pinned=key in self._pins,
            held_until=self.held_until(key, now) or 0.0,
            metrics=self.metrics(key),
            written=written,
        )

    def absorb(self, key: SaveKey, facts: StepRetention, attempt: str | None, now: float) -> bool:
        """Take what the root records of ``key``, if newer than this state knows; whether any.

        The root's facts were written before each change was acknowledged, so a state
        that lost its journal regains every pin, hold and metric from them, and one that
        did not learns the changes another node's daemon made. Facts taken or written
        here before are not taken again (a read that raced a change here is stale). The
        pin is the facts'; a later hold and metrics not yet known are added; a hold and
        metrics count only for the attempt they were of (``attempt``: on disk now).
        """
        if facts.written <= self._facts_seen.get(key, -1):
            return False
        self._facts_seen[key] = facts.written
        changed = self.pin(key, facts.pinned)
        if attempt is None or facts.attempt != attempt:
            return changed
        if facts.held_until > max(now, self._holds.get(key, 0.0)):
            self.hold(key, facts.held_until, now)
            changed = True
        known = self._metrics.get(key, {})
        missing = {n: v for n, v in facts.metrics.items() if n not in known}
        if missing and len(known) + len(missing) <= MAX_METRICS:
            try:
                missing = checked_metrics(missing)
            except RequestError:
                return changed  # edited by hand into something no request could send
            self._merge(key, missing)
            self._record(JMetrics(key.root, key.step, missing))
            changed = True
        return changed

    def retired(self, key: SaveKey, entry: str, rule: str) -> None:
        """The step was moved into the trash as ``entry``: forget what was known of it."""
        self._drop(key)
        self._facts_seen.pop(key, None)
        self._record(JRetired(key.root, key.step, entry, rule))

    def prune(self, root: str, present: Collection[int], now: float) -> None:
        """Forget metrics and expired holds of ``root``'s steps that are no longer on disk.

        Pins stay (a pinned step removed by hand and saved again is pinned again);
        pending metrics stay (their step may be in flight). Not journaled: a snapshot
        leaves them out, a replay finds them pruned again.
        """
        for key in [k for k in self._metrics if k.root == root and k.step not in present]:
            del self._metrics[key]
        for key in [k for k, u in self._holds.items() if k.root == root and u <= now]:
            del self._holds[key]

    # -- journal -----------------------------------------------------------------------

    def drain_records(self) -> list[JournalRecord]:
        """Records of every change since the last call, oldest first."""
        records, self._outbox = self._outbox, []
        return records

    def replay(self, record: JournalRecord) -> bool:
        """Apply a journaled record; False if it is none of retention's."""
        key = SaveKey(record.root, record.step)
        match record:
            case JMetrics(metrics=metrics, attempt=attempt, adopted=adopted):
                if adopted:
                    self._pending.pop(key, None)
                if attempt:
                    held = self._pending.get(key)
                    merged = dict(held[1]) if held is not None and held[0] == attempt else {}
                    self._pending[key] = (attempt, {**merged, **metrics})
                else:
                    self._merge(key, metrics)
            case JPin(pinned=pinned):
                if pinned:
                    self._pins.add(key)
                else:
                    self._pins.discard(key)
            case JHold(until=until):
                self._holds[key] = until
            case JRetired():
                self._drop(key)
            case _:
                return False
        return True

    def snapshot(self, live: Iterable[tuple[SaveKey, str]], now: float) -> list[JournalRecord]:
        """Records rebuilding the state; ``live``: the (step, attempt)s still in flight."""
        out: list[JournalRecord] = []
        for key, metrics in sorted(self._metrics.items()):
            out.append(JMetrics(key.root, key.step, dict(metrics)))
        flying = set(live)
        for key, (attempt, metrics) in sorted(self._pending.items()):
            if (key, attempt) in flying:
                out.append(JMetrics(key.root, key.step, dict(metrics), attempt))
        out += [JPin(k.root, k.step, True) for k in sorted(self._pins)]
        out += [JHold(k.root, k.step, u) for k, u in sorted(self._holds.items()) if u > now]
        return out

    # -- internals ---------------------------------------------------------------------

    def _merge(self, key: SaveKey, metrics: Mapping[str, float]) -> None:
        if metrics:
            self._metrics.setdefault(key, {}).update(metrics)

    def _drop(self, key: SaveKey) -> None:
        self._metrics.pop(key, None)
        self._pending.pop(key, None)
        self._holds.pop(key, None)

    def _record(self, record: JournalRecord) -> None:
        self._outbox.append(record)


def _bounded(metrics: Mapping[str, float]) -> None:
    if len(metrics) > MAX_METRICS:
        raise RequestError(
            ErrorCode.INVALID_FIELD,
            f"a step may hold at most {MAX_METRICS} metrics; {len(metrics)} given",
        )

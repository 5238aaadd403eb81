"""Retention's facts on the root: what a daemon with an empty state directory starts from.

A mixin of :class:`daemon.retention.applier.Retention`. Each step's pin, hold and
metrics are written on the root (``daemon.store._facts``) under the root's facts lock,
taken back before a pass judges anything, and the name of the ``best`` pointer is
recorded, so that one an earlier policy wrote is removed rather than left behind.
"""

from __future__ import annotations

import time

import anyio

from ..config._config import RootConfig
from ..host._host import Host
from ..ledger._saves import SaveKey
from ..store._steps import Found
from .state import RetentionState

__all__ = ["RootFacts"]


class RootFacts:
    """Facts on the root for :class:`~daemon.retention.applier.Retention` (a mixin)."""

    _daemon: Host
    state: RetentionState
    _facts_locks: dict[str, anyio.Lock]

    def facts_lock(self, root: RootConfig) -> anyio.Lock:
        """Held while a step's facts of ``root`` are taken from the state and written."""
        return self._facts_locks.setdefault(root.path, anyio.Lock())

    async def _absorb(self, root: RootConfig, found: list[Found]) -> None:
        """Take what the root records of its steps' pins, holds and metrics, when newer.

        What a daemon started on an empty state directory knows of the root's steps
        comes from there (``daemon.store._facts``), before anything is judged; a running
        one learns there what another node's daemon was told
        (:meth:`~daemon.retention.state.RetentionState.absorb`).
        """
        daemon = self._daemon
        facts = await daemon.lanes.run(root.path, daemon.storage.read_facts, root)
        on_disk = {f.step: f.attempt for f in found if f.complete}
        now = time.time()
        changed = False
        for step, fact in facts.items():
            key = SaveKey(root.path, step)
            changed = self.state.absorb(key, fact, on_disk.get(step), now) or changed
        if changed:
            await daemon.commit([])

    async def _write_facts(self, root: RootConfig, key: SaveKey, attempt: str) -> None:
        """Record a step's facts on the root after they changed here (best effort)."""
        daemon = self._daemon
        try:
            async with self.facts_lock(root):
                facts = self.state.facts(key, attempt, time.time())
                await daemon.lanes.run(root.path, daemon.storage.write_facts, root, facts)
        except OSError as exc:
            daemon.events.emit(
                "retention.facts_failed", "warning", root=root.path, step=key.step,
                error=exc.strerror or str(exc),
            )  # fmt: skip

    async def _stale_best(self, root: RootConfig) -> None:
        """Remove a ``best`` pointer of an earlier policy (renamed, or ``keep_best`` dropped).

        The root records the name of the ``best`` pointer the daemon writes; one the
        policy no longer names would otherwise dangle, or keep naming a step forever.
        """
        config = root.retention
        assert config is not None
        daemon, lanes, storage = self._daemon, self._daemon.lanes, self._daemon.storage
        current = config.best_pointer if config.policy.keep_best is not None else None
        recorded = await lanes.run(root.path, storage.read_best_name, root)
        if recorded == current:
            return
        if recorded is not None and recorded not in (current, root.pointer):
            if await lanes.run(root.path, storage.remove_pointer, root, recorded):
                daemon.events.emit(
                    "pointer.removed", root=root.path, pointer=recorded,
                    reason="the policy no longer names it",
                )  # fmt: skip
        await lanes.run(root.path, storage.write_best_name, root, current)

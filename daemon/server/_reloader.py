"""SIGHUP: reload the configuration file and apply what changed, or keep the old one.

The file is read and validated in a worker thread (``load_config`` looks at each root,
which on a hung filesystem can block), compared with the running configuration
(:func:`daemon.ops._reload.plan_reload`), and applied on the event loop without an
``await`` between the checks and the switch, so no request sees half of it:

- a root added gets its lock, its lane, its trash remover, its layout file and the scan
  recovery gives every root (orphans, failed attempts to set aside);
- a root removed takes no new saves (``root_not_configured``), but saves in flight there
  go on to their end: done, fail, wait, promotion and timeouts work as before; once the
  last one settles the root is retired (``root.retired``);
- a root whose options changed runs with the new ones (its layout file is rewritten
  when a directory name changed, which is refused while saves are in flight there);
- allow lists, log level and the other fields in :data:`daemon.ops._reload.LIVE` apply at
  once; fields that need a restart keep their old value and are named in the event.

A file that does not load keeps the old configuration (``config.reload_failed``). The
service manager hears ``RELOADING=1`` before and ``READY=1`` after, whatever the outcome.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Final, Protocol

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup

from orchestrator import protocol as p

from ..base._errors import ConfigError
from ..base._events import set_log_level
from ..config._config import Config, RootConfig
from ..host._host import Recovering
from ..ops._reload import ReloadPlan, plan_reload, refusal, summary
from . import _systemd
from ._recovery import scan_roots

__all__ = ["LOAD_WAIT", "Reloader"]

LOAD_WAIT: Final = 60.0
"""Seconds a reload waits for the file to load (each root is looked at) before giving up."""

_SETTLED: Final = (p.SaveState.PROMOTED, p.SaveState.FAILED)
_SETTLE_EVENTS: Final = ("checkpoint.promoted", "checkpoint.failed")


class _AddsRoots(Protocol):
    def add(self, root: RootConfig) -> None: ...

    def pause(self, root: RootConfig) -> AbstractContextManager[None]: ...


class Reloadable(Recovering, Protocol):
    """What a reload changes in the daemon (``daemon.server._server.Daemon``)."""

    config: Config  # read-only to the daemon's parts; a reload sets it
    retiring: dict[str, RootConfig]
    root_locks: dict[str, anyio.Lock]

    @property
    def trash(self) -> _AddsRoots: ...


class Reloader:
    """Reloads one daemon's configuration; one reload at a time.

    Args:
        daemon: The running daemon (``daemon.server._server.Daemon``).
        load: Loads and validates the configuration afresh (the file and the flags the
            daemon was started with); None: there is nothing to reload from.
        group: Where a retiring root's watch runs.
    """

    def __init__(
        self, daemon: Reloadable, load: Callable[[], Config] | None, group: TaskGroup
    ) -> None:
        self._daemon = daemon
        self._load = load
        self._group = group
        self._lock = anyio.Lock()
        self.ready = anyio.Event()
        """Set once the daemon serves: a reload asked for earlier waits for it."""
        self.reloads = 0
        """Reloads finished (applied or refused)."""

    def request(self) -> None:
        """Reload in the background (from the signal watch)."""
        self._group.start_soon(self.reload)

    async def reload(self) -> bool:
        """Reload now; returns whether the new configuration was applied."""
        await self.ready.wait()
        async with self._lock:
            _systemd.notify_reloading()
            try:
                return await self._reload()
            finally:
                self.reloads += 1
                _systemd.notify_ready("serving")

    async def _reload(self) -> bool:
        daemon = self._daemon
        daemon.events.emit("config.reloading")
        if self._load is None:
            return self._failed("no configuration file to reload from (started without one)")
        try:
            with anyio.fail_after(LOAD_WAIT):
                new = await anyio.to_thread.run_sync(self._load, abandon_on_cancel=True)
        except ConfigError as exc:
            return self._failed(str(exc))
        except TimeoutError:
            return self._failed(f"loading the configuration took over {LOAD_WAIT:g}s")
        plan = plan_reload(daemon.config, new)
        problem = refusal(plan, self._in_flight())
        if problem is not None:
            return self._failed(problem)
        if plan.empty:
            daemon.events.emit("config.reloaded", **summary(plan), unscanned=[])
            return True
        self._apply(plan)
        unscanned: list[str] = []
        if plan.added:  # each one's layout file too; a hung root is scanned on later
            unscanned = (await scan_roots(daemon, plan.added))[2]
        for change in plan.changed:
            if change.layout:
                await self._rewrite_layout(change.new)
        daemon.events.emit("config.reloaded", **summary(plan), unscanned=unscanned)
        # Last, so that the event above is logged at the level it was asked at.
        if "log_level" in plan.live and set_log_level(plan.config.log_level):
            daemon.events.relog()
        return True

    def _failed(self, error: str) -> bool:
        self._daemon.events.emit("config.reload_failed", "error", error=error)
        return False

    def _in_flight(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for save in self._daemon.ledger:
            if save.state not in _SETTLED:
                counts[save.key.root] = counts.get(save.key.root, 0) + 1
        return counts

    def _apply(self, plan: ReloadPlan) -> None:
        """Switch to ``plan.config``: no ``await`` here, so no request sees half of it."""
        daemon = self._daemon
        for root in plan.added:
            daemon.root_locks.setdefault(root.path, anyio.Lock())
            daemon.lanes.add(root.path)
            daemon.trash.add(root)
            daemon.retiring.pop(root.path, None)
        for change in plan.changed:
            daemon.trash.add(change.new)
        in_flight = self._in_flight()
        for root in plan.removed:
            if in_flight.get(root.path):
                daemon.retiring[root.path] = root
                self._group.start_soon(self._retire, root)
        daemon.config = plan.config
        daemon.retention.reconfigured()  # new and changed policies apply at once

    async def _retire(self, root: RootConfig) -> None:
        """Forget ``root`` once its last save in flight has settled."""
        daemon = self._daemon
        while daemon.retiring.get(root.path) is root and self._in_flight().get(root.path):
            # Subscribed right after the check, with no await between: no settle is missed.
            # A subscription cut off for falling behind ends the loop below; look again.
            events = daemon.events.subscribe()
            try:
                async for event in events:
                    if (
                        event["event"] in _SETTLE_EVENTS
                        and event.get("root") == root.path
                        and not self._in_flight().get(root.path)
                    ) or daemon.retiring.get(root.path) is not root:
                        break
            finally:
                daemon.events.unsubscribe(events)
        if daemon.retiring.get(root.path) is root:
            del daemon.retiring[root.path]
            daemon.events.emit("root.retired", root=root.path)

    async def _rewrite_layout(self, root: RootConfig) -> None:
        daemon = self._daemon
        try:
            await daemon.lanes.run(root.path, daemon.storage.write_layout, root)
        except OSError as exc:
            error = exc.strerror or str(exc)
            daemon.events.emit("root.layout_failed", "warning", root=root.path, error=error)

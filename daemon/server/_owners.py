"""Giving each attempt its own ``tmp_step_N``: before a writer is admitted, and after a failure.

:class:`AttemptDirs` carries out the directory side of attempts for the daemon, under
each root's lock and off the event loop:

- before the first ``begin`` of an attempt is acknowledged, ``tmp_step_N`` is made the
  attempt's (:func:`daemon.store._attempts.prepare`); every other ``begin`` of the attempt
  waits for that, so no rank writes before the directory is its attempt's;
- when an attempt fails, its directory is moved into the trash
  (:func:`daemon.store._attempts.set_aside`), journaled, and only then is the failure
  reported (its event, woken waiters).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

import anyio
from anyio.abc import TaskGroup

from orchestrator import protocol as p

from ..base._errors import RequestError
from ..config._config import RootConfig
from ..host._holds import Holds
from ..host._host import Host
from ..ledger._ledger import SaveKey, SaveRecord, SetAside
from ..store._attempts import Prepared, StagedMarker

__all__ = ["AttemptDirs"]


class AttemptDirs:
    """The directory side of attempts, for one daemon.

    Args:
        daemon: Whose ledger, journal, locks and events to use.
        run: Runs a blocking call on behalf of a root off the event loop
            (``await run(root, fn, *args)``).
    """

    def __init__(
        self,
        daemon: Host,
        *,
        run: Callable[..., Awaitable[object]],
    ) -> None:
        self._daemon = daemon
        self._run = run
        self.group: TaskGroup | None = None
        """Where set-asides run; set by ``serve`` before any request is handled."""
        self._ready: dict[tuple[SaveKey, str], anyio.Event] = {}
        self._failed: dict[tuple[SaveKey, str], str] = {}
        self._pending: Holds[SaveKey] = Holds()  # set-asides under way, per save

    def reporting(self, key: SaveKey) -> bool:
        """Whether ``key``'s failure is still being set aside, so not yet reported."""
        return key in self._pending

    async def ready(self, root: RootConfig, save: SaveRecord) -> None:
        """Return once ``tmp_step_N`` is ``save``'s attempt's directory.

        The first caller for an attempt prepares it; the others wait for that.

        Raises:
            RequestError: the directory could not be prepared; the save has failed.
        """
        token = (save.key, save.attempt)
        event = self._ready.get(token)
        if event is None:
            event = self._ready[token] = anyio.Event()
            try:
                await self._prepare(root, save)
            except BaseException:
                del self._ready[token]
                event.set()
                raise
            event.set()
        else:
            await event.wait()
            if token not in self._ready:
                why = self._failed.get(token, "its directory could not be prepared")
                raise RequestError(p.ErrorCode.STEP_FAILED, f"step {save.key.step}: {why}")

    def forget(self, key: SaveKey) -> None:
        """The save settled: nothing of its attempts needs remembering here."""
        for token in [t for t in self._ready if t[0] == key]:
            del self._ready[token]
        for token in [t for t in self._failed if t[0] == key]:
            del self._failed[token]

    async def _prepare(self, root: RootConfig, save: SaveRecord) -> None:
        daemon, key = self._daemon, save.key
        args = (root, key.step, save.attempt, save.world_size, save.run)
        try:
            with anyio.CancelScope(shield=True):
                # The marker's own flush before the lock: concurrent new attempts' overlap,
                # and under the lock it only gets its name.
                staged = await self._run(root, daemon.storage.stage_attempt, *args)
                assert staged is None or isinstance(staged, StagedMarker)
                try:
                    async with daemon.root_locks[root.path]:
                        prepare = partial(daemon.storage.prepare, sync=False, staged=staged)
                        done = await self._run(root, prepare, *args)
                finally:
                    if staged is not None:
                        await self._run(root, staged.close)
                assert isinstance(done, Prepared)
                # The root's flush, outside its lock: new attempts beginning together
                # share one (the begin is still acknowledged only once it is durable).
                if done.unsynced:
                    await self._run(root, daemon.storage.flush_dirs, done.unsynced)
        except OSError as exc:
            reason = f"could not prepare {root.tmp_dir(key.step)}: {exc.strerror or exc}"
            self._failed[(key, save.attempt)] = reason
            await daemon.commit(daemon.ledger.rejected(key, reason, daemon.clock()))
            raise RequestError(p.ErrorCode.STEP_FAILED, f"step {key.step}: {reason}") from None
        assert isinstance(done, Prepared)
        if done.moved is not None:
            daemon.events.emit(
                "save.set_aside",
                "warning",
                root=key.root,
                step=key.step,
                attempt=done.foreign,
                path=done.moved,
                reason="another attempt's directory was in the way",
                by_attempt=save.attempt,
            )

    def start_set_aside(self, effect: SetAside) -> None:
        """Move the failed attempt's directory aside, then report the failure."""
        if self.group is None:  # not serving yet (recovery sets aside on its own)
            self._daemon.apply(effect.then)
            return
        self._pending.hold(effect.key)
        self.group.start_soon(self._set_aside, effect)

    @property
    def busy(self) -> bool:
        """Whether a set-aside is under way."""
        return bool(self._pending)

    async def idle(self) -> None:
        """Return once no set-aside is under way (each journals where it moved the files)."""
        await self._pending.idle()

    async def _set_aside(self, effect: SetAside) -> None:
        daemon, key = self._daemon, effect.key
        try:
            with anyio.CancelScope(shield=True):
                await self.set_aside(key, effect.attempt)
        finally:
            self._pending.release(key)
            daemon.apply(effect.then)

    async def set_aside(self, key: SaveKey, attempt: str) -> str | None:
        """Move failed attempt ``attempt``'s directory into the trash and journal where.

        A failure to move it is reported (``save.set_aside_failed``); the files then stay
        where they are, and the next attempt's ``begin`` sets them aside by their marker.

        Returns:
            Where the directory went, if it was moved.
        """
        daemon = self._daemon
        root = daemon.configured(key.root)
        try:
            async with daemon.root_locks[root.path]:
                set_aside = partial(daemon.storage.set_aside, sync=False)
                moved = await self._run(root, set_aside, root, key.step, attempt)
            if isinstance(moved, str):  # flushed outside the lock, shared (see _prepare)
                dirs = daemon.storage.set_aside_dirs(root)
                await self._run(root, daemon.storage.flush_dirs, dirs)
        except OSError as exc:
            daemon.events.emit(
                "save.set_aside_failed",
                "error",
                root=key.root,
                step=key.step,
                attempt=attempt,
                error=exc.strerror or str(exc),
            )
            return None
        if not isinstance(moved, str):
            return None
        daemon.ledger.set_aside(key, attempt, moved, daemon.clock())
        try:
            await daemon.commit([])
        except RequestError:
            pass  # reported as journal.failed; the trash name still says whose it is
        daemon.events.emit(
            "save.set_aside",
            root=key.root,
            step=key.step,
            attempt=attempt,
            path=moved,
            reason="the attempt failed",
        )
        return moved

"""Retention in the daemon: a pass per root after each promotion, and the requests.

Each root with a policy has a task that runs a *pass* whenever it is kicked (a
promotion, ``score``, ``pin``/``unpin``, ``hold``, a start) or a hold or grace period
ends. A pass never runs on the training path: a promotion only kicks it, and its
``wait`` was answered before. It

1. finds the root's ``step_N`` directories (in the root's lane), adopts the metrics of
   newly promoted ones (their ranks' ``done``, ``training_info.json``);
2. moves the ``best`` pointer to the best checkpoint by ``keep_best``'s metric;
3. judges every step (:func:`~daemon.retention.policy.judge`) and, if some are let go,
   takes the root's lock, finds and judges them again, fsyncs the root (both pointers
   are durable before anything goes), renames them into the trash, journals it, then
   lets the background remover delete them (``checkpoint.retired``, then
   ``checkpoint.deleted``).

Under the root's lock there are only a directory listing, a few ``lstat`` and
``readlink`` calls, the renames and their fsyncs: a promotion waits for those at most,
never for a deletion.

:attr:`Retention.may_prune` is the one rule deciding whether this daemon changes a
root at all (pointer, renames); on a root shared between nodes only the leader may.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Protocol

import anyio
from anyio.abc import TaskGroup, TaskStatus

from orchestrator import protocol as p

from ..base._errors import RequestError
from ..base._faults import crash_point
from ..config._config import RootConfig
from ..host._host import Host
from ..ledger._ledger import SaveKey
from ..ledger._records import JournalRecord
from ..store._steps import Found, ManifestCache
from ..store._trash import TrashRemover
from . import requests
from .facts import RootFacts
from .policy import StepFacts, Verdict, best_step, judge, retired
from .report import PassReport, report
from .state import RetentionState

__all__ = ["Retention", "prunes_every_root"]


class _Retaining(Host, Protocol):
    @property
    def trash(self) -> TrashRemover: ...


def prunes_every_root(root: RootConfig, leader: str | None) -> bool:
    """The default :attr:`Retention.may_prune`: this daemon prunes every root it serves."""
    return True


class Retention(RootFacts):
    """Retention passes and requests for every configured root of ``daemon``.

    Args:
        daemon: The daemon (ledger, lanes, locks, journal commits, events, trash).
        may_prune: Whether this daemon may change ``root`` (move ``best``, retire
            steps), given the node that led the root's newest checkpoint (None: it did
            not span nodes; "": it did, but no marker names rank 0). On a root shared
            by several nodes, only the leader's daemon may.
    """

    _daemon: _Retaining

    def __init__(
        self,
        daemon: _Retaining,
        *,
        may_prune: Callable[[RootConfig, str | None], bool] = prunes_every_root,
    ) -> None:
        self._daemon = daemon
        self.may_prune = may_prune
        self.state = RetentionState()
        self._cache: ManifestCache = {}
        self._info_tried: set[SaveKey] = set()
        self._retiring: set[SaveKey] = set()
        roots = [r for r in daemon.config.roots if r.retention is not None]
        self._kicks = {r.path: anyio.Event() for r in roots}
        self._passing = {r.path: anyio.Lock() for r in roots}
        self._facts_locks: dict[str, anyio.Lock] = {}
        self._wake_at: dict[str, float] = {}
        self._last_prunes: dict[str, bool] = {}
        self.passes: dict[str, PassReport] = {}
        """Each root's last applied pass (the metrics read it)."""
        self._group: TaskGroup | None = None
        self._stopped = anyio.Event()

    # -- lifecycle ---------------------------------------------------------------------

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run every root's pass task (each kicked once at start) until :meth:`stop`."""
        try:
            async with anyio.create_task_group() as group:
                self._group = group
                for root in self._daemon.config.roots:
                    if root.retention is not None:
                        self._kicks[root.path].set()  # a restart converges to the policy
                        group.start_soon(self._loop, root.path)
                task_status.started()
        finally:
            self._stopped.set()

    async def stop(self) -> None:
        """Stop the pass tasks; a pass renaming steps finishes first (it is shielded)."""
        if self._group is not None:
            self._group.cancel_scope.cancel()
            await self._stopped.wait()

    def reconfigured(self) -> None:
        """After a configuration reload: apply every root's policy as it now is.

        A root that gained a policy gets its task; every root with one runs a pass, so a
        policy that keeps less converges at once. Never blocks.
        """
        for root in self._daemon.config.roots:
            if root.retention is None:
                continue
            if root.path not in self._kicks:
                self._kicks[root.path] = anyio.Event()
                self._passing[root.path] = anyio.Lock()
                if self._group is not None:
                    self._group.start_soon(self._loop, root.path)
            self._kicks[root.path].set()

    def kick(self, root: str) -> None:
        """Something changed in ``root``: run a pass soon. Never blocks."""
        event = self._kicks.get(root)
        if event is not None:
            event.set()

    def replay(self, record: JournalRecord) -> bool:
        """Apply a journaled record at start; False if it is none of retention's."""
        return self.state.replay(record)

    def snapshot(self) -> list[JournalRecord]:
        """Records rebuilding retention's state, for compacting the journal."""
        live = [
            (s.key, s.attempt) for s in self._daemon.ledger if s.state is not p.SaveState.FAILED
        ]
        return self.state.snapshot(live, time.time())

    def promoted(self, root: RootConfig, key: SaveKey) -> None:
        """``key`` was promoted: adopt its metrics and apply the policy, in the background."""
        self.kick(root.path)

    async def _loop(self, path: str) -> None:
        while True:
            event = self._kicks[path]
            wake = self._wake_at.get(path)
            delay = math.inf if wake is None else max(0.0, wake - time.time())
            with anyio.move_on_after(delay):
                await event.wait()
            self._kicks[path] = anyio.Event()  # kicks from now on run another pass
            # As configured now: a reload may have changed its policy, or removed it.
            root = self._daemon.config.root_for(path)
            if root is None or root.retention is None:
                self._wake_at.pop(path, None)
                continue
            try:
                await self.run_pass(root, apply=True)
            except OSError as exc:
                self._daemon.events.emit(
                    "retention.failed", "warning", root=root.path, error=exc.strerror or str(exc)
                )
            except RequestError as exc:  # the journal: reported as journal.failed
                self._daemon.events.emit(
                    "retention.failed", "warning", root=root.path, error=str(exc)
                )
            except Exception as exc:  # a task boundary: a bug must not stop the daemon
                self._daemon.events.emit(
                    "daemon.internal_error", "error", where="retention", error=repr(exc)
                )

    # -- a pass ------------------------------------------------------------------------

    async def run_pass(
        self, root: RootConfig, *, apply: bool
    ) -> tuple[list[Verdict], int | None, list[int]]:
        """Judge ``root``'s steps; with ``apply``, move ``best`` and retire what goes.

        Returns:
            Every step's verdict, the step ``best`` names, and the steps retired.

        Raises:
            OSError: the root could not be read, or the trash not made.
            RequestError: (``unavailable``) a change could not be journaled.
        """
        config = root.retention
        if config is None:
            return [], None, []
        async with self._passing[root.path]:
            found = await self._scan(root)
            await self._absorb(root, found)
            await self._adopt(root, found)
            now = time.time()
            self.state.prune(root.path, {f.step for f in found}, now)
            prunes = self._last_prunes[root.path] = await self._prunes(root, found)
            facts = self._facts(root, found, now)
            best = best_step(config.policy, facts)
            lanes, storage = self._daemon.lanes, self._daemon.storage
            if apply and prunes:
                await self._stale_best(root)
            named = storage.read_named_pointer
            on_disk = await lanes.run(root.path, named, root, config.best_pointer)
            if apply and prunes and best is not None and best != on_disk:
                await self._move_best(root, best)
                on_disk = best
            latest = await lanes.run(root.path, storage.read_pointer, root)
            pointers = {root.pointer: latest, config.best_pointer: on_disk}
            verdicts = judge(config.policy, facts, pointers=pointers, now=now)
            self._wake_at_next(root, facts, now)
            gone: list[int] = []
            if apply and prunes and retired(verdicts):
                with anyio.CancelScope(shield=True):
                    verdicts, gone = await self._retire(root)
            if apply:
                space = await lanes.run(root.path, storage.free_space, root)
                at = time.time()
                self.passes[root.path] = report(verdicts, gone, at=at, prunes=prunes, space=space)
            return verdicts, on_disk, gone

    async def _prunes(self, root: RootConfig, found: list[Found]) -> bool:
        """Whether this daemon changes ``root`` (:attr:`may_prune`, given who led it)."""
        complete = [f.step for f in found if f.complete]
        leader = None
        if complete:
            leader_node = self._daemon.storage.leader_node
            leader = await self._daemon.lanes.run(root.path, leader_node, root, complete[-1])
        return self.may_prune(root, leader)

    async def _scan(self, root: RootConfig) -> list[Found]:
        return await self._daemon.lanes.run(
            root.path, self._daemon.storage.scan_steps, root, self._cache
        )

    async def _adopt(self, root: RootConfig, found: list[Found]) -> None:
        """Give newly promoted steps their metrics: ``training_info.json``, then ``done``'s."""
        changed = False
        for f in found:
            if not f.complete:
                continue
            key = SaveKey(root.path, f.step)
            need_info = key not in self._info_tried and not self.state.has_metrics(key)
            if not self._unadopted(key, f):
                continue
            self._info_tried.add(key)
            info: dict[str, float] = {}
            if need_info:
                path = root.final_dir(f.step)
                metrics = self._daemon.storage.training_info_metrics
                info = await self._daemon.lanes.run(root.path, metrics, path)
            self.state.adopt(key, f.attempt, info)
            changed = True
            await self._write_facts(root, key, f.attempt)
        if changed:
            await self._daemon.commit([])

    def _unadopted(self, key: SaveKey, found: Found) -> bool:
        """Whether promoted ``key`` has metrics still to take (its files', its ``done``s')."""
        pending = self.state.pending(key)
        if pending is not None and pending[0] == found.attempt:
            return True
        return key not in self._info_tried and not self.state.has_metrics(key)

    def _facts(self, root: RootConfig, found: list[Found], now: float) -> list[StepFacts]:
        state = self.state
        return [
            StepFacts(
                step=f.step,
                complete=f.complete,
                promoted_at=f.promoted_at,
                metrics=state.metrics(key := SaveKey(root.path, f.step)),
                pinned=state.pinned(key),
                held_until=state.held_until(key, now),
            )
            for f in found
        ]

    def _wake_at_next(self, root: RootConfig, facts: list[StepFacts], now: float) -> None:
        """When the next hold or grace period of ``root`` ends: a pass then."""
        config = root.retention
        assert config is not None
        ends = [self.state.next_expiry(root.path, now)]
        best = config.policy.keep_best
        if best is not None:
            ends += [
                s.promoted_at + best.grace_s
                for s in facts
                if s.complete and best.metric not in s.metrics
            ]
        future = [e for e in ends if e is not None and e > now]
        if future:
            self._wake_at[root.path] = min(future) + 0.01
        else:
            self._wake_at.pop(root.path, None)

    async def _move_best(self, root: RootConfig, step: int) -> None:
        config = root.retention
        assert config is not None and config.policy.keep_best is not None
        metric = config.policy.keep_best.metric
        try:
            await self._daemon.lanes.run(
                root.path, self._daemon.storage.write_pointer, root, config.best_pointer, step
            )
        except OSError as exc:
            self._daemon.events.emit(
                "pointer.failed",
                "error",
                root=root.path,
                step=step,
                reason=f"{config.best_pointer} not moved: {exc.strerror or exc}",
            )
            return
        value = self.state.metrics(SaveKey(root.path, step)).get(metric)
        self._daemon.events.emit(
            "checkpoint.best",
            root=root.path,
            step=step,
            path=root.final_dir(step),
            pointer=config.best_pointer,
            metric=metric,
            value=value,
        )

    async def _retire(self, root: RootConfig) -> tuple[list[Verdict], list[int]]:
        """Under the root's lock: find and judge again, fsync, rename what goes, journal."""
        config = root.retention
        assert config is not None
        daemon, lanes, storage = self._daemon, self._daemon.lanes, self._daemon.storage

        def key_of(f: Found) -> SaveKey:
            return SaveKey(root.path, f.step)

        async with daemon.root_locks[root.path]:
            found = await self._scan(root)
            latest = await lanes.run(root.path, storage.read_pointer, root)
            named = storage.read_named_pointer
            best = await lanes.run(root.path, named, root, config.best_pointer)
            # Both pointers durable before anything they might have named goes.
            await lanes.run(root.path, storage.sync_root, root)
            now = time.time()
            # No await from this judgement to marking the steps: a pin or hold that
            # lands from here on sees them being retired and is refused.
            pointers = {root.pointer: latest, config.best_pointer: best}
            verdicts = judge(
                config.policy, self._facts(root, found, now), pointers=pointers, now=now
            )
            # A step promoted since this pass took the metrics is judged by the next pass
            # (its promotion kicked one), once it has them: not here, without them.
            fresh = {f.step for f in found if f.complete and self._unadopted(key_of(f), f)}
            going = {v.step: v for v in retired(verdicts) if v.step not in fresh}
            keys = {SaveKey(root.path, s) for s in going}
            if not keys:
                return verdicts, []
            self._retiring |= keys
            try:
                moved, refused = await lanes.run(root.path, storage.retire, root, sorted(going))
            finally:
                self._retiring -= keys
            crash_point("retention_after_doom")
            for step, entry in moved.items():
                key = SaveKey(root.path, step)
                self.state.retired(key, entry, going[step].retire or "")
                try:
                    await lanes.run(root.path, storage.remove_facts, root, step)
                except OSError:
                    pass  # stale facts of a retired attempt: another attempt never takes them
                save = daemon.ledger.get(key)
                if save is not None and save.state is p.SaveState.PROMOTED:
                    daemon.ledger.forget(key)  # it may be saved afresh, as after gc
        try:
            await daemon.commit([])
        finally:
            daemon.trash.kick(root)  # the renames happened, whether journaled or not
        for step, entry in sorted(moved.items()):
            daemon.events.emit(
                "checkpoint.retired",
                root=root.path,
                step=step,
                path=root.final_dir(step),
                entry=entry,
                rule=going[step].retire,
                policy=config.policy.describe(),
            )
        for step, why in sorted(refused.items()):
            daemon.events.emit(
                "retention.refused", "warning", root=root.path, step=step, reason=why
            )
        return verdicts, sorted(moved)

    # -- requests ----------------------------------------------------------------------

    async def handle(
        self, request: p.Score | p.Pin | p.Unpin | p.Hold | p.Retention
    ) -> p.Ack | p.RetentionReply:
        """Answer ``score``, ``pin``, ``unpin``, ``hold`` or ``retention`` (:mod:`.requests`).

        Raises:
            RequestError: refused; see :func:`daemon.retention.requests.answer`.
        """
        return await requests.answer(self, self._daemon, request)

    def retiring(self, key: SaveKey) -> bool:
        """Whether ``key`` is being renamed into the trash right now."""
        return key in self._retiring

    def prunes(self, root: RootConfig) -> bool:
        """Whether the last pass found that this daemon prunes ``root``."""
        return self._last_prunes.get(root.path, True)

"""The daemon's request handlers: ``begin``, ``done``, ``fail``, ``wait`` and the rest.

A mixin of :class:`daemon.server._server.Daemon`: each handler checks the request,
feeds the ledger, commits (journal first, reply after) and answers. Handlers reach a
root only through the daemon's storage, in the root's lane.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

import anyio
import msgspec

from orchestrator import protocol as p

from ..base._errors import RequestError
from ..base._events import Events
from ..config._config import Config, RootConfig
from ..ledger._ledger import Effect, Ledger, SaveKey, SaveRecord
from ..nodes._coordinator import Nodes
from ..ops._health import HealthCheck
from ..ops._reload import reloaded_root_check
from ..retention.applier import Retention
from ..retention.state import checked_metrics
from ..store._attempts import new_attempt_id
from ..store._lanes import Lanes
from ..store._paths import check_relative
from ..store._storage import Storage
from ..store._trash import TrashRemover
from ._collect import collect
from ._owners import AttemptDirs
from ._rejoin import rejoin
from ._rescues import Rescues
from ._supersede import Superseding
from ._tierrestore import Restorer
from ._tiers import TierSaves

__all__ = ["VERSION", "Requests"]

try:
    VERSION = version("ckptd")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    VERSION = "0+unknown"

_SETTLED = (p.SaveState.PROMOTED, p.SaveState.FAILED)


class Requests(Superseding, Rescues):
    """Request handling over the daemon's state (a mixin of ``Daemon``)."""

    config: Config
    ledger: Ledger
    events: Events
    lanes: Lanes
    storage: Storage
    nodes: Nodes
    attempt_dirs: AttemptDirs
    retention: Retention
    health: HealthCheck
    trash: TrashRemover
    root_locks: dict[str, anyio.Lock]
    collecting: set[SaveKey]
    retiring: dict[str, RootConfig]
    stopping: bool
    clock: Callable[[], float]
    _started: float
    _local: set[str]
    _internal: set[int]
    tiers: TierSaves
    restorer: Restorer
    _waiters: dict[SaveKey, anyio.Event]
    _waiting: dict[SaveKey, int]

    if TYPE_CHECKING:  # what the daemon provides (no stubs at runtime: no MRO shadowing)

        def configured(self, path: str) -> RootConfig: ...

        def commit(self, effects: Sequence[Effect]) -> Awaitable[None]: ...

        def apply(self, effects: Sequence[Effect]) -> None: ...

        def settling(self, key: SaveKey) -> bool: ...

    async def dispatch(self, conn: int, request: p.Request) -> msgspec.Struct:
        """Answer one request other than ``wait`` and ``subscribe``.

        Raises:
            RequestError: the request must be refused.
        """
        now = self.clock
        match request:
            case p.Ping():
                return p.PingReply(id=request.id, version=VERSION)
            case p.Health():
                return await self.health.reply(request.id, VERSION)
            case p.Begin():
                root = self.configured(request.root)
                if root.fast is not None and conn not in self._internal:
                    return await self.tiers.begin(conn, request, root)
                return await self._begin(conn, request)
            case p.Restore():
                return await self.restorer.restore(request)
            case p.Done(root=root_path, step=step, rank=rank, files=files):
                root = self.configured(root_path)
                if root.fast is not None and conn not in self._internal:
                    return self.tiers.done(request, root)
                for entry in files:
                    check_relative(entry.path)
                key = SaveKey(root.path, step)
                attempt = request.attempt
                metrics = checked_metrics(request.metrics or {})  # refused before any change
                effects = self.ledger.done(key, rank, files, conn, now(), attempt=attempt)
                if metrics and (save := self.ledger.get(key)) is not None:
                    self.retention.state.reported(key, save.attempt, metrics)
                await self.commit(effects)
                return p.Ack(id=request.id)
            case p.Fail(root=root_path, step=step, rank=rank, reason=reason):
                root = self.configured(root_path)
                if root.fast is not None and conn not in self._internal:
                    return self.tiers.fail(request, root)
                key = SaveKey(root.path, step)
                attempt = request.attempt
                await self.commit(self.ledger.fail(key, rank, reason, now(), attempt=attempt))
                return p.Ack(id=request.id)
            case p.Status(root=root_path):
                only = None if root_path is None else self.configured(root_path).path
                saves = [self._info(s) for s in self.ledger if only in (None, s.key.root)]
                return p.StatusReply(
                    id=request.id,
                    version=VERSION,
                    pid=os.getpid(),
                    uptime_s=round(now() - self._started, 3),
                    roots=[r.path for r in self.config.roots],
                    saves=saves,
                    waits=self.waits,
                    waited_steps=len(self._waiters),
                    layouts=[
                        p.RootInfo(
                            r.path,
                            r.tmp_prefix,
                            r.final_prefix,
                            r.pointer,
                            r.staging,
                            "" if r.fast is None else r.fast.path,
                        )  # fmt: skip
                        for r in self.config.roots
                    ],
                    stalled=self.lanes.stalled(only),
                    node=self.config.node,
                )
            case p.Latest(root=root_path):
                root = self.configured(root_path)
                step_found = await self.lanes.run(
                    root.path, self.storage.latest_promoted, root, abandon=True
                )
                if step_found is None:
                    raise RequestError(p.ErrorCode.NOT_FOUND, f"{root.path} has no promoted step")
                try:
                    path = await self.lanes.run(
                        root.path, self.storage.locate, root, step_found, abandon=True
                    )
                except FileNotFoundError:
                    raise RequestError(
                        p.ErrorCode.NOT_FOUND, f"{root.path} has no promoted step"
                    ) from None
                return p.LatestReply(id=request.id, path=path, step=step_found)
            case p.Promote(root=root_path, step=step, timeout=timeout):
                root = self.configured(root_path)
                return await self._rescue(request.id, root, step, wait_s=timeout)
            case p.Gc(root=root_path, remove=remove):
                return await collect(self, request.id, self.configured(root_path), remove)
            case p.Score() | p.Pin() | p.Unpin() | p.Hold() | p.Retention():
                reply: msgspec.Struct = await self.retention.handle(request)
                return reply
        raise RequestError(p.ErrorCode.UNKNOWN_OP, f"unhandled op {type(request).__name__}")

    async def _begin(self, conn: int, request: p.Begin) -> p.BeginReply:
        """A rank joins (or starts) the step's attempt; reply once its directory is ready.

        The ledger decides, without an ``await`` in between, whether this ``begin`` starts
        a new attempt, joins the current one or is refused; the decision is journaled;
        then ``tmp_step_N`` is made the attempt's own (once per attempt, every rank
        waiting for it) before anyone is told to write.

        Raises:
            RequestError: the begin is refused.
        """
        root = self.configured(request.root)
        if self.stopping:
            raise RequestError(p.ErrorCode.SHUTTING_DOWN, "the daemon is stopping")
        key = SaveKey(root.path, request.step)
        known = self.ledger.get(key)
        if (
            known is not None
            and known.state is p.SaveState.PROMOTED
            and not request.resent
            and request.attempt is None
        ):
            final = root.final_dir(request.step)
            if not await self.lanes.run(root.path, self.storage.present, final, abandon=True):
                # Promoted once, then deleted by hand: the step may be saved afresh.
                self.ledger.forget(key)
                await self.commit([])
                self.events.emit(
                    "checkpoint.gone", "warning", root=root.path, step=key.step, path=final
                )
                known = self.ledger.get(key)
        if known is not None and request.run:
            await self._supersede(root, key, request.run)  # a dead run's attempt: gone
            known = self.ledger.get(key)
        fresh, age = new_attempt_id(), 0.0
        found = None
        if known is None and (request.attempt or request.run):
            # A step this daemon does not know (it may have started on an empty state
            # directory): the root says whether the run's attempt is there to take over.
            if root.path in self._local:
                found = rejoin(self.storage, root, request)
            else:
                found = await self.lanes.run(
                    root.path, rejoin, self.storage, root, request, abandon=True
                )
        if found is not None:
            if found.promoted:
                return p.BeginReply(
                    id=request.id,
                    path=root.save_dir(key.step, found.attempt),
                    state=p.SaveState.PROMOTED,
                    attempt=found.attempt,
                )
            fresh, age = found.attempt, found.age_s
            await self._admit(root, key, adopting=True)
            lws = request.local_world_size
            if lws is None or lws >= request.world_size:
                await self._single_node(root, request)
        elif known is None or self.ledger.starts_new_attempt(
            key, conn, resent=request.resent, attempt=request.attempt, run=request.run
        ):
            await self._admit(root, key)
            lws = request.local_world_size
            if lws is None or lws >= request.world_size:
                await self._single_node(root, request)
            if lws is not None and lws < request.world_size and request.rank != 0:
                # Spanning nodes: every node's ranks join the attempt the leader marks.
                joined = await self.nodes.attempt_for(root, key, request.world_size, request.run)
                fresh = joined or fresh
        effects = self.ledger.begin(
            key,
            request.rank,
            request.world_size,
            conn,
            self.clock(),
            resent=request.resent,
            attempt=request.attempt,
            fresh=fresh,
            local_world_size=request.local_world_size,
            run=request.run,
            age_s=age,
        )
        save = self.ledger.get(key)
        assert save is not None
        await self.commit(effects)
        self.nodes.begun(key)
        if save.state is p.SaveState.OPEN:
            if not save.spans or save.leader:
                await self.attempt_dirs.ready(root, save)
            else:  # the leader's marker is there: only the leader prepares the directory
                self.nodes.announce(root, save)
            self.nodes.watch(save)
        if save.state is p.SaveState.FAILED:
            raise RequestError(p.ErrorCode.STEP_FAILED, f"step {key.step} failed: {save.reason}")
        return p.BeginReply(
            id=request.id,
            path=root.save_dir(key.step, save.attempt),
            state=save.state,
            attempt=save.attempt,
        )

    async def _admit(self, root: RootConfig, key: SaveKey, *, adopting: bool = False) -> None:
        """Checks before a new save (or a new attempt at a failed one) may begin.

        ``adopting``: the save is an attempt the root shows begun (its daemon lost its
        state); it was admitted then, and is not counted against ``max_open_saves`` again
        (the daemon with the journal would have it already).

        Raises:
            RequestError: too many saves in flight, gc is removing the step, or its
                directories are unusable.
        """
        if not adopting and self.ledger.unsettled >= self.config.max_open_saves:
            raise RequestError(
                p.ErrorCode.TOO_BUSY,
                f"{self.ledger.unsettled} saves already in flight; retry later",
            )
        if key in self.collecting:
            raise RequestError(
                p.ErrorCode.INVALID_STATE, f"{root.tmp_dir(key.step)} is being removed by gc; retry"
            )
        if root.path in self._local:
            self.storage.check_tmp_dir(root, key.step)  # two lstats on a local disk
        else:
            await self.lanes.run(
                root.path, self.storage.check_tmp_dir, root, key.step, abandon=True
            )
        reloaded_root_check(self.config, self.retiring, root)  # after the last await

    async def _single_node(self, root: RootConfig, request: p.Begin) -> None:
        """Refuse a one-node ``begin`` where a save spanning nodes left its directory.

        Without ``local_world_size`` a begin is a save on this node alone, which would
        set the spanning attempt's ``tmp_step_N`` (with the other nodes' markers) aside.
        That is a node that lost ``LOCAL_WORLD_SIZE``: say so, unless the directory is
        another run's (a requeued job may save on fewer nodes).
        """
        if root.path in self._local:  # one listdir of a local tmp_step_N, if any: inline
            found = self.storage.spanning_attempt(root, request.step)
        else:
            found = await self.lanes.run(
                root.path, self.storage.spanning_attempt, root, request.step, abandon=True
            )
        if found is None or (request.run and found.run and found.run != request.run):
            return
        raise RequestError(
            p.ErrorCode.NODE_CONFLICT,
            f"{root.tmp_dir(request.step)} holds attempt {found.attempt} of a save spanning "
            f"nodes, and this begin sends no local_world_size (so it would save on this "
            f"node alone): set LOCAL_WORLD_SIZE (torchrun) or pass local_world_size on "
            f"every rank; if that attempt is dead, ckptd gc --yes removes it",
        )

    async def settled(
        self, request: p.Wait, root: RootConfig, *, durable: bool = False
    ) -> p.WaitReply:
        """The reply to ``wait``, once the step settles or ``request.timeout`` passes.

        On a root with a fast tier, a save of the fast tier settles when it is promoted
        there (``durable``: the durable root's save of the step, a drain's).
        """
        if root.fast is not None and not durable:
            tiered = await self.tiers.settled(request, root)
            if tiered is not None:
                return tiered
        key = SaveKey(root.path, request.step)
        with anyio.move_on_after(request.timeout):
            while (
                (save := self.ledger.get(key)) is None
                or save.state not in _SETTLED
                or self.settling(key)  # settled, but not yet durable
                or self.attempt_dirs.reporting(key)  # failed, but not yet set aside
                or self.nodes.reporting(key)  # failed, but not yet written out
            ):
                # No save of the step here: only a promotion's manifest and a durable
                # rename (a peer's, or an earlier run's) say it was promoted.
                if save is None and await self.lanes.run(
                    root.path, self.storage.promoted_durably, root, request.step, abandon=True
                ):
                    break
                await self._wait_for(key)
        save = self.ledger.get(key)
        if save is None:
            final = root.final_dir(key.step)
            landed = self.storage.promoted_durably
            if await self.lanes.run(root.path, landed, root, key.step, abandon=True):
                return p.WaitReply(id=request.id, state="promoted", path=final)
            return p.WaitReply(id=request.id, state="pending")
        attempt = save.attempt or None
        if save.state is p.SaveState.PROMOTED:
            return p.WaitReply(id=request.id, state="promoted", path=save.path, attempt=attempt)
        if save.state is p.SaveState.FAILED and not (
            self.settling(key) or self.attempt_dirs.reporting(key) or self.nodes.reporting(key)
        ):
            return p.WaitReply(id=request.id, state="failed", reason=save.reason, attempt=attempt)
        return p.WaitReply(id=request.id, state="pending", attempt=attempt)

    async def _wait_for(self, key: SaveKey) -> None:
        """Return when ``key`` next settles.

        The entry goes with its last waiter: waits on steps that never begin leave
        nothing behind.
        """
        event = self._waiters.get(key)
        if event is None:
            event = self._waiters[key] = anyio.Event()
        self._waiting[key] = self._waiting.get(key, 0) + 1
        try:
            await event.wait()
        finally:
            left = self._waiting[key] - 1
            if left:
                self._waiting[key] = left
            else:
                del self._waiting[key]
                if self._waiters.get(key) is event:
                    del self._waiters[key]

    @property
    def waits(self) -> int:
        """``wait`` requests pending right now."""
        return sum(self._waiting.values())

    # -- helpers -----------------------------------------------------------------------

    def _info(self, save: SaveRecord) -> p.SaveInfo:
        now = self.clock()
        ranks = [
            p.RankInfo(
                rank=rank,
                state=rec.state,
                connected=rec.conn is not None,
                files=len(rec.files),
                bytes=sum(f.size for f in rec.files),
                lease_s=None if rec.lease_deadline is None else round(rec.lease_deadline - now, 3),
                reason=rec.reason,
                node=rec.node,
            )
            for rank, rec in sorted(save.ranks.items())
        ]
        return p.SaveInfo(
            root=save.key.root,
            step=save.key.step,
            world_size=save.world_size,
            state=save.state,
            age_s=round(now - save.first_begin, 3),
            ranks=ranks,
            path=save.path,
            reason=save.reason,
            attempt=save.attempt or None,
            set_aside=save.set_aside,
            local_world_size=save.local_world_size if save.spans else None,
            role=("leader" if save.leader else "node") if save.spans else None,
            marked=save.marked,
        )

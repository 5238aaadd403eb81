"""The daemon: requests feed the ledger; its changes are journaled, then carried out.

Every change is durable in the journal before its reply is sent or its event emitted
(:meth:`Daemon.commit`). Ledger effects become events, promotions and woken waiters.
Promotions run in worker threads inside shielded scopes and finish even while the daemon
shuts down; on start, :meth:`Daemon.recover` rebuilds the ledger from the journal and
finishes what a previous run left half done.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version

import anyio
import msgspec
from anyio.abc import SocketAttribute, SocketStream

from orchestrator import protocol as p

from ..base._errors import RequestError, VerificationError
from ..base._events import Events
from ..config._config import Config, RootConfig
from ..ledger._ledger import Effect, Emit, Ledger, SaveKey, SaveRecord, SetAside, Settled, Verify
from ..ledger._records import JournalRecord
from ..ledger._saves import MarkNode, NodeFailed, Watch
from ..nodes._coordinator import Nodes
from ..nodes._rescue import rescue_markers
from ..ops._health import HealthCheck
from ..ops._reload import reloaded_root_check
from ..retention.applier import Retention
from ..retention.state import checked_metrics
from ..store._attempts import new_attempt_id
from ..store._journal import Journal
from ..store._lanes import Lanes
from ..store._local import LocalStorage
from ..store._mounts import is_local, mount_table
from ..store._paths import check_relative
from ..store._storage import Storage
from ..store._trash import TrashRemover
from ._collect import collect
from ._connection import Connection
from ._owners import AttemptDirs
from ._promotion import Promoter

__all__ = ["VERSION", "Daemon"]

try:
    VERSION = version("ckptd")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    VERSION = "0+unknown"

_SETTLED = (p.SaveState.PROMOTED, p.SaveState.FAILED)


class Daemon:
    """The state and request handling of one daemon, independent of how it listens.

    Args:
        config: Validated configuration.
        storage: Filesystem writes used by promotion.
        journal: The open journal; None keeps state in memory only.
        clock: Monotonic clock in seconds; the ledger sees time only through it.
    """

    def __init__(
        self,
        config: Config,
        *,
        storage: Storage | None = None,
        journal: Journal | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.events = Events()
        self.ledger = Ledger(
            lease=config.lease, save_timeout=config.save_timeout, node_timeout=config.node_timeout
        )
        self.clock = clock
        self._started = clock()
        self._conn_ids = itertools.count(1)
        self._connections = 0
        self._waiters: dict[SaveKey, anyio.Event] = {}
        self._waiting: dict[SaveKey, int] = {}  # how many wait on each entry of _waiters
        self.root_locks = {root.path: anyio.Lock() for root in config.roots}
        """One lock per root: promotions and gc in a root never overlap."""
        self._changed = anyio.Event()
        self.journal = journal
        self._queue: list[JournalRecord] = []  # changes not yet durable, in order
        self._queued = 0  # changes ever queued
        self._durable = 0  # changes ever made durable
        self._held: deque[tuple[int, list[Effect]]] = deque()  # effects awaiting durability
        self._flushing: anyio.Event | None = None  # set when the flush under way ends
        self.collecting: set[SaveKey] = set()  # steps gc is removing right now (_collect)
        self.trash = TrashRemover(self.events, config.roots)
        """Deletes what gc doomed, in the background; started by ``serve``."""
        self.storage: Storage = storage or LocalStorage()
        """Every effect on the roots (:mod:`daemon.store._storage`)."""
        self.promoter = Promoter(self)
        self.lanes = Lanes(
            [r.path for r in config.roots],
            threads=config.root_threads,
            stall_after=config.fs_stall_after,
            events=self.events,
            journal=journal,
        )
        """Each root's blocking filesystem calls run in that root's lane."""
        self.attempt_dirs = AttemptDirs(self, run=self._run_for)
        """Each attempt's own tmp directory: prepared before begin, set aside on failure."""
        self.retention = Retention(self, may_prune=self.may_prune)
        """Metrics, pins, holds, the ``best`` pointer and retiring steps; run by ``serve``."""
        self.stopping = False
        self.retiring: dict[str, RootConfig] = {}
        """Roots a reload removed whose saves in flight go on to their end; new saves
        there are refused. Maintained by ``daemon.server._reloader``."""
        self.journal_error: str | None = None
        """Why the last journal write failed; None once one succeeds."""
        self.health = HealthCheck(self)
        """Answers ``health`` (probes)."""
        mounts = mount_table()
        self._local = {r.path for r in config.roots if is_local(r.real or r.path, mounts)}
        """Roots on a local filesystem: their per-save checks run on the event loop."""
        self.nodes = Nodes(self, run=self._run_for, local_roots=self._local)
        """Saves that span nodes: the attempt agreed, markers written and watched."""
        self.promoter.claimed = self.nodes.follow_later
        self.nodes.promote = self.promoter.start

    # -- effects -----------------------------------------------------------------------

    async def commit(self, effects: Sequence[Effect]) -> None:
        """Make the ledger's latest changes durable, then carry out ``effects``.

        Changes are journaled in the order the ledger made them; a commit returns once
        every change up to its own is on disk (concurrent commits share one write and
        fsync). If the journal cannot be written, the changes stay queued and their
        effects held back: nothing is acknowledged, emitted or started before it is
        durable, and a retried request, which the ledger sees as a repeat, is answered
        only once the original change is on disk.

        Raises:
            RequestError: (``unavailable``) the journal could not be written; the
                request must not be acknowledged and may be retried.
        """
        new = [self.walled(r) for r in self.ledger.drain_records()]
        new += self.retention.state.drain_records()
        self._queue += new
        self._queued += len(new)
        target = self._queued
        self._held.append((target, list(effects)))
        if self.journal is None:
            self._queue.clear()
            self._durable = self._queued
        # One flush at a time, each taking every change queued so far. Commits whose
        # changes are in a flush wait for it and then all go on together (no hand-off
        # from one waiter to the next); the first of the rest starts the next flush.
        while self._durable < target:
            if self._flushing is not None:
                await self._flushing.wait()
                continue
            await self._flush()
        while self._held and self._held[0][0] <= self._durable:
            self.apply(self._held.popleft()[1])

    async def _flush(self) -> None:
        """Write every queued change to the journal and wait until it is durable.

        Raises:
            RequestError: (``unavailable``) the journal could not be written.
        """
        assert self.journal is not None
        done = self._flushing = anyio.Event()
        batch = list(self._queue)
        try:
            with anyio.CancelScope(shield=True):
                await self.journal.append(batch)
        except OSError as exc:
            path = self.journal.path
            self.events.emit("journal.failed", "error", path=path, error=_why(exc))
            self.journal_error = _why(exc)
            raise RequestError(
                p.ErrorCode.UNAVAILABLE,
                f"the change could not be made durable ({_why(exc)}); retry",
            ) from None
        else:
            del self._queue[: len(batch)]
            self._durable += len(batch)
            self.journal_error = None
        finally:
            self._flushing = None
            done.set()

    def ledger_changed(self) -> bool:
        """Whether the ledger holds changes not yet journaled."""
        return self.ledger.pending_records()

    def may_prune(self, root: RootConfig, leader: str | None) -> bool:
        """Whether this daemon may retire steps of ``root`` and move its ``best`` pointer.

        The one rule of who prunes: on a root shared between nodes, only the leader
        (the daemon serving global rank 0) may. ``leader`` is the node whose marker in
        the root's newest checkpoint holds rank 0 (None: that checkpoint did not span
        nodes, so it is this daemon's; "": it did, and no marker names rank 0, so it is
        nobody's to prune).
        """
        return leader is None or leader == self.config.node

    def apply(self, effects: Sequence[Effect]) -> None:
        """Carry out ledger effects: events, promotions, woken waiters."""
        for effect in effects:
            if isinstance(effect, Emit):
                self.events.emit(effect.name, effect.level, **effect.fields)
            elif isinstance(effect, Verify):
                self.promoter.start(effect.key)
            elif isinstance(effect, SetAside):
                self.attempt_dirs.start_set_aside(effect)
            elif isinstance(effect, MarkNode | Watch | NodeFailed):
                self.nodes.start(effect)
            elif isinstance(effect, Settled):
                self.attempt_dirs.forget(effect.key)
                self.nodes.forget(effect.key)
                waiter = self._waiters.pop(effect.key, None)
                if waiter is not None:
                    waiter.set()
        self._changed.set()

    def journal_snapshot(self) -> list[JournalRecord]:
        """Records rebuilding the current state, for compacting the journal."""
        return [self.walled(r) for r in self.ledger.snapshot()] + self.retention.snapshot()

    def walled(self, record: JournalRecord) -> JournalRecord:
        """The record with its ledger time turned into wall-clock time."""
        at = getattr(record, "at", None)
        if at is None:
            return record
        return msgspec.structs.replace(record, at=time.time() - (self.clock() - at))

    async def timekeeper(self) -> None:
        """Fail saves whose lease or deadline passes, waking exactly when one does."""
        while True:
            self._changed = anyio.Event()
            deadline = self.ledger.next_deadline()
            if deadline is None:
                await self._changed.wait()
            else:
                with anyio.move_on_after(max(0.0, deadline - self.clock())):
                    await self._changed.wait()
            effects = self.ledger.tick(self.clock())
            if effects:
                try:
                    await self.commit(effects)
                except RequestError:
                    pass  # reported as journal.failed; the failure stands in memory

    # -- connections ---------------------------------------------------------------------

    async def handle_connection(self, stream: SocketStream) -> None:
        """Serve one client until it disconnects or the daemon stops."""
        conn = next(self._conn_ids)
        async with stream:
            if self._connections >= self.config.max_connections:
                reply = _error(None, p.ErrorCode.TOO_BUSY, "too many connections; retry later")
                await _hang_up(stream, reply)
                return
            peer = _peer_credentials(stream)
            if peer["uid"] not in self.config.allowed_uids and (
                peer["gid"] not in self.config.allowed_gids
            ):
                self.events.emit("client.refused", "warning", conn=conn, **peer)
                message = f"uid {peer['uid']} / gid {peer['gid']} may not use this daemon"
                await _hang_up(stream, _error(None, p.ErrorCode.FORBIDDEN, message))
                return
            self._connections += 1
            self.events.emit("client.connected", "info", conn=conn, **peer)
            try:
                await Connection(self, conn, stream).run()
            except Exception as exc:  # connection boundary: never take the daemon down
                self.events.emit("daemon.internal_error", "error", conn=conn, error=repr(exc))
            finally:
                self._connections -= 1
                # A disconnect changes nothing durable: leases are re-armed on recovery.
                self.apply(self.ledger.disconnect(conn, self.clock()))
                self.events.emit("client.disconnected", conn=conn)

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
                return await self._begin(conn, request)
            case p.Done(root=root_path, step=step, rank=rank, files=files):
                root = self.configured(root_path)
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
                        p.RootInfo(r.path, r.tmp_prefix, r.final_prefix, r.pointer)
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
                path = root.final_dir(step_found)
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
        fresh = new_attempt_id()
        if known is None or self.ledger.starts_new_attempt(
            key, conn, resent=request.resent, attempt=request.attempt
        ):
            await self._admit(root, key)
            lws = request.local_world_size
            if lws is not None and lws < request.world_size and request.rank != 0:
                # Spanning nodes: every node's ranks join the attempt the leader marks.
                fresh = await self.nodes.attempt_for(root, key, request.world_size) or fresh
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
            id=request.id, path=root.tmp_dir(key.step), state=save.state, attempt=save.attempt
        )

    async def _admit(self, root: RootConfig, key: SaveKey) -> None:
        """Checks before a new save (or a new attempt at a failed one) may begin.

        Raises:
            RequestError: too many saves in flight, gc is removing the step, or its
                directories are unusable.
        """
        if self.ledger.unsettled >= self.config.max_open_saves:
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

    async def settled(self, request: p.Wait, root: RootConfig) -> p.WaitReply:
        """The reply to ``wait``, once the step settles or ``request.timeout`` passes."""
        key = SaveKey(root.path, request.step)
        with anyio.move_on_after(request.timeout):
            while (
                (save := self.ledger.get(key)) is None
                or save.state not in _SETTLED
                or self.attempt_dirs.reporting(key)  # failed, but not yet set aside
                or self.nodes.reporting(key)  # failed, but not yet written out
            ):
                if save is None and await self.lanes.run(
                    root.path, self.storage.promoted, root, request.step, abandon=True
                ):
                    break
                await self._wait_for(key)
        save = self.ledger.get(key)
        if save is None:
            final = root.final_dir(key.step)
            if await self.lanes.run(root.path, self.storage.promoted, root, key.step, abandon=True):
                return p.WaitReply(id=request.id, state="promoted", path=final)
            return p.WaitReply(id=request.id, state="pending")
        attempt = save.attempt or None
        if save.state is p.SaveState.PROMOTED:
            return p.WaitReply(id=request.id, state="promoted", path=save.path, attempt=attempt)
        if save.state is p.SaveState.FAILED and not (
            self.attempt_dirs.reporting(key) or self.nodes.reporting(key)
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

    async def _rescue(
        self, request_id: int, root: RootConfig, step: int, *, wait_s: float
    ) -> p.WaitReply:
        """``ckptd promote``: verify what can be verified, then promote, or refuse."""
        key = SaveKey(root.path, step)
        save = self.ledger.get(key)
        if save is not None and save.state is p.SaveState.PROMOTED:
            raise RequestError(p.ErrorCode.ALREADY_PROMOTED, f"step {step} is already promoted")
        reported = {} if save is None else save.reported_files()
        world_size = 0 if save is None else save.world_size
        async with self.root_locks[root.path]:
            # A failed attempt's set-aside files are judged, and promoted, where they lie
            # in the trash: they never return to tmp_step_N, where a new attempt writes.
            source = None
            if save is not None and save.state is p.SaveState.FAILED and save.set_aside:
                kept = self.storage.directory
                if await self.lanes.run(root.path, kept, save.set_aside, abandon=True):
                    source = save.set_aside
            tmp = source or root.tmp_dir(step)
            marker = await self.lanes.run(root.path, self.storage.read_attempt, tmp, abandon=True)
            attempt = save.attempt if save is not None else ""
            if save is None and marker is not None:
                attempt = marker.attempt  # a step no journal knows: its directory says whose
            # A step that spans nodes is promoted from its node markers, if they cover it.
            nodes = await rescue_markers(self, root, step, attempt, save, tmp)
            if nodes is not None:
                world_size = nodes.world_size
                reported = {**reported, **nodes.files()}
            try:
                manifest = await self.lanes.run(
                    root.path,
                    self.storage.scan_save,
                    root,
                    step,
                    world_size,
                    reported,
                    attempt,
                    source,
                    abandon=True,
                )
            except VerificationError as exc:
                raise RequestError(p.ErrorCode.UNVERIFIABLE, str(exc)) from None
        if not manifest.dcp_dirs:
            raise RequestError(
                p.ErrorCode.UNVERIFIABLE,
                f"{tmp} holds no DCP directory (*.distcp with .metadata): "
                "nothing on disk proves the step complete",
            )
        spanning = 0 if nodes is None else nodes.world_size
        effects = self.ledger.rescue(key, self.clock(), attempt=attempt, world_size=spanning)
        if nodes is not None:
            for m in nodes.markers:
                files = m.ranks()
                self.ledger.remote_done(key, m.node, attempt, len(files), files, self.clock())
        await self.commit(effects)
        wait = p.Wait(id=request_id, root=root.path, step=step, timeout=wait_s)
        return await self.settled(wait, root)

    # -- helpers -----------------------------------------------------------------------

    async def _run_for(self, root: RootConfig, fn: Callable[..., object], *args: object) -> object:
        """Run the blocking ``fn(*args)`` in ``root``'s lane (never left by its caller)."""
        return await self.lanes.run(root.path, fn, *args)

    def configured(self, path: str) -> RootConfig:
        """The configured root ``path`` names.

        Raises:
            RequestError: ``path`` is not absolute and normalised, or not configured.
        """
        root = self.config.root_for(path) or _retiring_root(self.retiring, path)
        if root is None:
            if not os.path.isabs(path) or os.path.normpath(path) != path:
                raise RequestError(
                    p.ErrorCode.PATH_ESCAPE, f"root {path!r} must be absolute and normalised"
                )
            raise RequestError(
                p.ErrorCode.ROOT_NOT_CONFIGURED,
                f"{path} is not a configured root; configured: "
                + ", ".join(r.path for r in self.config.roots),
            )
        return root

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


def _retiring_root(retiring: dict[str, RootConfig], path: str) -> RootConfig | None:
    for root in retiring.values():
        if path in (root.path, root.real) or (root.named and path == root.named):
            return root
    return None


def _peer_credentials(stream: SocketStream) -> dict[str, int]:
    raw = stream.extra(SocketAttribute.raw_socket)
    data = raw.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", data)
    return {"pid": pid, "uid": uid, "gid": gid}


def _error(request_id: int | None, code: p.ErrorCode, message: str) -> p.ErrorReply:
    return p.ErrorReply(id=request_id, error=p.ErrorInfo(code=code.value, message=message))


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)


async def _hang_up(stream: SocketStream, message: msgspec.Struct) -> None:
    """Send one last line and close, so the peer reads it rather than a reset."""
    with anyio.move_on_after(1.0):  # bounded: a refused peer holds nothing for long
        try:
            await stream.send(p.encode(message))
            await stream.send_eof()
            while len(await stream.receive(65536)) > 0:
                pass  # unread input would turn the close into a reset on the peer's side
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass

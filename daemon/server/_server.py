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

import anyio
import msgspec
from anyio.abc import SocketAttribute, SocketStream

from orchestrator import protocol as p

from ..base._errors import RequestError
from ..base._events import Events
from ..config._config import Config, RootConfig
from ..ledger._ledger import Effect, Emit, Ledger, SaveKey, SetAside, Settled, Verify
from ..ledger._records import JournalRecord
from ..ledger._saves import MarkNode, NodeFailed, Watch
from ..nodes._coordinator import Nodes
from ..ops._health import HealthCheck
from ..retention.applier import Retention
from ..store._journal import Journal
from ..store._lanes import Lanes
from ..store._mounts import is_local, mount_table
from ..store._routed import RoutedStorage
from ..store._storage import Storage
from ..store._trash import TrashRemover
from ._connection import Connection
from ._drain import Drainer
from ._owners import AttemptDirs
from ._promotion import Promoter
from ._requests import VERSION, Requests
from ._tierrestore import Restorer
from ._tiers import TierSaves

__all__ = ["VERSION", "Daemon"]


class Daemon(Requests):
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
        self.storage: Storage = storage or RoutedStorage()
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
        self._local = {
            r.path
            for r in config.roots
            if not r.on_object_store and is_local(r.real or r.path, mounts)
        }
        """Roots on a local filesystem: their per-save checks run on the event loop."""
        self.nodes = Nodes(self, run=self._run_for, local_roots=self._local)
        """Saves that span nodes: the attempt agreed, markers written and watched."""
        self.promoter.claimed = self.nodes.follow_later
        self.nodes.promote = self.promoter.start
        self._internal: set[int] = set()
        self.tiers = TierSaves(self)
        """Saves into roots' fast tiers (docs/tiers.md)."""
        self.drainer = Drainer(self, self.tiers)
        """Drains fast-tier steps to their durable roots."""
        self.restorer = Restorer(self, self.tiers)
        """Answers ``restore``."""

    def internal_conn(self) -> int:
        """A connection id for the daemon's own requests (a drain's writers)."""
        conn = next(self._conn_ids)
        self._internal.add(conn)
        return conn

    async def begin_internal(self, conn: int, request: p.Begin) -> p.BeginReply:
        """``begin`` on the durable root itself, for a drain (never the fast tier)."""
        return await self._begin(conn, request)

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

    def settling(self, key: SaveKey) -> bool:
        """Whether ``key`` was settled by a change the journal does not have yet.

        The ledger moves a save to its end state at once, but the change's effects (the
        failed attempt's set-aside, the failure marker, the woken waiters) are held back
        until it is durable (:meth:`commit`): until then nobody is told.
        """
        return any(
            isinstance(effect, Settled | SetAside | NodeFailed) and effect.key == key
            for _, effects in self._held
            for effect in effects
        )

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

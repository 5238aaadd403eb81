"""The daemon: a Unix-socket server feeding the ledger and carrying out its effects.

One task per connection reads lines, decodes typed requests and answers each in order
(``wait`` replies later, from its own task). Ledger effects become events, promotions
and woken waiters. Promotions run in worker threads inside shielded scopes and finish
even while the daemon shuts down.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import stat
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from importlib.metadata import PackageNotFoundError, version

import anyio
import msgspec
from anyio.abc import SocketAttribute, SocketListener, SocketStream, TaskGroup, TaskStatus

from orchestrator import protocol as p

from . import _gc, _systemd
from ._config import Config, RootConfig
from ._connection import Connection
from ._errors import ConfigError, PromotionError, RequestError, VerificationError
from ._events import Events
from ._ledger import Effect, Emit, Ledger, SaveKey, SaveRecord, Settled, Verify
from ._paths import check_relative, check_tmp_dir
from ._promoter import LocalStorage, Storage, latest_promoted, promote
from ._verify import scan_save

__all__ = ["Daemon", "serve"]

try:
    VERSION = version("ckptd")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    VERSION = "0+unknown"

_SETTLED = (p.SaveState.PROMOTED, p.SaveState.FAILED)
_ORPHAN_AGE = 3600.0


class Daemon:
    """The state and request handling of one daemon, independent of how it listens.

    Args:
        config: Validated configuration.
        storage: Filesystem writes used by promotion.
        clock: Monotonic clock in seconds; the ledger sees time only through it.
    """

    def __init__(
        self,
        config: Config,
        *,
        storage: Storage | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.events = Events()
        self.ledger = Ledger(lease=config.lease, save_timeout=config.save_timeout)
        self._storage = storage or LocalStorage()
        self._clock = clock
        self._started = clock()
        self._conn_ids = itertools.count(1)
        self._connections = 0
        self._waiters: dict[SaveKey, anyio.Event] = {}
        self._root_locks = {root.path: anyio.Lock() for root in config.roots}
        self._changed = anyio.Event()
        self._promotions: TaskGroup | None = None
        self.stopping = False

    # -- effects -----------------------------------------------------------------------

    def apply(self, effects: Sequence[Effect]) -> None:
        """Carry out ledger effects: events, promotions, woken waiters."""
        for effect in effects:
            if isinstance(effect, Emit):
                self.events.emit(effect.name, effect.level, **effect.fields)
            elif isinstance(effect, Verify):
                assert self._promotions is not None, "promotions start only while serving"
                self._promotions.start_soon(self._promote, effect.key)
            elif isinstance(effect, Settled):
                waiter = self._waiters.pop(effect.key, None)
                if waiter is not None:
                    waiter.set()
        self._changed.set()

    async def _promote(self, key: SaveKey) -> None:
        with anyio.CancelScope(shield=True):
            root = self._root(key.root)
            async with self._root_locks[root.path]:
                save = self.ledger.get(key)
                if save is None or save.state is not p.SaveState.VERIFYING:
                    return
                start = self._clock()
                try:
                    manifest = await anyio.to_thread.run_sync(
                        scan_save, root, key.step, save.world_size, save.reported_files()
                    )
                    self.apply(self.ledger.verified(key))
                    done = await anyio.to_thread.run_sync(
                        promote, self._storage, root, key.step, manifest
                    )
                except VerificationError as exc:
                    reason = f"verification failed: {exc}"
                    self.apply(self.ledger.rejected(key, reason, self._clock()))
                    return
                except PromotionError as exc:
                    reason = f"promotion failed: {exc}"
                    self.apply(self.ledger.rejected(key, reason, self._clock()))
                    return
                except Exception as exc:  # a bug must fail the save, not kill the daemon
                    self.events.emit(
                        "daemon.internal_error", "error", where="promote", error=repr(exc)
                    )
                    self.apply(self.ledger.rejected(key, f"internal error: {exc!r}", self._clock()))
                    return
                if done.pointer_error is not None:
                    self.events.emit(
                        "pointer.failed",
                        "error",
                        root=key.root,
                        step=key.step,
                        reason=done.pointer_error,
                    )
                now = self._clock()
                self.apply(
                    self.ledger.promoted(
                        key,
                        done.path,
                        now,
                        bytes=manifest.bytes,
                        files=len(manifest.files),
                        promotion_ms=round((now - start) * 1000, 3),
                        latest=done.pointer_moved,
                    )
                )

    async def timekeeper(self) -> None:
        """Fail saves whose lease or deadline passes, waking exactly when one does."""
        while True:
            self._changed = anyio.Event()
            deadline = self.ledger.next_deadline()
            if deadline is None:
                await self._changed.wait()
            else:
                with anyio.move_on_after(max(0.0, deadline - self._clock())):
                    await self._changed.wait()
            effects = self.ledger.tick(self._clock())
            if effects:
                self.apply(effects)

    # -- connections ---------------------------------------------------------------------

    async def handle_connection(self, stream: SocketStream) -> None:
        """Serve one client until it disconnects or the daemon stops."""
        conn = next(self._conn_ids)
        async with stream:
            if self._connections >= self.config.max_connections:
                reply = _error(None, p.ErrorCode.TOO_BUSY, "too many connections; retry later")
                await _send_quietly(stream, reply)
                return
            self._connections += 1
            peer = _peer_credentials(stream)
            self.events.emit("client.connected", "info", conn=conn, **peer)
            try:
                await Connection(self, conn, stream).run()
            except Exception as exc:  # connection boundary: never take the daemon down
                self.events.emit("daemon.internal_error", "error", conn=conn, error=repr(exc))
            finally:
                self._connections -= 1
                self.apply(self.ledger.disconnect(conn, self._clock()))
                self.events.emit("client.disconnected", conn=conn)

    async def dispatch(self, conn: int, request: p.Request) -> msgspec.Struct:
        """Answer one request other than ``wait`` and ``subscribe``.

        Raises:
            RequestError: the request must be refused.
        """
        now = self._clock
        match request:
            case p.Ping():
                return p.PingReply(id=request.id, version=VERSION)
            case p.Begin(root=root_path, step=step, rank=rank, world_size=world_size):
                root = self.configured(root_path)
                if self.stopping:
                    raise RequestError(p.ErrorCode.SHUTTING_DOWN, "the daemon is stopping")
                key = SaveKey(root.path, step)
                if self.ledger.get(key) is None:
                    await anyio.to_thread.run_sync(check_tmp_dir, root, step)
                self.apply(self.ledger.begin(key, rank, world_size, conn, now()))
                save = self.ledger.get(key)
                assert save is not None
                return p.BeginReply(id=request.id, path=root.tmp_dir(step), state=save.state)
            case p.Done(root=root_path, step=step, rank=rank, files=files):
                root = self.configured(root_path)
                for entry in files:
                    check_relative(entry.path)
                self.apply(self.ledger.done(SaveKey(root.path, step), rank, files, conn, now()))
                return p.Ack(id=request.id)
            case p.Fail(root=root_path, step=step, rank=rank, reason=reason):
                root = self.configured(root_path)
                self.apply(self.ledger.fail(SaveKey(root.path, step), rank, reason, now()))
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
                    layouts=[
                        p.RootInfo(r.path, r.tmp_prefix, r.final_prefix, r.pointer)
                        for r in self.config.roots
                    ],
                )
            case p.Latest(root=root_path):
                root = self.configured(root_path)
                step_found = await anyio.to_thread.run_sync(latest_promoted, root)
                if step_found is None:
                    raise RequestError(p.ErrorCode.NOT_FOUND, f"{root.path} has no promoted step")
                path = root.final_dir(step_found)
                return p.LatestReply(id=request.id, path=path, step=step_found)
            case p.Gc(root=root_path, remove=remove):
                root = self.configured(root_path)
                return await self._gc(request.id, root, remove)
        raise RequestError(p.ErrorCode.UNKNOWN_OP, f"unhandled op {type(request).__name__}")

    async def settled(self, request: p.Wait, root: RootConfig) -> p.WaitReply:
        """The reply to ``wait``, once the step settles or ``request.timeout`` passes."""
        key = SaveKey(root.path, request.step)
        with anyio.move_on_after(request.timeout):
            while (save := self.ledger.get(key)) is None or save.state not in _SETTLED:
                if save is None and await anyio.to_thread.run_sync(
                    os.path.isdir, root.final_dir(request.step)
                ):
                    break
                await self._waiters.setdefault(key, anyio.Event()).wait()
        save = self.ledger.get(key)
        if save is None:
            final = root.final_dir(key.step)
            if await anyio.to_thread.run_sync(os.path.isdir, final):
                return p.WaitReply(id=request.id, state="promoted", path=final)
            return p.WaitReply(id=request.id, state="pending")
        if save.state is p.SaveState.PROMOTED:
            return p.WaitReply(id=request.id, state="promoted", path=save.path)
        if save.state is p.SaveState.FAILED:
            return p.WaitReply(id=request.id, state="failed", reason=save.reason)
        return p.WaitReply(id=request.id, state="pending")

    async def _gc(self, request_id: int, root: RootConfig, remove: bool) -> p.GcReply:
        failed = {
            s.key.step
            for s in self.ledger
            if s.key.root == root.path and s.state is p.SaveState.FAILED
        }
        active = {
            s.key.step
            for s in self.ledger
            if s.key.root == root.path and s.state not in (p.SaveState.FAILED, p.SaveState.PROMOTED)
        }
        # An unknown tmp dir counts as orphaned only once it could no longer be a save
        # whose ranks write before they begin.
        min_age = self.config.save_timeout or _ORPHAN_AGE
        on_disk = await anyio.to_thread.run_sync(_gc.candidates, root, failed, active, min_age)
        # A failed save with no directory left is still listed, so gc can clear it.
        candidates = sorted(set(on_disk) | failed)
        if remove and candidates:
            async with self._root_locks[root.path]:
                await anyio.to_thread.run_sync(_gc.remove, root, candidates)
            for step in candidates:
                self.ledger.forget(SaveKey(root.path, step))
            self.events.emit("gc.removed", root=root.path, steps=sorted(candidates))
        paths = [root.tmp_dir(step) for step in sorted(candidates)]
        return p.GcReply(id=request_id, candidates=paths, removed=remove and bool(candidates))

    # -- helpers -----------------------------------------------------------------------

    def configured(self, path: str) -> RootConfig:
        """The configured root ``path`` names.

        Raises:
            RequestError: ``path`` is not absolute and normalised, or not configured.
        """
        root = self.config.root_for(path)
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

    def _root(self, path: str) -> RootConfig:
        root = self.config.root_for(path)
        assert root is not None
        return root

    def _info(self, save: SaveRecord) -> p.SaveInfo:
        now = self._clock()
        ranks = [
            p.RankInfo(
                rank=rank,
                state=rec.state,
                connected=rec.conn is not None,
                files=len(rec.files),
                bytes=sum(f.size for f in rec.files),
                lease_s=None if rec.lease_deadline is None else round(rec.lease_deadline - now, 3),
                reason=rec.reason,
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
        )


async def serve(
    config: Config,
    *,
    storage: Storage | None = None,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    handle_signals: bool = True,
    task_status: TaskStatus[Daemon] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run a daemon until SIGTERM/SIGINT (or ``shutdown_trigger`` returns).

    Listens on the socket systemd passed in (``LISTEN_FDS``), else on ``config.socket``.
    On stop: stops accepting, closes connections, lets in-flight promotions finish.
    A second SIGINT exits at once.

    Raises:
        ConfigError: the socket cannot be created (e.g. another daemon owns it).
    """
    daemon = Daemon(config, storage=storage)
    inherited = _systemd.listen_unix_socket()
    sock = inherited or _bind(config.socket, config.socket_mode)
    identity = None if inherited else os.lstat(config.socket)
    listener = await SocketListener.from_socket(sock)
    stop = anyio.Event()
    try:
        async with anyio.create_task_group() as promotions:
            daemon._promotions = promotions
            async with anyio.create_task_group() as tg:
                tg.start_soon(daemon.timekeeper)
                tg.start_soon(_accept, listener, daemon, tg)
                if handle_signals:
                    tg.start_soon(_watch_signals, stop, daemon)
                if shutdown_trigger is not None:
                    tg.start_soon(_trigger, shutdown_trigger, stop)
                watchdog = _systemd.watchdog_interval()
                if watchdog is not None:
                    tg.start_soon(_watchdog, watchdog / 2)
                daemon.events.emit(
                    "daemon.ready",
                    socket=sock.getsockname() or config.socket,
                    roots=[r.path for r in config.roots],
                    pid=os.getpid(),
                    version=VERSION,
                    inherited_socket=inherited is not None,
                )
                _systemd.notify_ready("serving")
                task_status.started(daemon)
                await stop.wait()
                daemon.stopping = True
                _systemd.notify_stopping()
                daemon.events.emit("daemon.stopping")
                tg.cancel_scope.cancel()
    finally:
        await listener.aclose()
        if identity is not None:
            _unlink_if_ours(config.socket, identity)
    daemon.events.emit("daemon.stopped")


async def _accept(listener: SocketListener, daemon: Daemon, tg: TaskGroup) -> None:
    while True:
        stream = await listener.accept()
        tg.start_soon(daemon.handle_connection, stream)


async def _trigger(trigger: Callable[[], Awaitable[object]], stop: anyio.Event) -> None:
    await trigger()
    stop.set()


async def _watch_signals(stop: anyio.Event, daemon: Daemon) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            if not stop.is_set():
                daemon.events.emit("daemon.signal", signal=signal.Signals(signum).name)
                stop.set()
            elif signum == signal.SIGINT:
                daemon.events.emit("daemon.forced_exit", "error", signal="SIGINT")
                os._exit(130)


async def _watchdog(period: float) -> None:
    while True:
        _systemd.notify_watchdog()
        await anyio.sleep(period)


def _bind(path: str, mode: int) -> socket.socket:
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o750, exist_ok=True)
    if os.path.lexists(path):
        _remove_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o777 & ~mode)  # the file never exists with looser bits
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot bind {path}: {exc.strerror}") from exc
    finally:
        os.umask(old_umask)
    os.chmod(path, mode)
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def _remove_stale(path: str) -> None:
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise ConfigError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)  # nobody listens: a stale socket from a crashed daemon
        return
    except OSError as exc:
        raise ConfigError(f"cannot probe existing socket {path}: {exc.strerror}") from exc
    finally:
        probe.close()
    raise ConfigError(f"another daemon is listening on {path}")


def _unlink_if_ours(path: str, identity: os.stat_result) -> None:
    # Only the file this daemon bound: a successor may already have bound a new one.
    try:
        if os.path.samestat(os.lstat(path), identity):
            os.unlink(path)
    except OSError:
        pass


def _peer_credentials(stream: SocketStream) -> dict[str, int]:
    raw = stream.extra(SocketAttribute.raw_socket)
    data = raw.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", data)
    return {"pid": pid, "uid": uid, "gid": gid}


def _error(request_id: int | None, code: p.ErrorCode, message: str) -> p.ErrorReply:
    return p.ErrorReply(id=request_id, error=p.ErrorInfo(code=code.value, message=message))


async def _send_quietly(stream: SocketStream, message: msgspec.Struct) -> None:
    try:
        await stream.send(p.encode(message))
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass

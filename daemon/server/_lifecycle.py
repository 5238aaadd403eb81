"""The daemon's process lifecycle: listen, recover, serve, stop.

Hypercorn's shape, written with anyio: ``serve`` binds (or inherits from systemd) the
socket, rebuilds state from the journal, starts accepting, says ``daemon.ready`` and
``READY=1``, and on SIGTERM/SIGINT stops accepting, closes connections and lets
promotions in flight finish. A second SIGINT exits at once.
"""

from __future__ import annotations

import asyncio
import faulthandler
import os
import signal
import socket
import stat
import sys
from collections.abc import Awaitable, Callable

import anyio
from anyio.abc import SocketListener, TaskGroup, TaskStatus

from ..base._errors import ConfigError
from ..base._events import flush_logging
from ..config._config import Config
from ..ops._exporter import Exporter
from ..store._journal import Journal
from ..store._storage import Storage
from . import _systemd
from ._recovery import recover
from ._reloader import Reloader
from ._server import VERSION, Daemon

__all__ = ["serve"]


async def serve(
    config: Config,
    *,
    storage: Storage | None = None,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    handle_signals: bool = True,
    reload_config: Callable[[], Config] | None = None,
    task_status: TaskStatus[Daemon] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run a daemon until SIGTERM/SIGINT (or ``shutdown_trigger`` returns).

    Listens on the socket systemd passed in (``LISTEN_FDS``), else on ``config.socket``.
    Before accepting, rebuilds its state from the journal in ``config.state_dir`` and
    finishes whatever a previous run left half done. On stop: stops accepting, closes
    connections, lets in-flight promotions finish. SIGHUP reloads the configuration with
    ``reload_config`` (:mod:`daemon.server._reloader`); SIGUSR1 writes every thread's stack to
    stderr. Metrics are kept and exported when ``config`` asks for them.

    Raises:
        ConfigError: the socket or the journal cannot be used (e.g. another daemon owns
            it).
    """
    inherited = _systemd.listen_unix_socket()
    sock = inherited or _bind(config.socket, config.socket_mode)
    identity = None if inherited else os.lstat(config.socket)
    listener = await SocketListener.from_socket(sock)
    journal = Journal(os.path.join(config.state_dir, "journal"))
    stop = anyio.Event()
    exporter: Exporter | None = None
    try:
        try:
            replay = await journal.lane.run(journal.open)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot use the journal {journal.path}: {exc}") from exc
        daemon = Daemon(config, storage=storage, journal=journal)
        if Exporter.wanted(config):
            exporter = Exporter(config, daemon, daemon.events, version=VERSION)
            exporter.start()
            journal.on_flush = exporter.metrics.flushed
        if handle_signals:
            dump_stacks_on(signal.SIGUSR1)
        async with anyio.create_task_group() as promotions:
            daemon.promoter.group = promotions
            daemon.attempt_dirs.group = promotions
            daemon.nodes.group = promotions
            daemon.tiers.group = promotions
            async with anyio.create_task_group() as services:
                reloader = Reloader(daemon, reload_config, services)
                if handle_signals:  # before anything slow: a SIGTERM is never lost
                    await services.start(_watch_signals, stop, daemon, reloader)
                services.start_soon(journal.run, daemon.journal_snapshot)
                await services.start(daemon.lanes.serve)
                await recover(daemon, replay)
                daemon.trash.start()  # also deletes what a previous run doomed
                await services.start(daemon.retention.serve)
                services.start_soon(daemon.timekeeper)
                daemon.drainer.group = services
                await daemon.tiers.recover()
                services.start_soon(daemon.drainer.watch)
                if exporter is not None:
                    services.start_soon(exporter.write_textfile)
                if shutdown_trigger is not None:
                    services.start_soon(_trigger, shutdown_trigger, stop)
                watchdog = _systemd.watchdog_interval()
                if watchdog is not None:
                    services.start_soon(_watchdog, watchdog, daemon, journal)
                async with anyio.create_task_group() as connections:
                    connections.start_soon(_accept, listener, daemon, connections)
                    daemon.events.emit(
                        "daemon.ready",
                        socket=sock.getsockname() or config.socket,
                        roots=[r.path for r in config.roots],
                        pid=os.getpid(),
                        version=VERSION,
                        inherited_socket=inherited is not None,
                        state_dir=config.state_dir,
                        event_loop=_loop_name(),
                    )
                    _systemd.notify_ready("serving")
                    reloader.ready.set()
                    task_status.started(daemon)
                    await stop.wait()
                    daemon.tiers.stopping = True
                    await daemon.drainer.stop()  # the newest local steps, within grace
                    daemon.stopping = True
                    _systemd.notify_stopping()
                    daemon.events.emit("daemon.stopping")
                    connections.cancel_scope.cancel()
                await listener.aclose()
                # Promotions in flight are shielded: let them finish and journal their
                # outcome before the journal writer stops; so are the set-asides of the
                # attempts they failed, which journal where the files went, and the
                # nodes' looks, markers and failures under way. Each may start another
                # (a look that finds the last marker, a promotion that fails): wait
                # until none is left.
                daemon.nodes.close()  # watches stop; what is under way finishes
                while daemon.nodes.busy or daemon.promoter.busy or daemon.attempt_dirs.busy:
                    await daemon.nodes.idle()
                    await daemon.promoter.idle()
                    await daemon.attempt_dirs.idle()
                await daemon.retention.stop()  # while the journal still writes
                services.cancel_scope.cancel()
        daemon.trash.close()
        daemon.events.emit("daemon.stopped")
    finally:
        if exporter is not None:
            exporter.close()
        if handle_signals:
            faulthandler.unregister(signal.SIGUSR1)
        journal.close()
        await listener.aclose()
        if identity is not None:
            _unlink_if_ours(config.socket, identity)


async def _accept(listener: SocketListener, daemon: Daemon, tg: TaskGroup) -> None:
    while True:
        stream = await listener.accept()
        tg.start_soon(daemon.handle_connection, stream)


async def _trigger(trigger: Callable[[], Awaitable[object]], stop: anyio.Event) -> None:
    await trigger()
    stop.set()


async def _watch_signals(
    stop: anyio.Event,
    daemon: Daemon,
    reloader: Reloader,
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        task_status.started()
        async for signum in signals:
            if signum == signal.SIGHUP:
                daemon.events.emit("daemon.signal", signal="SIGHUP")
                if not stop.is_set():
                    reloader.request()
            elif not stop.is_set():
                daemon.events.emit("daemon.signal", signal=signal.Signals(signum).name)
                stop.set()
            elif signum == signal.SIGINT:
                daemon.events.emit("daemon.forced_exit", "error", signal="SIGINT")
                flush_logging(1.0)  # os._exit skips atexit: get the last lines out
                os._exit(130)


async def _watchdog(interval: float, daemon: Daemon, journal: Journal) -> None:
    """Ping systemd every ``interval / 2`` seconds while the daemon can do its job.

    The pings come from the event loop, so a loop that is blocked stops them. So does a
    journal write, fsync or compaction still running after ``interval`` seconds: no
    change can be acknowledged, and systemd restarts the daemon ``interval`` after the
    last ping. A stalled checkpoint root does not stop them: a restart would not unhang
    its filesystem, and the other roots still work.
    """
    withheld = False
    while True:
        blocked = journal.lane.busy_for()
        if blocked < interval:
            if withheld:
                withheld = False
                daemon.events.emit("watchdog.resumed", path=journal.path)
            _systemd.notify_watchdog()
        elif not withheld:
            withheld = True
            daemon.events.emit(
                "watchdog.withheld",
                "error",
                path=journal.path,
                blocked_s=round(blocked, 3),
                reason="a journal write has not returned within the watchdog interval",
            )
        await anyio.sleep(interval / 2)


def dump_stacks_on(signum: int) -> None:
    """Write every thread's Python stack to stderr when ``signum`` arrives.

    faulthandler writes from its C signal handler, so the dump comes even while the event
    loop is blocked (the case it is for); the daemon then goes on as before.
    """
    faulthandler.register(signum, file=sys.stderr, all_threads=True, chain=False)


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


def _loop_name() -> str:
    """``uvloop`` or ``asyncio``: the event loop the daemon runs on."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"

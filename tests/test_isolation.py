"""Isolation (invariant 9): a hung filesystem under one root delays only that root.

Root A is served through bindfs, whose FUSE server is SIGSTOPped to hang every call on
it, as an NFS server that went away hangs its clients; root B is a plain directory. The
daemon must keep serving B, keep its journal committing, say that A is stalled, answer
A's requests once A answers again, and keep pinging systemd's watchdog only while its
journal works.
"""

from __future__ import annotations

import json
import os
import select
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import closing
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from daemon.base._errors import ConfigError
from daemon.cli import main
from daemon.config._config import Config, RootConfig, load_config
from daemon.server._lifecycle import serve
from daemon.server._server import Daemon
from daemon.store._lanes import Lane
from daemon.store._local import LocalStorage
from tests._fuse import BindMount, bindfs_mount
from tests._nodes import wait_until
from tests.conftest import DaemonProcess, LineClient

pytestmark = pytest.mark.waits

TIMEOUT = 15.0
"""Liveness bound on anything the tests wait for."""
STALL = 0.5
"""``fs_stall_after`` in these tests: a call blocked for half a second is reported."""
CLIENTS = 64
THREADS = 4
"""``root_threads`` where a test counts them."""
CACHING = "entry_timeout=3600,attr_timeout=3600"
"""bindfs options under which the root's own attributes are answered from the kernel's
cache while the server is stopped (so only calls that must reach it hang)."""

Start = Callable[..., DaemonProcess]
Files = list[dict[str, Any]]


# -- helpers -------------------------------------------------------------------------------


def config_file(tmp_path: Path, **values: object) -> Path:
    """A TOML file setting ``fs_stall_after`` to :data:`STALL` and ``values``."""
    path = tmp_path / "ckptd.toml"
    lines = [f"fs_stall_after = {STALL}"] + [f"{k} = {v!r}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def backing(tmp_path: Path, name: str = "a-backing") -> Path:
    path = tmp_path / name
    path.mkdir()
    return path


def connect(daemon: DaemonProcess) -> closing[LineClient]:
    return closing(LineClient(daemon.socket_path, timeout=TIMEOUT))


def line(op: str, rid: int, **fields: Any) -> bytes:
    return json.dumps({"op": op, "id": rid, **fields}).encode() + b"\n"


def ok(reply: dict[str, Any]) -> dict[str, Any]:
    assert reply.get("ok") is True, reply
    return reply


def write_files(tmp: Path, rank: int) -> Files:
    """Two real files of ``rank`` in ``tmp``, listed as ``done`` lists them."""
    entries: Files = []
    for i in range(2):
        path = tmp / f"model/rank{rank}-{i}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 100)
        entries.append({"path": f"model/rank{rank}-{i}.bin", "size": 100})
    return entries


def begin(client: LineClient, root: Path, step: int, world_size: int = 1) -> dict[str, Any]:
    return client.request("begin", root=str(root), step=step, rank=0, world_size=world_size)


def save(daemon: DaemonProcess, root: Path, step: int) -> dict[str, Any]:
    """A whole one-rank save: begin, write, done, then ``wait``; returns its reply."""
    with connect(daemon) as client:
        ok(begin(client, root, step))
        files = write_files(root / f"tmp_step_{step}", 0)
        ok(client.request("done", root=str(root), step=step, rank=0, files=files))
        return client.request("wait", root=str(root), step=step, timeout=TIMEOUT)


def ask_hung_root(daemon: DaemonProcess, root: Path) -> list[LineClient]:
    """:data:`CLIENTS` connections, each with one ``latest`` or ``wait`` on ``root``."""
    askers = [LineClient(daemon.socket_path, timeout=TIMEOUT) for _ in range(CLIENTS)]
    for i, asker in enumerate(askers):
        if i % 2:
            asker.send_raw(line("latest", 1, root=str(root)))
        else:  # a step nobody saves: the daemon looks for step_N on disk
            asker.send_raw(line("wait", 1, root=str(root), step=1000 + i, timeout=1.0))
    return askers


def of_root(root: Path) -> Callable[[dict[str, Any]], bool]:
    return lambda event: event.get("root") == str(root)


# -- a hung root -----------------------------------------------------------------------------


class TestHungRoot:
    """While root A's filesystem hangs, root B saves, and A's requests wait for A only."""

    def test_other_root_saves_while_one_hangs(
        self, start: Start, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        root_b = tmp_path / "b"
        root_b.mkdir()
        with bindfs_mount(backing(tmp_path), tmp_path / "a") as fs:
            root_a = fs.mount
            config = config_file(tmp_path, root_threads=THREADS)
            daemon = start([root_a, root_b], "--config", str(config))
            with connect(daemon) as writer:
                ok(begin(writer, root_a, 7))
                files = write_files(root_a / "tmp_step_7", 0)
                fs.stop()
                # Acknowledged from the journal; its verification then hangs in A's lane.
                ok(writer.request("done", root=str(root_a), step=7, rank=0, files=files))
                askers = ask_hung_root(daemon, root_a)
                try:
                    stalled = daemon.wait_event("root.stalled", TIMEOUT, of_root(root_a))
                    assert stalled["level"] == "warning"
                    assert stalled["blocked_s"] >= STALL
                    assert ok(save(daemon, root_b, 1))["state"] == "promoted"

                    with connect(daemon) as client:
                        [stall] = ok(client.request("status"))["stalled"]
                    assert stall["root"] == str(root_a)
                    assert stall["running"] == THREADS
                    assert stall["queued"] >= 1
                    capsys.readouterr()
                    assert main(["status", "--socket", str(daemon.socket_path)]) == 0
                    assert f"stalled: {root_a}: " in capsys.readouterr().out

                    fs.cont()
                    for asker in askers:  # every one of A's requests is answered now
                        reply = asker.recv()
                        assert reply["id"] == 1
                        if reply.get("ok"):
                            assert reply.get("state") == "pending" or reply.get("step") == 7
                        else:
                            assert reply["error"]["code"] == "not_found", reply
                finally:
                    for asker in askers:
                        asker.close()
                reply = writer.request("wait", root=str(root_a), step=7, timeout=TIMEOUT)
                assert ok(reply)["state"] == "promoted"
            recovered = daemon.wait_event("root.recovered", TIMEOUT, of_root(root_a))
            assert recovered["stalled_s"] >= STALL
            with connect(daemon) as client:
                assert ok(client.request("status"))["stalled"] == []
            assert daemon.stop() == 0
        assert not any(
            e.get("root") == str(root_b) for e in daemon.drain() if "stall" in e["event"]
        )

    def test_starts_and_serves_while_a_root_hangs(self, start: Start, tmp_path: Path) -> None:
        root_b = tmp_path / "b"
        root_b.mkdir()
        data = backing(tmp_path)
        (data / "tmp_step_9").mkdir()  # an orphan: no journal knows it
        with bindfs_mount(data, tmp_path / "a", CACHING) as fs:
            root_a = fs.mount
            assert root_a.is_dir()  # cached: the daemon's configuration check is answered
            fs.stop()
            daemon = start([root_a, root_b], "--config", str(config_file(tmp_path)))
            recovered = daemon.wait_event("daemon.recovered", TIMEOUT)
            assert recovered["unscanned"] == [str(root_a)]
            assert recovered["orphans"] == 0
            stalled = daemon.wait_event("root.stalled", TIMEOUT, of_root(root_a))
            assert stalled["call"] == "write_layout"  # the root's first call at start-up
            assert ok(save(daemon, root_b, 1))["state"] == "promoted"
            fs.cont()
            orphan = daemon.wait_event("save.orphaned", TIMEOUT, of_root(root_a))
            assert (orphan["step"], orphan["path"]) == (9, str(root_a / "tmp_step_9"))
            daemon.wait_event("root.recovered", TIMEOUT, of_root(root_a))
            assert daemon.stop() == 0


# -- the journal -----------------------------------------------------------------------------


async def _request(stream: SocketStream, op: str, **fields: Any) -> None:
    await stream.send(line(op, 1, **fields))


async def _reply(stream: SocketStream) -> dict[str, Any]:
    """The next line ``stream`` receives; the daemon sends it nothing before it."""
    reader = BufferedByteReceiveStream(stream)
    reply: dict[str, Any] = json.loads(await reader.receive_until(b"\n", 1 << 20))
    return reply


def _hanging_requests(root: Path) -> list[tuple[str, dict[str, Any]]]:
    """Requests on ``root`` of every kind that makes blocking calls there."""
    path = str(root)
    kinds: list[tuple[str, dict[str, Any]]] = []
    for i in range(24):
        kinds.append(("latest", {"root": path}))
        kinds.append(("wait", {"root": path, "step": 500 + i, "timeout": 1.0}))
        kinds.append(("begin", {"root": path, "step": 600 + i, "rank": 0, "world_size": 2}))
    kinds += [("gc", {"root": path, "remove": False}) for _ in range(4)]
    kinds += [("promote", {"root": path, "step": 700 + i, "timeout": 1.0}) for i in range(4)]
    return kinds


class TestJournalThread:
    """The journal writes and fsyncs in a thread of its own, whatever hangs."""

    def test_commits_while_calls_on_a_root_hang(self, tmp_path: Path, short_dir: Path) -> None:
        root_b = tmp_path / "b"
        root_b.mkdir()
        with bindfs_mount(backing(tmp_path), tmp_path / "a") as fs:
            roots = tuple(RootConfig(path=str(r), real=str(r)) for r in (fs.mount, root_b))
            config = Config(
                socket=str(short_dir / "d.sock"),
                roots=roots,
                state_dir=str(short_dir / "state"),
                fs_stall_after=STALL,
            )
            anyio.run(self._scenario, config, fs, root_b)

    async def _scenario(self, config: Config, fs: BindMount, root_b: Path) -> None:
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            run = partial(serve, config, shutdown_trigger=stop.wait, handle_signals=False)
            daemon: Daemon = await tg.start(run)
            events = daemon.events.subscribe()
            fs.stop()
            hanging = []
            for op, fields in _hanging_requests(fs.mount):
                stream = await anyio.connect_unix(config.socket)
                await _request(stream, op, **fields)
                hanging.append(stream)
            with anyio.fail_after(TIMEOUT):
                async for event in events:
                    if event["event"] == "root.stalled" and event["root"] == str(fs.mount):
                        break
            daemon.events.unsubscribe(events)
            journal = daemon.journal
            assert journal is not None
            commits = journal.commits
            with anyio.fail_after(TIMEOUT):
                async with await anyio.connect_unix(config.socket) as b:
                    for step in range(20):  # each acknowledged only once it is durable
                        root = str(root_b)
                        await _request(b, "begin", root=root, step=step, rank=0, world_size=2)
                        assert (await _reply(b))["ok"] is True
            assert journal.commits >= commits + 20
            lane = daemon.lanes[str(fs.mount)]  # still hung: full, with more calls waiting
            assert (lane.running, lane.queued > 0) == (config.root_threads, True)
            fs.cont()
            with anyio.fail_after(TIMEOUT):
                for stream in hanging:  # all of A's requests are answered once A answers
                    assert (await _reply(stream))["id"] == 1
                    await stream.aclose()
            stop.set()


class _HangsMidFlush(LocalStorage):
    """Real writes; the first flush of a file under a mount first stops its FUSE server.

    So the promotion hangs exactly while it flushes, on the real mount: a hang the
    filesystem alone cannot time (verification reads the same mount just before).
    """

    def __init__(self, mounts: list[BindMount]) -> None:
        super().__init__()
        self._mounts = list(mounts)  # each is stopped once, then left to the test
        self._lock = threading.Lock()

    def fsync(self, path: str, *, directory: bool = False) -> None:
        with self._lock:
            for fs in self._mounts:
                if path.startswith(f"{fs.mount}/"):
                    fs.stop()
                    self._mounts.remove(fs)
                    break
        super().fsync(path, directory=directory)


class TestHungFlush:
    """Promotions hung while they flush hold their own root's threads, not other roots'."""

    def test_other_root_promotes_while_two_hang_mid_flush(
        self, tmp_path: Path, short_dir: Path
    ) -> None:
        root_b = tmp_path / "b"
        root_b.mkdir()
        with (
            bindfs_mount(backing(tmp_path, "a1-backing"), tmp_path / "a1") as a1,
            bindfs_mount(backing(tmp_path, "a2-backing"), tmp_path / "a2") as a2,
        ):
            paths = (a1.mount, a2.mount, root_b)
            config = Config(
                socket=str(short_dir / "d.sock"),
                roots=tuple(RootConfig(path=str(r), real=str(r)) for r in paths),
                state_dir=str(short_dir / "state"),
                fs_stall_after=STALL,
            )
            anyio.run(self._scenario, config, [a1, a2], root_b)

    async def _scenario(self, config: Config, hung: list[BindMount], root_b: Path) -> None:
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            run = partial(
                serve,
                config,
                storage=_HangsMidFlush(hung),
                shutdown_trigger=stop.wait,
                handle_signals=False,
            )
            daemon: Daemon = await tg.start(run)
            events = daemon.events.subscribe()
            # Each promotion flushes with as many threads as one may.
            waits = [await _save(config.socket, fs.mount, 1, files=16) for fs in hung]
            with anyio.fail_after(TIMEOUT):
                stalled: set[str] = set()
                async for event in events:
                    if event["event"] == "root.stalled":
                        assert event["call"] == "verify_and_promote"
                        stalled.add(event["root"])
                    if stalled == {str(fs.mount) for fs in hung}:
                        break
                daemon.events.unsubscribe(events)
                b = await _save(config.socket, root_b, 1, files=16)
                assert (await _reply(b))["state"] == "promoted"
                await b.aclose()
            for fs in hung:
                fs.cont()
            with anyio.fail_after(TIMEOUT):
                for stream in waits:
                    assert (await _reply(stream))["state"] == "promoted"
                    await stream.aclose()
            stop.set()


async def _save(path: str, root: Path, step: int, *, files: int) -> SocketStream:
    """A one-rank save of ``files`` files, begun and done; its ``wait`` is sent last."""
    stream = await anyio.connect_unix(path)
    await _request(stream, "begin", root=str(root), step=step, rank=0, world_size=1)
    assert (await _reply(stream))["ok"] is True
    entries = []
    for i in range(files):
        rel = f"model/shard{i}.bin"
        target = root / f"tmp_step_{step}" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(b"x" * 100)
        entries.append({"path": rel, "size": 100})
    await _request(stream, "done", root=str(root), step=step, rank=0, files=entries)
    assert (await _reply(stream))["ok"] is True
    await _request(stream, "wait", root=str(root), step=step, timeout=TIMEOUT)
    return stream


# -- the watchdog ----------------------------------------------------------------------------


WATCHDOG_USEC = 2_000_000
"""The watchdog interval the tests give the daemon (it pings every second)."""


@pytest.fixture
def notify_socket(short_dir: Path) -> Iterator[socket.socket]:
    """The datagram socket a daemon's ``$NOTIFY_SOCKET`` names, as systemd's."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(short_dir / "notify.sock"))
        yield sock


def watchdog_env(sock: socket.socket) -> dict[str, str]:
    return {"NOTIFY_SOCKET": sock.getsockname(), "WATCHDOG_USEC": str(WATCHDOG_USEC)}


def next_ping(sock: socket.socket, timeout: float = TIMEOUT) -> bool:
    """Whether a ``WATCHDOG=1`` arrives within ``timeout`` (other states are skipped)."""
    sock.settimeout(timeout)
    try:
        while b"WATCHDOG=1" not in sock.recv(4096).split(b"\n"):
            pass
    except TimeoutError:
        return False
    return True


def drain(sock: socket.socket) -> None:
    """Discard every datagram already received."""
    sock.setblocking(False)
    try:
        while True:
            sock.recv(4096)
    except BlockingIOError:
        pass


class TestFailureWhileTheJournalHangs:
    """A ``wait`` is told ``failed`` only once the failure is on disk and carried out."""

    def test_wait_holds_until_the_failure_is_durable_and_set_aside(
        self, start: Start, tmp_path: Path
    ) -> None:
        root = tmp_path / "run"
        root.mkdir()
        with bindfs_mount(backing(tmp_path, "state-backing"), tmp_path / "state") as fs:
            extra = ("--state-dir", str(fs.mount), "--config", str(config_file(tmp_path)))
            daemon = start([root], *extra)
            with connect(daemon) as rank, connect(daemon) as waiter:
                ok(begin(rank, root, 1))
                write_files(root / "tmp_step_1", 0)
                fs.stop()
                rank.send_raw(line("fail", 2, root=str(root), step=1, rank=0, reason="oom"))
                # The ledger has failed the step; the journal cannot take it yet.
                daemon.wait_event("journal.stalled", TIMEOUT)
                waiter.send_raw(line("wait", 1, root=str(root), step=1, timeout=TIMEOUT))
                # An answer now would say failed while the failure is not durable and
                # the attempt's files still lie where its next attempt will write.
                answered, _, _ = select.select([waiter.sock], [], [], 1.0)
                assert not answered, waiter.recv()
                assert (root / "tmp_step_1" / "model").is_dir()
                fs.cont()
                assert ok(waiter.recv())["state"] == "failed"
                assert not (root / "tmp_step_1").exists()  # set aside before the answer
                assert ok(rank.recv())["id"] == 2
            assert daemon.stop() == 0


class TestWatchdog:
    """systemd's watchdog is pinged only while the daemon can acknowledge changes."""

    def test_pings_stop_while_the_journal_hangs(
        self, start: Start, tmp_path: Path, notify_socket: socket.socket
    ) -> None:
        root = tmp_path / "run"
        root.mkdir()
        with bindfs_mount(backing(tmp_path, "state-backing"), tmp_path / "state") as fs:
            extra = ("--state-dir", str(fs.mount), "--config", str(config_file(tmp_path)))
            daemon = start([root], *extra, env=watchdog_env(notify_socket))
            assert next_ping(notify_socket)
            fs.stop()
            with connect(daemon) as writer:
                writer.send_raw(line("begin", 1, root=str(root), step=1, rank=0, world_size=1))
                stalled = daemon.wait_event("journal.stalled", TIMEOUT)
                assert stalled["path"] == str(fs.mount / "journal")
                withheld = daemon.wait_event("watchdog.withheld", TIMEOUT)
                assert withheld["blocked_s"] >= WATCHDOG_USEC / 1e6
                drain(notify_socket)  # pings sent before the event
                # Two intervals without a ping: systemd would have restarted the daemon.
                assert not next_ping(notify_socket, 2 * WATCHDOG_USEC / 1e6)
                with connect(daemon) as client:  # the event loop still runs
                    ok(client.request("ping"))
                fs.cont()
                assert ok(writer.recv())["state"] == "open"
            daemon.wait_event("watchdog.resumed", TIMEOUT)
            daemon.wait_event("journal.recovered", TIMEOUT)
            assert next_ping(notify_socket)
            assert daemon.stop() == 0

    def test_pings_go_on_while_a_root_hangs(
        self, start: Start, tmp_path: Path, notify_socket: socket.socket
    ) -> None:
        with bindfs_mount(backing(tmp_path), tmp_path / "a") as fs:
            extra = ("--config", str(config_file(tmp_path)))
            daemon = start([fs.mount], *extra, env=watchdog_env(notify_socket))
            fs.stop()
            askers = ask_hung_root(daemon, fs.mount)
            try:
                daemon.wait_event("root.stalled", TIMEOUT, of_root(fs.mount))
                drain(notify_socket)
                assert next_ping(notify_socket)
                assert next_ping(notify_socket)
                fs.cont()
                for asker in askers:
                    assert asker.recv()["id"] == 1
            finally:
                for asker in askers:
                    asker.close()
            assert daemon.stop() == 0
        assert not any(e["event"] == "watchdog.withheld" for e in daemon.drain())


# -- lanes and their configuration -----------------------------------------------------------


class TestLane:
    """A lane runs at most its threads' worth of calls; abandoned calls keep their thread."""

    def test_bounded_and_abandoned(self) -> None:
        gate = threading.Event()
        lock = threading.Lock()
        inside = [0, 0]  # now, most at once

        def blocked(value: int) -> int:
            with lock:
                inside[0] += 1
                inside[1] = max(inside[1], inside[0])
            gate.wait(TIMEOUT)
            with lock:
                inside[0] -= 1
            return value

        async def main() -> None:
            lane = Lane("test", 2)
            results: list[int] = []
            leaving = anyio.CancelScope()

            async def abandoned() -> None:
                with leaving:
                    await lane.run(blocked, -1, abandon=True)

            async def call(value: int) -> None:
                results.append(await lane.run(blocked, value))

            with anyio.fail_after(TIMEOUT):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(abandoned)
                    await anyio.wait_all_tasks_blocked()
                    leaving.cancel()  # its caller leaves; the call keeps its thread
                    for value in range(4):
                        tg.start_soon(call, value)
                    await anyio.wait_all_tasks_blocked()
                    assert (lane.running, lane.queued) == (2, 3)
                    gate.set()
            assert sorted(results) == [0, 1, 2, 3]
            assert inside[1] == 2
            # The abandoned call returns in its thread and ends on the loop in its own
            # time, not before its callers' calls: wait for that, then the lane is idle.
            idle = partial(wait_until, lambda: lane.running == 0, TIMEOUT, "the lane idle")
            await anyio.to_thread.run_sync(idle)
            assert (lane.running, lane.queued) == (0, 0)

        anyio.run(main)

    def test_errors_raised_in_the_caller(self) -> None:
        def missing() -> None:
            os.lstat("/nonexistent/ckptd-lane-test")

        async def main() -> None:
            lane = Lane("test", 1)
            with pytest.raises(FileNotFoundError):
                await lane.run(missing)
            assert await lane.run(len, "four") == 4  # the thread serves on

        anyio.run(main)


class TestLaneConfig:
    """``root_threads`` and ``fs_stall_after`` are validated and read from TOML."""

    def test_from_toml(self, tmp_path: Path) -> None:
        path = tmp_path / "c.toml"
        path.write_text("root_threads = 3\nfs_stall_after = 12.5\n")
        config = load_config(config_file=str(path), roots=[str(tmp_path)], env={})
        assert (config.root_threads, config.fs_stall_after) == (3, 12.5)

    @pytest.mark.parametrize(
        ("field", "value"), [("root_threads", 0), ("root_threads", 2.5), ("fs_stall_after", 0)]
    )
    def test_refused(self, tmp_path: Path, field: str, value: object) -> None:
        root = RootConfig(path=str(tmp_path))
        with pytest.raises(ConfigError, match=field):
            Config(roots=(root,), state_dir=str(tmp_path), **{field: value})  # type: ignore[arg-type]

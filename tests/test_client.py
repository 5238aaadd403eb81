"""The trainer-side client against real daemons: never stalls, reconnects, re-sends."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import BinaryIO

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from orchestrator import CheckpointClient, FileEntry
from orchestrator import protocol as p
from tests.conftest import REPO, DaemonProcess, LineClient


class TestDaemonDown:
    """With no daemon, training goes on and the client says so once."""

    def test_begin_does_not_wait_and_warns_once(
        self, short_dir: Path, root: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.WARNING, logger="orchestrator")
        client = CheckpointClient(str(short_dir / "nobody.sock"), begin_timeout=60.0)
        try:
            start = time.monotonic()
            results = [client.begin(str(root), step, 0, 1) for step in range(5)]
            elapsed = time.monotonic() - start
            for step in range(5):
                client.done(str(root), step, 0, [FileEntry("x", 1)])
        finally:
            client.close(timeout=1.0, report_timeout=0.0)
        # Five begins with a 60 s bound returned long before one bound elapsed.
        assert elapsed < 30.0
        assert all(not r.acknowledged for r in results)
        assert results[0].path == str(root / "tmp_step_0")
        warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(warnings) == 1
        assert str(short_dir / "nobody.sock") in warnings[0].getMessage()

    def test_queries_fail_clearly(self, short_dir: Path) -> None:
        with CheckpointClient(str(short_dir / "nobody.sock")) as client:
            assert client.ping(timeout=5.0) is False

    def test_a_process_exits_quietly(self, short_dir: Path, root: Path) -> None:
        # Its close gives up waiting for acknowledgements; nothing is left behind to be
        # reported at exit ("Task was destroyed but it is pending!" on stderr).
        script = (
            "import sys\n"
            "from orchestrator import CheckpointClient\n"
            "client = CheckpointClient(sys.argv[1])\n"
            "client.begin(sys.argv[2], 1, 0, 1)\n"
            "client.close(report_timeout=0.0)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script, str(short_dir / "nobody.sock"), str(root)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert "unreachable" in done.stderr  # said once, as promised
        assert "Task was destroyed" not in done.stderr, done.stderr


@contextlib.contextmanager
def _accepted(path: Path) -> Iterator[tuple[socket.socket, BinaryIO]]:
    """The first connection made to a socket bound at ``path``, and its lines; then unbound."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.settimeout(30.0)
        listener.bind(str(path))
        listener.listen()
        conn, _ = listener.accept()
        with conn, conn.makefile("rb") as lines:
            yield conn, lines
    path.unlink()


class TestReconnect:
    """Saves told to a client survive the daemon starting late or restarting."""

    def test_daemon_started_after_begin(
        self, daemon_factory: Callable[..., DaemonProcess], short_dir: Path, root: Path
    ) -> None:
        client = CheckpointClient(str(short_dir / "d.sock"), begin_timeout=5.0)
        try:
            begun = client.begin(str(root), 1, 0, 1)
            assert not begun.acknowledged
            daemon = daemon_factory([root])
            daemon.wait_event("save.begun", match=lambda e: e["step"] == 1)
            assert (root / "tmp_step_1").is_dir()  # begin() created it
            (root / "tmp_step_1" / "w.bin").write_bytes(b"w" * 10)
            client.done(str(root), 1, 0, [FileEntry("w.bin", 10)])
            assert client.wait(str(root), 1, 30.0).state == "promoted"
        finally:
            client.close(timeout=5.0)

    def test_daemon_restart_on_an_empty_state_directory(
        self, daemon_factory: Callable[..., DaemonProcess], short_dir: Path, root: Path
    ) -> None:
        daemon = daemon_factory([root])
        first = CheckpointClient(str(daemon.socket_path), begin_timeout=10.0, run="job-1")
        second = CheckpointClient(str(daemon.socket_path), begin_timeout=10.0, run="job-1")
        try:
            assert first.begin(str(root), 7, 0, 2).acknowledged
            (root / "tmp_step_7" / "r0.bin").write_bytes(b"0" * 10)
            first.done(str(root), 7, 0, [FileEntry("r0.bin", 10)])
            daemon.wait_event("save.rank_done", match=lambda e: e["rank"] == 0)
            daemon.kill()
            shutil.rmtree(daemon.state_dir)  # a requeue's prolog: only the root is left
            restarted = daemon_factory([root])
            # Rank 0 re-sends its ended save: begin naming the attempt, then its done.
            restarted.wait_event("save.rank_done", match=lambda e: e["rank"] == 0)
            assert second.begin(str(root), 7, 1, 2).acknowledged  # joins the run's attempt
            (root / "tmp_step_7" / "r1.bin").write_bytes(b"1" * 10)
            second.done(str(root), 7, 1, [FileEntry("r1.bin", 10)])
            assert second.wait(str(root), 7, 30.0).state == "promoted"
        finally:
            first.close(timeout=5.0)
            second.close(timeout=5.0)
        assert sorted(p.name for p in (root / "step_7").glob("r*.bin")) == ["r0.bin", "r1.bin"]

    def test_a_done_waits_for_its_begin_re_sent_on_a_lost_connection(
        self, daemon_factory: Callable[..., DaemonProcess], short_dir: Path, root: Path
    ) -> None:
        """After a reconnect a done goes only once this daemon answered its save's begin.

        Here the done is older than the begin re-sent for it on a connection lost before
        any answer. A daemon on an empty state directory knows the save only once that
        begin takes the attempt over from the root: a done ahead of it would be refused.
        """
        daemon = daemon_factory([root])
        client = CheckpointClient(
            str(daemon.socket_path), begin_timeout=10.0, reconnect_max=0.2, run="job-1"
        )
        try:
            assert client.begin(str(root), 7, 0, 1).acknowledged
            (root / "tmp_step_7" / "r0.bin").write_bytes(b"0" * 10)
            daemon.kill()
            shutil.rmtree(daemon.state_dir)  # a requeue's prolog: only the root is left
            daemon.socket_path.unlink()
            # A daemon that answers the re-sent begin, takes the done and dies.
            with _accepted(daemon.socket_path) as (conn, lines):
                begin = json.loads(lines.readline())
                assert begin["op"] == "begin" and begin["resent"]
                answer = p.BeginReply(
                    id=begin["id"],
                    path=str(root / "tmp_step_7"),
                    state=p.SaveState.OPEN,
                    attempt=begin["attempt"],
                )
                conn.sendall(p.encode(answer))
                client.done(str(root), 7, 0, [FileEntry("r0.bin", 10)])
                assert json.loads(lines.readline())["op"] == "done"
            # One that takes the begin re-sent there (newer than the done) and dies.
            with _accepted(daemon.socket_path) as (_, lines):
                assert json.loads(lines.readline())["op"] == "begin"
            daemon_factory([root])
            assert client.wait(str(root), 7, 20.0).state == "promoted"
        finally:
            client.close(timeout=5.0)
        assert (root / "step_7" / "r0.bin").read_bytes() == b"0" * 10

    def test_daemon_restart_mid_save(
        self, daemon_factory: Callable[..., DaemonProcess], short_dir: Path, root: Path
    ) -> None:
        daemon = daemon_factory([root])
        client = CheckpointClient(str(daemon.socket_path), begin_timeout=10.0)
        try:
            assert client.begin(str(root), 7, 0, 1).acknowledged
            daemon.kill()  # SIGKILL: everything in memory is gone
            restarted = daemon_factory([root])
            # The journal brought the save back; the client reconnects and re-attaches.
            assert restarted.wait_event("daemon.recovered")["in_flight"] == 1
            restarted.wait_event("save.rank_reconnected", match=lambda e: e["step"] == 7)
            assert (root / "tmp_step_7").is_dir()  # begin() created it
            (root / "tmp_step_7" / "r0.bin").write_bytes(b"0" * 10)
            client.done(str(root), 7, 0, [FileEntry("r0.bin", 10)])
            assert client.wait(str(root), 7, 30.0).state == "promoted"
        finally:
            client.close(timeout=5.0)
        assert (root / "step_7").is_dir()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 256 KiB tmpfs (needs root and CAP_SYS_ADMIN, which CI machines have)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def _fill(directory: Path) -> Path:
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


class TestJournalFull:
    """A done the daemon cannot make durable is not lost: the client sends it again."""

    def test_done_retried_until_durable(
        self, daemon_factory: Callable[..., DaemonProcess], root: Path, small_fs: Path
    ) -> None:
        daemon = daemon_factory([root], "--state-dir", str(small_fs / "state"))
        with CheckpointClient(str(daemon.socket_path)) as client:
            assert client.begin(str(root), 2, 0, 1).acknowledged
            assert (root / "tmp_step_2").is_dir()  # begin() created it
            (root / "tmp_step_2" / "w.bin").write_bytes(b"w")
            filler = _fill(small_fs)
            # Large enough that its journal record needs blocks the full disk lacks.
            client.done(str(root), 2, 0, [FileEntry("w.bin", 1)] * 1000)
            failed = daemon.wait_event("journal.failed")
            assert "space" in failed["error"].lower()
            assert not (root / "step_2").exists()  # never promoted on a non-durable done
            filler.unlink()
            assert client.wait(str(root), 2, 30.0).state == "promoted"

    def test_retry_is_not_acknowledged_until_durable(
        self, daemon_factory: Callable[..., DaemonProcess], root: Path, small_fs: Path
    ) -> None:
        daemon = daemon_factory([root], "--state-dir", str(small_fs / "state"))
        with LineClient(daemon.socket_path) as rank:
            assert rank.request("begin", root=str(root), step=3, rank=0, world_size=1)["ok"]
            (root / "tmp_step_3").mkdir(exist_ok=True)
            (root / "tmp_step_3" / "w.bin").write_bytes(b"w")
            filler = _fill(small_fs)
            files = [{"path": "w.bin", "size": 1}] * 1000
            for _ in range(2):  # the repeat is not answered ok while nothing is on disk
                reply = rank.request("done", root=str(root), step=3, rank=0, files=files)
                assert reply["error"]["code"] == "unavailable"
            assert not (root / "step_3").exists()
            filler.unlink()
            assert rank.request("done", root=str(root), step=3, rank=0, files=files)["ok"]
            assert rank.request("wait", root=str(root), step=3, timeout=30)["state"] == "promoted"
        daemon.kill()
        # What was finally acknowledged is in the journal.
        restarted = daemon_factory([root], "--state-dir", str(small_fs / "state"))
        with LineClient(restarted.socket_path) as client:
            assert client.request("status")["saves"][0]["state"] == "promoted"


class TestTrack:
    """Futures become exactly one done, or a fail, per rank and step."""

    def test_done_only_after_every_future(
        self, daemon_factory: Callable[..., DaemonProcess], root: Path
    ) -> None:
        daemon = daemon_factory([root])
        first: Future[None] = Future()
        second: Future[None] = Future()
        with CheckpointClient(str(daemon.socket_path)) as client:
            handle = client.track(str(root), 3, 0, 1, [first, second])
            with pytest.raises(RuntimeError, match="after seal"):
                handle.add(Future())
            first.set_result(None)
            assert not handle.wait_local(0)  # one part still in flight: no done
            (root / "tmp_step_3").mkdir(exist_ok=True)
            (root / "tmp_step_3" / "r0.bin").write_bytes(b"0" * 10)
            handle.add_files([FileEntry("r0.bin", 10)])
            second.set_result(None)
            assert handle.wait_local(30)
            assert client.wait(str(root), 3, 30.0).state == "promoted"
        done = [e for e in daemon.drain() if e["event"] == "save.rank_done"]
        assert len(done) == 1

    def test_checkpoint_exception_fails_the_step(
        self, daemon_factory: Callable[..., DaemonProcess], root: Path
    ) -> None:
        daemon = daemon_factory([root])
        future: Future[None] = Future()
        with CheckpointClient(str(daemon.socket_path)) as client:
            client.track(str(root), 4, 0, 2, future)
            # DCP's failure type derives from BaseException, not Exception.
            failure = RuntimeError("disk full")
            future.set_exception(
                CheckpointException("upload", {0: (failure, traceback.StackSummary())})
            )
            outcome = client.wait(str(root), 4, 30.0)
        assert outcome.state == "failed"
        assert outcome.reason is not None and "CheckpointException" in outcome.reason
        failed = daemon.wait_event("checkpoint.failed")
        assert failed["step"] == 4 and "CheckpointException" in failed["reason"]
        assert "disk full" in failed["reason"]

    def test_unprintable_exception_still_fails_the_step(
        self, daemon_factory: Callable[..., DaemonProcess], root: Path
    ) -> None:
        daemon = daemon_factory([root])
        future: Future[None] = Future()
        with CheckpointClient(str(daemon.socket_path)) as client:
            client.track(str(root), 5, 0, 1, future)
            # A malformed CheckpointException whose __str__ raises.
            future.set_exception(CheckpointException("upload", {0: RuntimeError("x")}))  # type: ignore[dict-item]
            outcome = client.wait(str(root), 5, 30.0)
        assert outcome.state == "failed"
        assert daemon.wait_event("checkpoint.failed")["step"] == 5


@pytest.fixture
def stopped(
    daemon_factory: Callable[..., DaemonProcess],
) -> Iterator[Callable[[DaemonProcess], None]]:
    """SIGSTOP a daemon (it accepts nothing, answers nothing); SIGCONT it at teardown."""
    paused: list[DaemonProcess] = []

    def stop(daemon: DaemonProcess) -> None:
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGSTOP)
        paused.append(daemon)

    yield stop
    for daemon in paused:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.proc.send_signal(signal.SIGCONT)


class TestBeginNotAwaited:
    """``track()`` and ``begin_nowait`` send ``begin`` without waiting for the daemon."""

    def test_track_returns_before_the_daemon_answers(
        self,
        daemon_factory: Callable[..., DaemonProcess],
        root: Path,
        stopped: Callable[[DaemonProcess], None],
    ) -> None:
        daemon = daemon_factory([root])
        with CheckpointClient(str(daemon.socket_path), begin_timeout=60.0) as client:
            assert client.ping(10.0)
            stopped(daemon)
            future: Future[None] = Future()
            handle = client.track(str(root), 2, 0, 1, future)
            # The daemon is stopped, so no acknowledgement can have arrived: track()
            # returned without one (it used to wait up to begin_timeout, here 60 s).
            assert client.ping(0.2) is False
            assert daemon.proc is not None
            daemon.proc.send_signal(signal.SIGCONT)
            assert handle.begun.acknowledged
            (root / "tmp_step_2").mkdir(exist_ok=True)
            (root / "tmp_step_2" / "r0.bin").write_bytes(b"0" * 10)
            handle.add_files([FileEntry("r0.bin", 10)])
            future.set_result(None)
            assert client.wait(str(root), 2, 30.0).state == "promoted"

    def test_refusal_is_logged_when_it_arrives(
        self,
        daemon_factory: Callable[..., DaemonProcess],
        root: Path,
        tmp_path: Path,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        caplog.set_level(logging.WARNING, logger="orchestrator")
        daemon = daemon_factory([root])
        elsewhere = tmp_path / "not-a-root"
        upload: Future[None] = Future()
        upload.set_result(None)
        with CheckpointClient(str(daemon.socket_path)) as client:
            handle = client.track(str(elsewhere), 1, 0, 1, upload)
            begun = handle.begun
            assert client.flush(10.0)
        assert not begun.acknowledged
        assert begun.error is not None and begun.error.code == "root_not_configured"
        refusals = [r.getMessage() for r in caplog.records if "refused begin" in r.getMessage()]
        assert len(refusals) == 1 and str(elsewhere) in refusals[0]

    def test_path_known_without_waiting_once_the_layout_is_learned(
        self,
        daemon_factory: Callable[..., DaemonProcess],
        root: Path,
        tmp_path: Path,
        stopped: Callable[[DaemonProcess], None],
    ) -> None:
        config = tmp_path / "ckptd.toml"
        config.write_text(f'[[roots]]\npath = "{root}"\ntmp_prefix = "incoming-"\n')
        daemon = daemon_factory([], "--config", str(config))
        with CheckpointClient(str(daemon.socket_path), begin_timeout=60.0) as client:
            first = client.begin(str(root), 1, 0, 2)  # waits: learns where this root writes
            assert (first.path, first.acknowledged) == (str(root / "incoming-1"), True)
            stopped(daemon)
            pending = client.begin_nowait(str(root), 2, 0, 2)
            assert pending.path == str(root / "incoming-2")  # no answer needed
            assert daemon.proc is not None
            daemon.proc.send_signal(signal.SIGCONT)
            second = pending.result()
            assert (second.path, second.acknowledged) == (str(root / "incoming-2"), True)


class TestNoTorchInDaemon:
    """The daemon and the client's import never load torch."""

    def test_imports_stay_light(self) -> None:
        code = (
            "import sys, daemon, daemon.cli, orchestrator, orchestrator.protocol\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)

    def test_running_daemon_maps_no_torch(
        self, daemon_factory: Callable[..., DaemonProcess], root: Path
    ) -> None:
        daemon = daemon_factory([root])
        assert daemon.proc is not None
        maps = Path(f"/proc/{daemon.proc.pid}/maps").read_text()
        assert "torch" not in maps

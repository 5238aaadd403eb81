"""Tests for daemon.server._systemd against real sockets and real processes (no mocks)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.server._systemd import (
    listen_fds,
    notify,
    notify_ready,
    notify_status,
    notify_stopping,
    notify_watchdog,
    watchdog_interval,
)

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 10.0

# Runs in a child process: moves the passed descriptors (argv[2:]) to 3, 4, ... as
# systemd does, sets LISTEN_PID to its own pid (or to argv[1] when not "self"), calls
# the function named by $CKPTD_TEST_CALL, reports what it got as one JSON line, and, if
# it got a listening socket, echoes one connection on the first one.
CHILD = r"""
import fcntl, json, os, sys
from daemon.server import _systemd
passed = [int(fd) for fd in sys.argv[2:]]
high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in passed]
for fd in passed:
    os.close(fd)
for index, fd in enumerate(high):
    os.dup2(fd, 3 + index)
    os.close(fd)
def cloexec_state(fd):
    try:
        return not os.get_inheritable(fd)
    except OSError:
        return "closed"
os.environ["LISTEN_PID"] = str(os.getpid()) if sys.argv[1] == "self" else sys.argv[1]
os.environ["LISTEN_FDS"] = str(len(passed))
os.environ["LISTEN_FDNAMES"] = ":".join(["ckptd"] * len(passed))
report = {"cloexec_before": [cloexec_state(3 + i) for i in range(len(passed))]}
try:
    got = getattr(_systemd, os.environ["CKPTD_TEST_CALL"])()
except ValueError as exc:
    got, report["error"] = None, str(exc)
socks = got if isinstance(got, list) else [got] if got is not None else []
report["fds"] = [s.fileno() for s in socks]
report["kinds"] = [[int(s.family), int(s.type)] for s in socks]
report["cloexec_after"] = [cloexec_state(3 + i) for i in range(len(passed))]
report["env"] = sorted(k for k in os.environ if k.startswith("LISTEN_"))
print(json.dumps(report), flush=True)
if socks and socks[0].type == 1:
    conn, _ = socks[0].accept()
    with conn:
        conn.sendall(b"echo:" + conn.recv(1024))
"""


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A directory under /tmp short enough for AF_UNIX paths (108-byte limit)."""
    path = Path(tempfile.mkdtemp(prefix="ckptd-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def receiver(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A datagram socket bound at a path that $NOTIFY_SOCKET names."""
    path = short_tmp / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(TIMEOUT)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        yield sock


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LISTEN_", "NOTIFY_"))}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def _run_child(
    call: str, socks: list[socket.socket], listen_pid: str = "self", connect: str | None = None
) -> dict[str, Any]:
    """Run CHILD with ``socks`` at fds 3..; connect to ``connect`` and check the echo."""
    fds = [s.fileno() for s in socks]
    with subprocess.Popen(
        [sys.executable, "-c", CHILD, listen_pid, *map(str, fds)],
        pass_fds=fds,
        env=_child_env(CKPTD_TEST_CALL=call),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        try:
            for sock in socks:  # only the child holds them from now on
                sock.close()
            if connect is not None:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                    client.settimeout(TIMEOUT)
                    client.connect(connect)
                    client.sendall(b"ping")
                    assert client.recv(1024) == b"echo:ping"
            out, err = proc.communicate(timeout=TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, err.decode()
    result: dict[str, Any] = json.loads(out)
    return result


def _listener(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen()
    return sock


class TestNotify:
    """notify() sends exactly the sd_notify datagram, and never raises."""

    def test_sends_newline_joined_states(self, receiver: socket.socket) -> None:
        assert notify("READY=1", "STATUS=serving 2 roots")
        assert receiver.recv(4096) == b"READY=1\nSTATUS=serving 2 roots"

    def test_convenience_helpers(self, receiver: socket.socket) -> None:
        assert notify_ready()
        assert receiver.recv(4096) == b"READY=1"
        assert notify_ready("listening on /run/ckptd/ckptd.sock")
        assert receiver.recv(4096) == b"READY=1\nSTATUS=listening on /run/ckptd/ckptd.sock"
        assert notify_stopping()
        assert receiver.recv(4096) == b"STOPPING=1"
        assert notify_watchdog()
        assert receiver.recv(4096) == b"WATCHDOG=1"
        assert notify_status("promoting\nstep_42")
        assert receiver.recv(4096) == b"STATUS=promoting step_42"

    def test_abstract_namespace(self, monkeypatch: pytest.MonkeyPatch) -> None:
        name = f"ckptd-test-{uuid.uuid4().hex}"
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind("\0" + name)
            sock.settimeout(TIMEOUT)
            monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
            assert notify_watchdog()
            assert sock.recv(4096) == b"WATCHDOG=1"

    def test_unset_returns_false(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
        assert not notify("READY=1")
        monkeypatch.setenv("NOTIFY_SOCKET", "")
        assert not notify_ready()

    def test_unsupported_address_returns_false(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("NOTIFY_SOCKET", "relative/notify.sock")
        assert not notify("READY=1")
        monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")
        assert not notify("READY=1")

    def test_no_states_returns_false(self, receiver: socket.socket) -> None:
        assert not notify()

    def test_send_errors_return_false(
        self, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("NOTIFY_SOCKET", str(short_tmp / "nobody-listens.sock"))
        assert not notify("READY=1")
        monkeypatch.setenv("NOTIFY_SOCKET", "/" + "x" * 200)  # longer than sun_path
        assert not notify("READY=1")

    def test_from_child_process_with_credentials(
        self, receiver: socket.socket, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # systemd checks the sender's pid (NotifyAccess=main) from SCM_CREDENTIALS.
        receiver.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        code = "from daemon.server._systemd import notify_ready; assert notify_ready('up')"
        env = _child_env(NOTIFY_SOCKET=os.environ["NOTIFY_SOCKET"])
        with subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO) as proc:
            data, ancdata, _, _ = receiver.recvmsg(4096, socket.CMSG_SPACE(12))
            assert proc.wait(timeout=TIMEOUT) == 0
        assert data == b"READY=1\nSTATUS=up"
        [(level, kind, creds)] = ancdata
        assert (level, kind) == (socket.SOL_SOCKET, socket.SCM_CREDENTIALS)
        assert struct.unpack("iII", creds) == (proc.pid, os.getuid(), os.getgid())


class TestListenFds:
    """listen_fds() takes the descriptors systemd passed to this very process."""

    def test_child_serves_inherited_socket(self, short_tmp: Path) -> None:
        path = short_tmp / "ckptd.sock"
        report = _run_child("listen_fds", [_listener(path)], connect=str(path))
        assert report["fds"] == [3]
        assert report["kinds"] == [[socket.AF_UNIX, socket.SOCK_STREAM]]
        assert report["cloexec_before"] == [False]
        assert report["cloexec_after"] == [True]
        assert report["env"] == []

    def test_several_sockets_in_order(self, short_tmp: Path) -> None:
        socks = [_listener(short_tmp / "a.sock"), _listener(short_tmp / "b.sock")]
        report = _run_child("listen_fds", socks, connect=str(short_tmp / "a.sock"))
        assert report["fds"] == [3, 4]
        assert report["cloexec_after"] == [True, True]

    def test_wrong_listen_pid_returns_nothing(self, short_tmp: Path) -> None:
        report = _run_child("listen_fds", [_listener(short_tmp / "s")], listen_pid="1")
        assert report["fds"] == []
        assert report["cloexec_after"] == [False]  # left untouched
        assert report["env"] == []

    def test_in_process_without_or_with_foreign_pid(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            monkeypatch.delenv(name, raising=False)
        assert listen_fds() == []
        monkeypatch.setenv("LISTEN_PID", str(os.getppid()))
        monkeypatch.setenv("LISTEN_FDS", "1")
        assert listen_fds(unset_environment=False) == []
        assert os.environ["LISTEN_FDS"] == "1"
        assert listen_fds() == []
        assert "LISTEN_PID" not in os.environ
        assert "LISTEN_FDS" not in os.environ

    def test_malformed_values_raise(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("LISTEN_PID", "not-a-pid")
        with pytest.raises(ValueError, match="LISTEN_PID"):
            listen_fds()
        assert "LISTEN_PID" not in os.environ
        monkeypatch.setenv("LISTEN_PID", str(os.getpid()))
        monkeypatch.setenv("LISTEN_FDS", "three")
        with pytest.raises(ValueError, match="LISTEN_FDS"):
            listen_fds()


class TestListenUnixSocket:
    """listen_unix_socket() returns the inherited listener or explains why it can't."""

    def test_returns_listening_stream_socket(self, short_tmp: Path) -> None:
        path = short_tmp / "ckptd.sock"
        report = _run_child("listen_unix_socket", [_listener(path)], connect=str(path))
        assert report["fds"] == [3]
        assert "error" not in report

    def test_datagram_socket_rejected(self, short_tmp: Path) -> None:
        dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        dgram.bind(str(short_tmp / "d.sock"))
        report = _run_child("listen_unix_socket", [dgram])
        assert "descriptor 3" in report["error"]
        assert "SOCK_DGRAM" in report["error"]
        assert report["cloexec_after"] == ["closed"]

    def test_non_listening_socket_rejected(self, short_tmp: Path) -> None:
        stream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stream.bind(str(short_tmp / "n.sock"))
        report = _run_child("listen_unix_socket", [stream])
        assert "not listening" in report["error"]

    def test_not_activated_returns_none(self) -> None:
        report = _run_child("listen_unix_socket", [])
        assert report["fds"] == []
        assert "error" not in report


class TestWatchdogInterval:
    """watchdog_interval() reads $WATCHDOG_USEC for this process only."""

    def test_disabled_when_unset(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv("WATCHDOG_USEC", raising=False)
        assert watchdog_interval() is None

    def test_seconds_for_this_pid(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("WATCHDOG_USEC", "30000000")
        monkeypatch.delenv("WATCHDOG_PID", raising=False)
        assert watchdog_interval() == 30.0
        monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
        assert watchdog_interval() == 30.0

    def test_other_pid_or_zero_disables(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("WATCHDOG_USEC", "30000000")
        monkeypatch.setenv("WATCHDOG_PID", str(os.getppid()))
        assert watchdog_interval() is None
        monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
        monkeypatch.setenv("WATCHDOG_USEC", "0")
        assert watchdog_interval() is None

    def test_malformed_raises(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("WATCHDOG_USEC", "30s")
        monkeypatch.delenv("WATCHDOG_PID", raising=False)
        with pytest.raises(ValueError, match="WATCHDOG_USEC"):
            watchdog_interval()

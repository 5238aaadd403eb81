"""Hostile peers: other users, stalled half lines, symlinked step directories."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import DaemonProcess, LineClient

Factory = Callable[..., DaemonProcess]
NOBODY = 65534

_PING_AS = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(30)
s.connect(sys.argv[1])
try:
    s.sendall(b'{"op":"ping","id":1}\\n')
except BrokenPipeError:  # a refused peer may be hung up on before it writes
    pass
f = s.makefile("rb")
line = f.readline()
print(line.decode().strip())
refused = not json.loads(line)["ok"]
print(json.dumps({"eof": refused and f.readline() == b""}))
"""


def _ping_as(uid: int, socket_path: Path) -> tuple[dict[str, object], bool]:
    """Ping the daemon from a real process running as ``uid``."""
    if shutil.which("setpriv") is None or os.getuid() != 0:
        pytest.skip("needs root and setpriv to run a process as another user")
    done = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        + [sys.executable, "-c", _PING_AS, str(socket_path)],
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr.decode()
    reply, eof = done.stdout.decode().splitlines()
    return json.loads(reply), json.loads(eof)["eof"]


def _open_to_everyone(daemon: DaemonProcess) -> None:
    # So that only the daemon's own check stands between another user and the socket.
    os.chmod(daemon.socket_path.parent, 0o755)
    os.chmod(daemon.socket_path, 0o666)


class TestPeerCredentials:
    """Only allowed uids/gids (SO_PEERCRED) may talk to the daemon."""

    def test_other_uid_refused(self, daemon_factory: Factory, root: Path) -> None:
        daemon = daemon_factory([root])
        _open_to_everyone(daemon)
        reply, closed = _ping_as(NOBODY, daemon.socket_path)
        assert reply["ok"] is False
        assert reply["error"]["code"] == "forbidden"  # type: ignore[index]
        assert closed
        refused = daemon.wait_event("client.refused")
        assert (refused["uid"], refused["gid"]) == (NOBODY, NOBODY)
        with LineClient(daemon.socket_path) as own:
            assert own.request("ping")["ok"]

    def test_allowed_uid_accepted(self, daemon_factory: Factory, root: Path) -> None:
        daemon = daemon_factory([root], "--allow-uid", str(NOBODY))
        _open_to_everyone(daemon)
        reply, _ = _ping_as(NOBODY, daemon.socket_path)
        assert reply["ok"] is True

    def test_allowed_gid_accepted(self, daemon_factory: Factory, root: Path) -> None:
        daemon = daemon_factory([root], "--allow-gid", str(NOBODY))
        _open_to_everyone(daemon)
        reply, _ = _ping_as(NOBODY, daemon.socket_path)
        assert reply["ok"] is True


class TestStalledClient:
    """Half a line and silence costs nothing but that connection."""

    def test_half_line_dropped(self, daemon_factory: Factory, root: Path, tmp_path: Path) -> None:
        config = tmp_path / "ckptd.toml"
        config.write_text(f'stall_timeout = 0.3\n[[roots]]\npath = "{root}"\n')
        daemon = daemon_factory([], "--config", str(config))
        with LineClient(daemon.socket_path) as idle, LineClient(daemon.socket_path) as stalled:
            assert idle.request("ping")["ok"]
            stalled.send_raw(b'{"op":"pi')
            dropped = daemon.wait_event("client.dropped")
            assert dropped["conn"] == 2 and "unfinished" in dropped["reason"]
            assert stalled.file.readline() == b""  # the daemon hung up
            # A client idle between whole lines is left alone.
            assert idle.request("ping")["ok"]


class TestConnectionLimit:
    """Connections beyond ``max_connections`` are turned away; a freed slot is reused."""

    def test_over_the_limit_gets_too_busy(
        self, daemon_factory: Factory, root: Path, tmp_path: Path
    ) -> None:
        config = tmp_path / "ckptd.toml"
        config.write_text(f'max_connections = 2\n[[roots]]\npath = "{root}"\n')
        daemon = daemon_factory([], "--config", str(config))
        with LineClient(daemon.socket_path) as first, LineClient(daemon.socket_path) as second:
            assert first.request("ping")["ok"] and second.request("ping")["ok"]
            with LineClient(daemon.socket_path) as third:
                refused = third.recv()
                assert refused["error"]["code"] == "too_busy"
                assert third.file.readline() == b""  # closed after the one line
            assert first.request("ping")["ok"]  # those admitted are unaffected
            second.close()
            daemon.wait_event("client.disconnected", match=lambda e: e["conn"] == 2)
            with LineClient(daemon.socket_path) as fourth:
                assert fourth.request("ping")["ok"]


class TestSymlinkConfinement:
    """Step directories that lead out of the root are refused."""

    def test_tmp_dir_symlink_to_etc(self, daemon_factory: Factory, root: Path) -> None:
        (root / "tmp_step_1").symlink_to("/etc")
        daemon = daemon_factory([root])
        with LineClient(daemon.socket_path) as client:
            reply = client.request("begin", root=str(root), step=1, rank=0, world_size=1)
        assert reply["error"]["code"] == "path_escape"
        assert "/etc" in reply["error"]["message"]

    def test_root_named_through_symlink_resolves(
        self, daemon_factory: Factory, root: Path, tmp_path: Path
    ) -> None:
        alias = tmp_path / "alias"
        alias.symlink_to(root)
        daemon = daemon_factory([root])
        with LineClient(daemon.socket_path) as client:
            reply = client.request("begin", root=str(root.resolve()), step=1, rank=0, world_size=1)
            assert reply["ok"], reply
            other = client.request("begin", root=str(alias), step=2, rank=0, world_size=1)
        # Only the configured path or its resolved form name the root.
        assert other["error"]["code"] == "root_not_configured"

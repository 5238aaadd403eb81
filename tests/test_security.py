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

from daemon.base._errors import ConfigError
from daemon.config._config import load_config
from tests._system import require_root
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


class TestRootIdentity:
    """A root is one directory under one lock: symlinked roots resolve, aliases and nests fail."""

    def test_symlinked_root_stays_where_it_resolved(
        self, daemon_factory: Factory, tmp_path: Path
    ) -> None:
        first, second = tmp_path / "first", tmp_path / "second"
        first.mkdir()
        second.mkdir()
        link = tmp_path / "run"
        link.symlink_to(first)
        daemon = daemon_factory([link])
        with LineClient(daemon.socket_path) as client:
            reply = client.request("begin", root=str(link), step=1, rank=0, world_size=1)
            assert reply["ok"] and reply["path"] == str(first / "tmp_step_1")
            (first / "tmp_step_1" / "shard").write_bytes(b"x")
            # An operator re-points the link mid-run: the save stays where it began.
            link.unlink()
            link.symlink_to(second)
            files = [{"path": "shard", "size": 1}]
            done = client.request("done", root=str(link), step=1, rank=0, files=files)
            assert done["ok"], done
            assert client.request("wait", root=str(link), step=1, timeout=30)["state"] == (
                "promoted"
            )
        assert (first / "step_1" / "shard").read_bytes() == b"x"
        assert os.readlink(first / "latest") == "step_1"
        assert sorted(os.listdir(second)) == []

    @pytest.mark.parametrize("shape", ["symlink-alias", "bind-alias", "nested"])
    def test_aliased_or_nested_roots_are_refused(self, tmp_path: Path, shape: str) -> None:
        real = tmp_path / "real"
        real.mkdir()
        if shape == "symlink-alias":
            other = tmp_path / "alias"
            other.symlink_to(real)
            expected = "are the same directory"
        elif shape == "nested":
            other = real / "inner"
            other.mkdir()
            expected = "roots must not nest"
        else:
            other = tmp_path / "bound"
            other.mkdir()
            require_root("bind mounts")
            subprocess.run(["mount", "--bind", str(real), str(other)], check=True)
            expected = "are the same directory"
        try:
            with pytest.raises(ConfigError, match=expected):
                load_config(roots=[str(real), str(other)], state_dir=str(tmp_path / "s"))
        finally:
            if shape == "bind-alias":
                subprocess.run(["umount", str(other)], check=True)

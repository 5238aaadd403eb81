"""Operating the daemon: ``--version``, ``check-config``, ``health`` probes, SIGUSR1 dumps."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from daemon.base._errors import ConfigError
from daemon.cli import main
from daemon.config._types import check_types
from daemon.server._server import VERSION
from tests._fuse import bindfs_mount
from tests._system import in_ci, require_root, require_tool
from tests.conftest import REPO, DaemonProcess, LineClient

TIMEOUT = 15.0
STALL = 0.5
"""``fs_stall_after`` where a test hangs a filesystem: half a second is a stall."""

Start = Callable[..., DaemonProcess]


def run_cli(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "daemon", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        check=False,
    )


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


class TestVersion:
    """``ckptd --version`` prints the installed version."""

    def test_prints_version(self) -> None:
        result = run_cli("--version")
        assert result.returncode == 0
        assert result.stdout.strip() == f"ckptd {VERSION}"


class TestCheckConfig:
    """``ckptd check-config FILE``: 0 and a summary, or 2 naming the field and the fix."""

    def test_valid_file(
        self, tmp_path: Path, root: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        cfg = write_config(
            tmp_path / "c.toml",
            f'state_dir = "{tmp_path}/state"\nmetrics_listen = "127.0.0.1:9464"\n'
            f'[[roots]]\npath = "{root}"\npointer = "newest"\n',
        )
        assert main(["check-config", str(cfg)]) == 0
        out = capsys.readouterr().out
        assert "configuration OK" in out
        assert f"{root}: tmp_step_N -> step_N, pointer newest" in out
        assert "metrics_listen: 127.0.0.1:9464" in out

    @pytest.mark.parametrize(
        ("body", "expected"),
        [
            ("lease = -1\n", "lease must be > 0"),
            ("leese = 3\n", "unknown keys"),
            ('metrics_listen = "localhost"\n', "metrics_listen 'localhost' must be HOST:PORT"),
            ('metrics_textfile = "rel.txt"\n', "metrics_textfile 'rel.txt' must be an absolute"),
            ("[[roots]]\npath = 3\n[[roots]\n", "not valid TOML"),
            ('log_level = "loud"\n', "log_level must be one of"),
            ('lease = "30"\n', "/c.toml must be a number, got string '30'"),
            ("allowed_uids = 5\n", "/c.toml must be an array, got integer 5"),
            ('allowed_uids = ["a"]\n', "/c.toml must be an array of integers"),
            ("save_timeout = true\n", "/c.toml must be a number, got boolean"),
            ("metrics_listen = 9464\n", "/c.toml must be a string"),
            ("roots = 3\n", "/c.toml must be an array, got integer 3"),
        ],
    )
    def test_invalid_file_names_the_field(
        self,
        tmp_path: Path,
        root: Path,
        capsys: pytest.CaptureFixture[str],
        body: str,
        expected: str,
    ) -> None:
        roots = f'\n[[roots]]\npath = "{root}"\n' if "roots" not in body else ""
        cfg = write_config(tmp_path / "c.toml", f'state_dir = "{tmp_path}/s"\n{body}{roots}')
        assert main(["check-config", str(cfg)]) == 2
        err = capsys.readouterr().err
        assert expected in err
        if not body.startswith("[["):
            assert body.split(" ")[0] in err  # the message names the setting

    def test_root_option_of_the_wrong_type(
        self, tmp_path: Path, root: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        cfg = write_config(tmp_path / "c.toml", f'[[roots]]\npath = "{root}"\npointer = 3\n')
        assert main(["check-config", str(cfg)]) == 2
        assert f"pointer in [[roots]] {root} of {cfg} must be a string" in capsys.readouterr().err

    def test_unknown_root_key(
        self, tmp_path: Path, root: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        cfg = write_config(tmp_path / "c.toml", f'[[roots]]\npath = "{root}"\ntmp_prefx = "t_"\n')
        assert main(["check-config", str(cfg)]) == 2
        err = capsys.readouterr().err
        assert "unknown keys in [[roots]]" in err and "tmp_prefx" in err and "tmp_prefix" in err

    def test_as_a_subprocess(self, tmp_path: Path) -> None:
        cfg = write_config(tmp_path / "c.toml", 'socket = "/tmp/x.sock"\n')
        result = run_cli("check-config", str(cfg))
        assert result.returncode == 2
        assert "no checkpoint root configured" in result.stderr


class TestConfigTypes:
    """Types come from the dataclass defaults; a field without a plain default is skipped."""

    def test_options_table_is_left_to_its_own_validation(self) -> None:
        @dataclasses.dataclass(kw_only=True)
        class Options:
            retention: dict[str, int] | None = None
            node: str = ""
            timeout: float = 1.0

        check_types(Options, {"retention": {"keep_last": 3}, "node": "n1", "timeout": 2}, "f")
        with pytest.raises(ConfigError, match="node in f must be a string, got integer 3"):
            check_types(Options, {"node": 3}, "f")
        with pytest.raises(ConfigError, match="timeout in f must be a number, got boolean"):
            check_types(Options, {"timeout": True}, "f")


class TestHealth:
    """``ckptd health`` exits 0 only if the daemon answers and its journal can be written."""

    def test_healthy_daemon(self, start: Start, root: Path) -> None:
        daemon = start([root])
        result = run_cli("health", "--socket", str(daemon.socket_path))
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == f"ckptd {VERSION}: healthy"

    def test_no_daemon(self, short_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
        assert main(["health", "--socket", str(short_dir / "none.sock")]) == 1
        err = capsys.readouterr().err
        assert err.startswith("ckptd: unhealthy: ") and "No such file" in err
        assert err.count("\n") == 1

    def test_hung_journal_is_unhealthy(
        self, start: Start, tmp_path: Path, root: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        backing = tmp_path / "state-backing"
        backing.mkdir()
        cfg = write_config(tmp_path / "c.toml", f"fs_stall_after = {STALL}\n")
        with bindfs_mount(backing, tmp_path / "state") as fs:
            daemon = start([root], "--state-dir", str(fs.mount), "--config", str(cfg))
            sock = str(daemon.socket_path)
            assert main(["health", "--socket", sock]) == 0
            fs.stop()
            with LineClient(daemon.socket_path, timeout=TIMEOUT) as writer:
                writer.send_raw(
                    b'{"op":"begin","id":1,"root":"%s","step":1,"rank":0,"world_size":1}\n'
                    % str(root).encode()
                )
                daemon.wait_event("journal.stalled", TIMEOUT)
                assert main(["health", "--socket", sock]) == 1
                err = capsys.readouterr().err
                assert "unhealthy: a journal write has not returned for" in err
                fs.cont()
                assert writer.recv()["ok"] is True
            daemon.wait_event("journal.recovered", TIMEOUT)
            assert main(["health", "--socket", sock]) == 0

    def test_full_state_disk_is_unhealthy_until_freed(
        self, start: Start, short_dir: Path, root: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        require_root("mounting a small tmpfs as the state directory")
        state = short_dir / "state"
        state.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(state)], check=True)
        try:
            daemon = start([root], "--state-dir", str(state))
            sock = str(daemon.socket_path)
            assert main(["health", "--socket", sock]) == 0
            with LineClient(daemon.socket_path, timeout=TIMEOUT) as client:
                at = {"root": str(root), "step": 1, "rank": 0}
                # World size 2: the save stays open, so only the journal is exercised.
                assert client.request("begin", **at, world_size=2)["ok"] is True
                filler = state / "filler"
                fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
                try:
                    with pytest.raises(OSError, match="No space left"):
                        while True:
                            os.write(fd, b"\0" * 4096)
                finally:
                    os.close(fd)
                # A record larger than the slack in the journal's last page: it needs a
                # new one, and there is none.
                files = [{"path": f"model/{'x' * 100}-{i}.distcp", "size": 1} for i in range(100)]
                assert client.request("done", **at, files=files)["error"]["code"] == "unavailable"
                daemon.wait_event("journal.failed", TIMEOUT)
                assert main(["health", "--socket", sock]) == 1
                err = capsys.readouterr().err
                assert "unhealthy: the last journal write failed: No space left on device" in err
                filler.unlink()
                assert main(["health", "--socket", sock]) == 0  # the queued change is written
                assert client.request("done", **at, files=files)["ok"] is True
            assert daemon.stop() == 0
        finally:
            subprocess.run(["umount", "-l", str(state)], check=False)

    def test_state_disk_the_kernel_made_read_only_is_unhealthy(
        self, start: Start, short_dir: Path, root: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        require_root("mounting an ext4 image as the state directory")
        mkfs = require_tool("mkfs.ext4", "e2fsprogs")
        image, state = short_dir / "state.img", short_dir / "state"
        state.mkdir()
        with image.open("wb") as fh:
            fh.truncate(16 * 1024 * 1024)
        subprocess.run([mkfs, "-q", "-F", str(image)], check=True, capture_output=True)
        mounted = subprocess.run(
            ["mount", "-o", "loop,errors=remount-ro", str(image), str(state)],
            capture_output=True,
            text=True,
            check=False,
        )
        if mounted.returncode != 0:
            reason = f"no loop device to mount an ext4 image: {mounted.stderr.strip()}"
            if in_ci():
                pytest.fail(reason)
            pytest.skip(reason)
        try:
            daemon = start([root], "--state-dir", str(state))
            sock = str(daemon.socket_path)
            assert main(["health", "--socket", sock]) == 0
            # What ext4 does on an I/O error under errors=remount-ro (the journal is
            # aborted): every write now fails with EROFS, yet statvfs shows no ST_RDONLY,
            # access(W_OK) still succeeds, and the daemon holds its journal open.
            subprocess.run(["mount", "-o", "remount,abort", str(state)], check=True)
            assert not os.statvfs(state).f_flag & os.ST_RDONLY
            assert main(["health", "--socket", sock]) == 1
            err = capsys.readouterr().err
            assert "unhealthy: the state directory cannot be written: " in err
            assert "Read-only file system" in err
        finally:
            subprocess.run(["umount", "-l", str(state)], check=False)

    def test_hung_checkpoint_root_stays_healthy(
        self, start: Start, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        backing = tmp_path / "root-backing"
        backing.mkdir()
        cfg = write_config(tmp_path / "c.toml", f"fs_stall_after = {STALL}\n")
        with bindfs_mount(backing, tmp_path / "root") as fs:
            daemon = start([fs.mount], "--config", str(cfg))
            fs.stop()
            with LineClient(daemon.socket_path, timeout=TIMEOUT) as asker:
                asker.send_raw(b'{"op":"latest","id":1,"root":"%s"}\n' % str(fs.mount).encode())
                daemon.wait_event("root.stalled", TIMEOUT)
                assert main(["health", "--socket", str(daemon.socket_path)]) == 0
                fs.cont()
                assert asker.recv()["id"] == 1
        assert "healthy" in capsys.readouterr().out

    def test_health_request_on_the_wire(self, start: Start, root: Path) -> None:
        daemon = start([root])
        with LineClient(daemon.socket_path, timeout=TIMEOUT) as client:
            reply = client.request("health")
        assert reply == {"id": 1, "ok": True, "version": VERSION, "healthy": True, "problem": None}


class TestStackDump:
    """SIGUSR1 writes every thread's stack to stderr; the daemon goes on serving."""

    def test_sigusr1_dumps_all_threads(self, start: Start, root: Path) -> None:
        daemon = start([root])  # its stderr is merged into the events it reads
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGUSR1)
        header = daemon.wait_event(
            "_stdout", TIMEOUT, lambda e: "most recent call first" in e["line"]
        )
        assert header["line"].startswith(("Thread 0x", "Current thread 0x"))
        main_thread = daemon.wait_event(
            "_stdout", TIMEOUT, lambda e: e["line"].startswith("Current thread 0x")
        )
        assert main_thread  # the event loop's thread: its frames follow, down to the CLI
        daemon.wait_event("_stdout", TIMEOUT, lambda e: "daemon/cli.py" in e["line"])
        with LineClient(daemon.socket_path, timeout=TIMEOUT) as client:
            assert client.request("ping")["ok"] is True
        threads = [e for e in daemon.drain() if "most recent call first" in e.get("line", "")]
        assert len(threads) >= 2  # the event loop's and the stdout writer's, at least
        assert daemon.stop() == 0

"""What ``ckptd`` prints is what is there: status, ls, wrong paths, check-config, verify.

Real daemons and real files under ``tmp_path``; the CLI as ``main(argv)``, and as a
subprocess for a mistyped path.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from daemon.cli import main
from tests.conftest import DaemonProcess
from tests.test_server import Start, begin, connect, ok, run_cli, save, wait, write_files


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``main(argv)``; return its exit code, stdout and stderr."""
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def sock(daemon: DaemonProcess) -> str:
    """The daemon's socket as a ``--socket`` value."""
    return str(daemon.socket_path)


def fail_step(daemon: DaemonProcess, root: Path, step: int) -> None:
    """Step ``step`` begun by one rank that writes a file and then fails."""
    with connect(daemon) as client:
        ok(begin(client, root, step, 0, 1))
        write_files(root / f"tmp_step_{step}", 0, count=1)
        ok(client.request("fail", root=str(root), step=step, rank=0, reason="disk full"))
        assert ok(wait(client, root, step))["state"] == "failed"


class TestStatus:
    """``status`` shows saves in flight in step order; ``--all`` shows settled ones, truly."""

    def test_in_flight_by_default_in_step_order(
        self, start: Start, root: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        daemon = start([root])
        for step in (60, 5, 10):
            assert ok(save(daemon, root, step, world_size=1))["state"] == "promoted"
        fail_step(daemon, root, 61)
        with connect(daemon) as client:
            for step in (70, 7):
                ok(begin(client, root, step, 0, 2))
            code, out, _ = cli(capsys, "status", "--socket", sock(daemon))
        assert code == 0
        lines = out.splitlines()
        assert [line.split()[1] for line in lines[3:5]] == ["7", "70"]
        assert [line.split()[2] for line in lines[3:5]] == ["open", "open"]
        assert lines[5:] == [
            "4 settled saves (promoted or failed) not shown; `ckptd status --all` shows them"
        ]
        code, out, _ = cli(capsys, "status", "--all", "--socket", sock(daemon))
        assert code == 0
        steps = [line.split()[1] for line in out.splitlines()[3:]]
        assert steps == ["5", "7", "10", "60", "61", "70"]
        assert "not shown" not in out

    def test_nothing_in_flight(
        self, start: Start, root: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        daemon = start([root])
        assert ok(save(daemon, root, 1, world_size=1))["state"] == "promoted"
        code, out, _ = cli(capsys, "status", "--socket", sock(daemon))
        assert code == 0
        assert out.splitlines()[2:] == [
            "no saves in flight",
            "1 settled saves (promoted or failed) not shown; `ckptd status --all` shows them",
        ]

    def test_a_promoted_step_since_deleted(
        self, start: Start, root: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        daemon = start([root])
        for step in (1, 2):
            assert ok(save(daemon, root, step, world_size=1))["state"] == "promoted"
        shutil.rmtree(root / "step_1")
        code, out, _ = cli(capsys, "status", "--all", "--socket", sock(daemon))
        assert code == 0
        rows = {line.split()[1]: line for line in out.splitlines()[3:]}
        assert rows["1"].split()[2] == "deleted"
        assert "promoted, since removed from the root" in rows["1"]
        assert rows["2"].split()[2] == "promoted"


class TestLs:
    """``ls`` names each step's state as it is now."""

    def test_saved_again_after_a_failure(
        self, start: Start, root: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        daemon = start([root])
        fail_step(daemon, root, 4)
        code, out, _ = cli(capsys, "ls", str(root), "--json", "--socket", sock(daemon))
        assert [(r["step"], r["state"]) for r in json.loads(out)] == [(4, "failed")]
        assert ok(save(daemon, root, 4, world_size=1))["state"] == "promoted"
        code, out, _ = cli(capsys, "ls", str(root), "--socket", sock(daemon))
        assert code == 0
        states = [line.split()[1:3] for line in out.splitlines()[1:]]
        assert states == [["*", "promoted"], ["old", "attempt"]]
        assert "set aside" not in out
        # With the daemon gone the root says the same.
        assert daemon.stop() == 0
        code, out, _ = cli(capsys, "ls", str(root), "--json", "--socket", sock(daemon))
        assert [(r["step"], r["state"]) for r in json.loads(out)] == [
            (4, "promoted"),
            (4, "old attempt"),
        ]


class TestWrongPath:
    """A path that does not exist or is no root: non-zero, and the path named."""

    def test_every_command_names_a_missing_path(
        self, start: Start, root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        daemon = start([root])
        missing = tmp_path / "rnu"  # a typo of "run"
        for argv in (
            ["ls", str(missing)],
            ["latest", str(missing)],
            ["gc", str(missing)],
            ["promote", str(missing), "3"],
            ["pin", str(missing), "3"],
            ["score", str(missing), "3", "loss=1"],
        ):
            code, out, err = cli(capsys, *argv, "--socket", sock(daemon))
            assert (code, out) == (2, ""), argv
            assert err == f"ckptd: {missing}: no such file or directory\n", (argv, err)
        for argv in (["verify", str(missing / "step_3")], ["verify", "--json", str(missing)]):
            code, out, err = cli(capsys, *argv)
            assert (code, out) == (2, ""), argv
            assert err.startswith(f"ckptd: {missing}"), (argv, err)
            assert "no such file or directory" in err, (argv, err)
            assert "has no promoted checkpoint" not in err

    def test_a_directory_that_is_no_root(
        self, start: Start, root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        daemon = start([root])
        other = tmp_path / "other"
        other.mkdir()
        for command in ("ls", "latest"):
            code, out, err = cli(capsys, command, str(other), "--socket", sock(daemon))
            assert (code, out) == (2, ""), command
            assert err.startswith(f"ckptd: {other} is not a checkpoint root"), err
            assert f"serves {root}" in err
        for argv in (["gc", str(other)], ["promote", str(other), "3"]):
            code, out, err = cli(capsys, *argv, "--socket", sock(daemon))
            assert (code, out) == (1, "")
            assert f"root_not_configured: {other} is not a configured root" in err

    def test_subprocess(self, tmp_path: Path) -> None:
        missing = tmp_path / "nope"
        result = run_cli("ls", str(missing), "--socket", str(tmp_path / "none.sock"))
        assert (result.returncode, result.stdout) == (2, "")
        assert result.stderr == f"ckptd: {missing}: no such file or directory\n"


class TestCheckConfig:
    """``check-config`` says what each kind of root does."""

    def test_an_object_store_root(
        self, tmp_path: Path, root: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        toml = tmp_path / "ckptd.toml"
        toml.write_text(f'[[roots]]\npath = "s3://ckpt/runs/r1"\n\n[[roots]]\npath = "{root}"\n')
        code, out, _ = cli(capsys, "check-config", str(toml))
        assert code == 0, out
        assert (
            "  s3://ckpt/runs/r1: each attempt writes step_N/ATTEMPT/, committed by "
            "step_N/.ckptd-commit.json, pointer latest (an object)"
        ) in out.splitlines()
        assert f"  {root}: tmp_step_N -> step_N, pointer latest" in out.splitlines()
        assert "s3://ckpt/runs/r1: tmp_step_N" not in out


class TestVerify:
    """``verify`` says what it checked, and that a changed byte is not among it."""

    def test_a_flipped_byte_is_not_checked_and_it_says_so(
        self, start: Start, root: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        daemon = start([root])
        checkpoint = Path(ok(save(daemon, root, 1))["path"])
        shard = checkpoint / "model" / "rank0-0.bin"
        data = bytearray(shard.read_bytes())
        data[7] ^= 0xFF
        shard.write_bytes(bytes(data))
        code, out, _ = cli(capsys, "verify", str(checkpoint))
        assert code == 0
        lines = out.splitlines()
        assert lines[0] == f"{checkpoint}: OK"
        assert "each present, inside the checkpoint, with the size its manifest records" in out
        assert lines[-1].startswith("  not checked: contents: ")
        assert "a changed byte that keeps a file's size is not found" in lines[-1]

    def test_help_says_what_is_checked(self, capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit):
            main(["verify", "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "sizes its manifest records" in text
        assert "contents are not checksummed" in text

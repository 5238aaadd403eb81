"""The ``ckptd`` command line against a real daemon: ``main(argv)`` and a real subprocess."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon.cli import main
from daemon.ops._inspect import NOT_CHECKED
from tests.conftest import REPO, DaemonProcess
from tests.test_server import (
    TIMEOUT,
    Start,
    begin,
    connect,
    done,
    ok,
    run_cli,
    save,
    wait,
    write_files,
)


@pytest.fixture
def nobody(short_dir: Path) -> str:
    """A socket path nobody listens on."""
    return str(short_dir / "nobody.sock")


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``main(argv)``; return its exit code, stdout and stderr."""
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def sock(daemon: DaemonProcess) -> str:
    return str(daemon.socket_path)


def populate(daemon: DaemonProcess, root: Path) -> None:
    """Steps 1 and 2 promoted; 3 in flight (rank 0 done of 2); 4 failed; 9 an orphan."""
    assert ok(save(daemon, root, 1))["state"] == "promoted"
    assert ok(save(daemon, root, 2))["state"] == "promoted"
    with connect(daemon) as client:
        ok(begin(client, root, 3, 0, 2))
        ok(done(client, root, 3, 0, write_files(root / "tmp_step_3", 0)))
        ok(begin(client, root, 4, 0, 1))
        write_files(root / "tmp_step_4", 0, count=1)
        ok(client.request("fail", root=str(root), step=4, rank=0, reason="disk full"))
        assert ok(wait(client, root, 4))["state"] == "failed"
    write_files(root / "tmp_step_9", 0)


class TestStatus:
    """``ckptd status`` shows the daemon's saves as a table or as JSON."""

    def test_table(self, start: Start, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
        daemon = start([root])
        populate(daemon, root)
        code, out, _ = cli(capsys, "status", "--all", "--socket", sock(daemon))
        assert code == 0
        lines = out.splitlines()
        assert daemon.proc is not None
        assert lines[0].startswith(f"ckptd 0.1.0  pid {daemon.proc.pid}  up ")
        assert lines[1] == f"roots: {root}"
        assert lines[2].split() == [
            "ROOT",
            "STEP",
            "STATE",
            "RANKS",
            "DONE",
            "AGE",
            "PATH",
            "/",
            "REASON",
        ]
        rows = {int(line.split()[1]): line.split() for line in lines[3:]}
        assert list(rows) == [1, 2, 3, 4]
        assert rows[2][:4] == [str(root), "2", "promoted", "2/2"]
        assert rows[2][-1] == str(root / "step_2")
        assert rows[3][:4] == [str(root), "3", "open", "1/2"]
        assert rows[4][:4] == [str(root), "4", "failed", "0/1"]
        assert "rank 0 failed: disk full" in lines[3 + sorted(rows).index(4)]

    def test_json(self, start: Start, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
        daemon = start([root])
        populate(daemon, root)
        code, out, _ = cli(capsys, "status", "--json", "--socket", sock(daemon))
        assert code == 0
        reply = json.loads(out)
        assert reply["ok"] is True
        assert reply["roots"] == [str(root)]
        states = {s["step"]: s["state"] for s in reply["saves"]}
        assert states == {1: "promoted", 2: "promoted", 3: "open", 4: "failed"}
        step3 = next(s for s in reply["saves"] if s["step"] == 3)
        assert [(r["rank"], r["state"]) for r in step3["ranks"]] == [(0, "done")]

    def test_json_subprocess(self, start: Start, root: Path) -> None:
        daemon = start([root])
        assert ok(save(daemon, root, 1))["state"] == "promoted"
        result = run_cli("status", "--json", "--socket", sock(daemon))
        assert result.returncode == 0, result.stderr
        saves = json.loads(result.stdout)["saves"]
        assert [(s["step"], s["state"], s["path"]) for s in saves] == [
            (1, "promoted", str(root / "step_1"))
        ]

    def test_unreachable(self, nobody: str, capsys: pytest.CaptureFixture[str]) -> None:
        code, out, err = cli(capsys, "status", "--socket", nobody)
        assert code == 1
        assert out == ""
        assert err.startswith(f"ckptd: daemon unreachable: {nobody}: ")
        assert "No such file or directory" in err


class TestLs:
    """``ckptd ls ROOT`` lists checkpoints on disk with in-flight states from the daemon."""

    def test_table(self, start: Start, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
        daemon = start([root])
        populate(daemon, root)
        code, out, _ = cli(capsys, "ls", str(root), "--socket", sock(daemon))
        assert code == 0
        lines = out.splitlines()
        assert lines[0].split() == ["STEP", "STATE", "SIZE", "FILES", "PATH"]
        rows = [line.split() for line in lines[1:]]
        assert rows[0] == ["1", "promoted", "400", "B", "4", str(root / "step_1")]
        assert rows[1] == ["2", "*", "promoted", "400", "B", "4", str(root / "step_2")]
        assert rows[2] == ["3", "open", str(root / "tmp_step_3")]
        assert rows[3][:2] == ["4", "failed"]
        assert rows[3][2].startswith(str(root / ".ckptd-trash" / "tmp_step_4.attempt-"))
        assert "(rank 0 failed: disk full)" in lines[4]
        assert rows[4] == ["9", "unknown", str(root / "tmp_step_9")]
        assert len(rows) == 5

    def test_json(self, start: Start, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
        daemon = start([root])
        populate(daemon, root)
        code, out, _ = cli(capsys, "ls", str(root), "--json", "--socket", sock(daemon))
        assert code == 0
        rows = {(r["step"], r["state"]): r for r in json.loads(out)}
        assert sorted(rows) == [
            (1, "promoted"),
            (2, "promoted"),
            (3, "open"),
            (4, "failed"),
            (9, "unknown"),
        ]
        assert rows[(2, "promoted")]["latest"] is True
        assert rows[(1, "promoted")]["latest"] is False
        assert (rows[(1, "promoted")]["bytes"], rows[(1, "promoted")]["files"]) == (400, 4)
        assert rows[(4, "failed")]["reason"] == "rank 0 failed: disk full"
        assert rows[(3, "open")]["path"] == str(root / "tmp_step_3")

    def test_custom_layout(
        self, start: Start, root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        config = tmp_path / "ckptd.toml"
        config.write_text(
            f'[[roots]]\npath = "{root}"\ntmp_prefix = "incoming-"\n'
            'final_prefix = "ckpt-"\npointer = "current"\n'
        )
        daemon = start([], "--config", str(config))
        with connect(daemon) as client:
            ok(begin(client, root, 8, 0, 1))
            ok(done(client, root, 8, 0, write_files(root / "incoming-8", 0)))
            assert ok(wait(client, root, 8))["path"] == str(root / "ckpt-8")
            ok(begin(client, root, 9, 0, 2))
            write_files(root / "incoming-9", 0)
        code, out, _ = cli(capsys, "latest", str(root), "--socket", sock(daemon))
        assert (code, out) == (0, f"{root / 'ckpt-8'}\n")
        code, out, _ = cli(capsys, "ls", str(root), "--json", "--socket", sock(daemon))
        assert code == 0
        rows = [(r["step"], r["state"], r["latest"]) for r in json.loads(out)]
        assert rows == [(8, "promoted", True), (9, "open", False)]

    def test_daemon_unreachable(
        self, start: Start, root: Path, nobody: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        daemon = start([root])
        populate(daemon, root)
        code, out, _ = cli(capsys, "ls", str(root), "--json", "--socket", nobody)
        assert code == 0
        states = {r["step"]: r["state"] for r in json.loads(out)}
        assert states == {1: "promoted", 2: "promoted", 3: "unknown", 4: "set aside", 9: "unknown"}


class TestLatest:
    """``ckptd latest ROOT`` prints the newest checkpoint, or exits 1 when there is none."""

    def test_reachable(self, start: Start, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
        daemon = start([root])
        code, out, err = cli(capsys, "latest", str(root), "--socket", sock(daemon))
        assert (code, out) == (1, "")
        assert "not_found" in err
        assert ok(save(daemon, root, 2))["state"] == "promoted"
        assert ok(save(daemon, root, 1))["state"] == "promoted"
        code, out, _ = cli(capsys, "latest", str(root), "--socket", sock(daemon))
        assert (code, out) == (0, f"{root / 'step_2'}\n")

    def test_unreachable(
        self, start: Start, root: Path, nobody: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        code, out, err = cli(capsys, "latest", str(root), "--socket", nobody)
        assert (code, out) == (2, "")  # no daemon ever served it
        assert f"{root} is not a checkpoint root: the daemon at {nobody} does not answer" in err
        daemon = start([root])
        assert daemon.stop() == 0
        code, out, err = cli(capsys, "latest", str(root), "--socket", nobody)
        assert (code, out) == (1, "")
        assert f"{root} has no promoted checkpoint" in err
        daemon = start([root])
        assert ok(save(daemon, root, 3))["state"] == "promoted"
        assert daemon.stop() == 0
        # The pointer on disk is the answer when the daemon is gone.
        code, out, _ = cli(capsys, "latest", str(root), "--socket", nobody)
        assert (code, out) == (0, f"{root / 'step_3'}\n")

    def test_root_the_daemon_does_not_manage(
        self, start: Start, root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        other = tmp_path / "other"
        other.mkdir()
        daemon = start([other])
        (root / "step_5").mkdir()
        (root / "latest").symlink_to("step_5")
        # No daemon serves it and none ever did (no layout file): it is no root.
        code, out, err = cli(capsys, "latest", str(root), "--socket", sock(daemon))
        assert (code, out) == (2, "")
        assert f"{root} is not a checkpoint root" in err and str(other) in err
        # A root a daemon served (another node's, one since reconfigured) is read as is.
        (root / ".ckptd-layout.json").write_bytes((other / ".ckptd-layout.json").read_bytes())
        code, out, _ = cli(capsys, "latest", str(root), "--socket", sock(daemon))
        assert (code, out) == (0, f"{root / 'step_5'}\n")

    def test_dangling_pointer(
        self, start: Start, root: Path, nobody: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        daemon = start([root])
        assert ok(save(daemon, root, 1))["state"] == "promoted"
        shutil.rmtree(root / "step_1")
        offline = cli(capsys, "latest", str(root), "--socket", nobody)
        assert offline[0] == 1
        # A pointer whose checkpoint was deleted names nothing, with or without the daemon.
        online = cli(capsys, "latest", str(root), "--socket", sock(daemon))
        assert (online[0], online[1]) == (1, ""), online
        assert "not_found" in online[2]

    def test_subprocess(self, start: Start, root: Path) -> None:
        daemon = start([root])
        missing = run_cli("latest", str(root), "--socket", sock(daemon))
        assert missing.returncode == 1
        assert "not_found" in missing.stderr
        assert ok(save(daemon, root, 4))["state"] == "promoted"
        found = run_cli("latest", str(root), "--socket", sock(daemon))
        assert (found.returncode, found.stdout) == (0, f"{root / 'step_4'}\n")


class TestVerify:
    """``ckptd verify PATH`` checks a promoted checkpoint against its manifest."""

    @pytest.fixture
    def checkpoint(self, start: Start, root: Path) -> Path:
        daemon = start([root])
        reply = ok(save(daemon, root, 1))
        assert reply["state"] == "promoted"
        return Path(reply["path"])

    def test_ok(self, checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
        code, out, _ = cli(capsys, "verify", str(checkpoint))
        assert code == 0
        assert out.splitlines() == [
            f"{checkpoint}: OK",
            (
                "  checked: 4 files, 400 B: each present, inside the checkpoint, with the "
                "size its manifest records"
            ),
            f"  not checked: {NOT_CHECKED}",
        ]
        code, out, _ = cli(capsys, "verify", "--json", str(checkpoint))
        assert code == 0
        report = json.loads(out)
        assert (report["path"], report["ok"], report["problems"]) == (str(checkpoint), True, [])
        assert report["not_checked"] == [NOT_CHECKED] and len(report["checked"]) == 1

    def test_truncated(self, checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
        with open(checkpoint / "model" / "rank1-0.bin", "r+b") as fh:
            fh.truncate(7)
        code, out, _ = cli(capsys, "verify", str(checkpoint))
        assert code == 1
        assert (
            out.splitlines()[0] == f"{checkpoint}: model/rank1-0.bin: 7 bytes, manifest records 100"
        )

    def test_deleted(self, checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
        (checkpoint / "model" / "rank0-1.bin").unlink()
        code, out, _ = cli(capsys, "verify", "--json", str(checkpoint))
        assert code == 1
        report = json.loads(out)
        assert report["ok"] is False
        assert report["problems"] == ["model/rank0-1.bin: No such file or directory"]

    def test_file_swapped_for_symlink_out(
        self, checkpoint: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        shard = checkpoint / "model" / "rank0-0.bin"
        outside = checkpoint.parent.parent / "outside.bin"
        outside.write_bytes(shard.read_bytes())  # same size: only the location is wrong
        shard.unlink()
        shard.symlink_to(outside)
        code, out, _ = cli(capsys, "verify", str(checkpoint))
        assert code == 1
        assert out.splitlines()[0] == f"{checkpoint}: model/rank0-0.bin: leaves the checkpoint"

    def test_not_promoted_by_ckptd(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        code, out, _ = cli(capsys, "verify", str(tmp_path))
        assert code == 1
        assert ".ckptd-manifest.json: missing" in out


class TestGc:
    """``ckptd gc ROOT`` lists set-aside failed attempts and stale orphans; ``--yes`` removes."""

    def test_list_then_remove(
        self, start: Start, root: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        daemon = start([root])
        populate(daemon, root)
        # Failed step 4's files were set aside when it failed: that is what gc removes.
        (failed,) = (root / ".ckptd-trash").glob("tmp_step_4.attempt-*")
        assert not (root / "tmp_step_4").exists()
        code, out, _ = cli(capsys, "gc", str(root), "--socket", sock(daemon))
        assert (code, out) == (0, f"would remove (pass --yes): {failed}\n")
        assert failed.is_dir()
        code, out, _ = cli(capsys, "gc", str(root), "--yes", "--socket", sock(daemon))
        assert (code, out) == (0, f"removed: {failed}\n")
        assert not failed.exists()
        with connect(daemon) as client:  # and the daemon forgot step 4
            assert [s["step"] for s in ok(client.request("status"))["saves"]] == [1, 2, 3]
        assert (root / "tmp_step_3").is_dir()  # in flight
        assert (root / "tmp_step_9").is_dir()  # a fresh orphan
        assert (root / "step_1").is_dir() and (root / "step_2").is_dir()
        code, out, _ = cli(capsys, "gc", str(root), "--yes", "--socket", sock(daemon))
        assert (code, out) == (0, f"{root}: nothing to collect\n")

    def test_refused(
        self, start: Start, root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        daemon = start([root])
        code, out, err = cli(capsys, "gc", str(tmp_path), "--socket", sock(daemon))
        assert (code, out) == (1, "")
        assert err.startswith("ckptd: root_not_configured: ")


class TestTail:
    """``ckptd tail --json`` follows the daemon's events as JSON lines."""

    def test_promoted_event(self, start: Start, root: Path) -> None:
        daemon = start([root])
        env = {k: v for k, v in os.environ.items() if k != "CKPTD_SOCKET"}
        with subprocess.Popen(
            [sys.executable, "-m", "daemon", "tail", "--json", "--socket", sock(daemon)],
            stdout=subprocess.PIPE,
            bufsize=0,  # unbuffered: select() then sees every line not yet read
            cwd=REPO,
            env=env,
        ) as tail:
            assert tail.stdout is not None
            try:
                # The subscription is live once tail prints anything: each probe
                # connection makes a client.connected event until it does.
                # Bounded by a deadline, not a count: starting Python under load is slow.
                deadline = time.monotonic() + 60
                while not select.select([tail.stdout], [], [], 0.2)[0]:
                    assert time.monotonic() < deadline, "tail printed nothing"
                    with connect(daemon) as probe:
                        ok(probe.request("ping"))
                assert ok(save(daemon, root, 6))["state"] == "promoted"
                expected = daemon.wait_event("checkpoint.promoted", TIMEOUT)
                while True:
                    ready_now = select.select([tail.stdout], [], [], TIMEOUT)[0]
                    assert ready_now, "no checkpoint.promoted from tail"
                    event = json.loads(tail.stdout.readline())
                    if event["event"] == "checkpoint.promoted":
                        break
                assert event["step"] == 6
                assert event["path"] == str(root / "step_6")
                assert event["timestamp"] == expected["timestamp"]
            finally:
                tail.terminate()
        assert tail.returncode == -15


class TestUsage:
    """Bad configuration exits 2 with a message saying how to fix it."""

    def test_serve_without_root(self, short_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
        code, _, err = cli(capsys, "serve", "--socket", str(short_dir / "d.sock"))
        assert code == 2
        assert "no checkpoint root configured" in err

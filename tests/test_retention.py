"""Retention end to end: a real daemon, real sockets, real files, real restarts.

A root with ``keep_last``, ``keep_best`` and a pin holds exactly the steps the rules say
after every promotion and after the daemon is killed and started again; ``latest`` and
``best`` point right; retired steps go through the trash and are deleted in the
background (``checkpoint.retired``, then ``checkpoint.deleted``).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from daemon.cli import main
from tests import test_spanning
from tests.conftest import DaemonProcess, LineClient
from tests.test_server import TIMEOUT, begin, connect, done, error_code, of, ok, write_files
from tests.test_spanning import Job

pytestmark = pytest.mark.waits

Start = Callable[..., DaemonProcess]
cluster = test_spanning.cluster
"""The fixture of node daemons sharing one root (``tests/test_spanning.py``)."""


def configure(tmp: Path, root: Path, retention: str, **root_keys: str) -> Path:
    """A TOML file with ``root`` and its ``[roots.retention]`` table."""
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in root_keys.items())
    path = tmp / "ckptd.toml"
    path.write_text(f'[[roots]]\npath = "{root}"\n{extra}\n[roots.retention]\n{retention}\n')
    return path


def start_with(start: Start, config: Path, **kw: Any) -> DaemonProcess:
    return start([], "--config", str(config), **kw)


def promote(
    daemon: DaemonProcess,
    root: Path,
    step: int,
    *,
    metrics: dict[str, float] | None = None,
    info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One 2-rank save of ``step``; rank 0's ``done`` carries ``metrics``; wait for it."""
    clients = [LineClient(daemon.socket_path, timeout=TIMEOUT) for _ in range(2)]
    try:
        for rank, client in enumerate(clients):
            ok(begin(client, root, step, rank, 2))
        tmp = root / f"tmp_step_{step}"
        if info is not None:
            (tmp / "training_info.json").write_text(json.dumps(info))
        for rank, client in enumerate(clients):
            files = write_files(tmp, rank)
            if rank == 0 and info is not None:
                size = (tmp / "training_info.json").stat().st_size
                files.append({"path": "training_info.json", "size": size})
            fields: dict[str, Any] = {"metrics": metrics} if rank == 0 and metrics else {}
            ok(client.request("done", root=str(root), step=step, rank=rank, files=files, **fields))
        reply = ok(clients[0].request("wait", root=str(root), step=step, timeout=TIMEOUT))
        assert reply["state"] == "promoted", reply
        return reply
    finally:
        for client in clients:
            client.close()


def steps_on_disk(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("step_"))


def pointer(root: Path, name: str) -> str | None:
    link = root / name
    if link.is_symlink():
        return os.readlink(link)
    text = root / f"{name}.txt"
    return text.read_text().strip() if text.exists() else None


def retention(daemon: DaemonProcess, root: Path, *, apply: bool = False) -> dict[str, Any]:
    with connect(daemon) as client:
        return ok(client.request("retention", root=str(root), apply=apply))


def settle(daemon: DaemonProcess, root: Path) -> dict[str, Any]:
    """Run a pass now and return the judgement (passes run in the background otherwise)."""
    return retention(daemon, root, apply=True)


def doomed(root: Path) -> list[str]:
    area = root / ".ckptd-trash" / "delete"
    return sorted(p.name for p in area.iterdir()) if area.is_dir() else []


POLICY = 'keep_last = 2\nkeep_best = { k = 1, metric = "val_loss", mode = "min", grace_s = 0 }'


class TestPolicyOnDisk:
    """keep_last + keep_best + a pin: exactly the steps the rules say, every promotion."""

    def test_keep_last_best_and_pin(self, start: Start, root: Path, tmp_path: Path) -> None:
        daemon = start_with(start, configure(tmp_path, root, POLICY))
        losses = {100: 3.0, 200: 1.0, 300: 2.5, 400: 2.0, 500: 4.0, 600: 3.5}
        expected = {
            100: [100],
            200: [100, 200],
            300: [200, 300],  # 100 goes: not last-2, not best
            400: [200, 300, 400],  # 300: last-2 with 400
            500: [200, 400, 500],
            600: [200, 500, 600],
        }
        for step, loss in losses.items():
            if step == 400:
                with connect(daemon) as client:
                    ok(client.request("pin", root=str(root), step=300))
            promote(daemon, root, step, metrics={"val_loss": loss})
            settle(daemon, root)
            want = sorted({*expected[step], *([300] if step >= 400 else [])})
            assert steps_on_disk(root) == want, (step, steps_on_disk(root))
            assert pointer(root, "latest") == f"step_{step}"
            assert pointer(root, "best") == ("step_200" if step >= 200 else "step_100")
        daemon.wait_event("checkpoint.retired", TIMEOUT, of(root, 100))
        event = daemon.wait_event("checkpoint.retired", TIMEOUT, of(root, 400))
        assert "keep_last=2" in event["rule"] and "ranked" in event["rule"]
        daemon.wait_event("checkpoint.deleted", TIMEOUT, of(root, 100))
        daemon.wait_event("checkpoint.deleted", TIMEOUT, of(root, 400))
        retired = [e["step"] for e in daemon.drain() if e["event"] == "checkpoint.retired"]
        assert sorted(retired) == [100, 400]
        assert doomed(root) == []  # both deleted: nothing waits in the trash

    def test_restart_keeps_metrics_pins_and_converges(
        self, start: Start, root: Path, tmp_path: Path
    ) -> None:
        config = configure(tmp_path, root, POLICY)
        daemon = start_with(start, config)
        for step, loss in ((1, 1.0), (2, 5.0), (3, 4.0)):
            promote(daemon, root, step, metrics={"val_loss": loss})
        with connect(daemon) as client:
            ok(client.request("pin", root=str(root), step=2))
        settle(daemon, root)
        assert steps_on_disk(root) == [1, 2, 3]
        daemon.kill()
        # Killed and started again with a smaller policy: one pass converges to it.
        config.write_text(config.read_text().replace("keep_last = 2", "keep_last = 1"))
        daemon = start_with(start, config)
        promote(daemon, root, 4, metrics={"val_loss": 3.0})
        report = settle(daemon, root)
        assert steps_on_disk(root) == [1, 2, 4]  # best (1, metric from the journal), pin 2, newest
        kept = {s["step"]: s["kept"] for s in report["steps"]}
        assert kept[1] == ["best", "best-1"]
        assert "pinned" in kept[2]
        assert kept[4] == ["newest", "latest", "last-1"]
        assert pointer(root, "best") == "step_1"
        daemon.kill()
        daemon = start_with(start, config)
        assert steps_on_disk(root) == [1, 2, 4]
        report = settle(daemon, root)
        assert report["retired"] == []
        metrics = {s["step"]: s.get("metrics", {}) for s in report["steps"]}
        assert metrics[1] == {"val_loss": 1.0}
        with connect(daemon) as client:
            ok(client.request("unpin", root=str(root), step=2))
        settle(daemon, root)
        assert steps_on_disk(root) == [1, 4]


class TestMetrics:
    """Metrics from done, training_info.json and score judge keep_best; bad ones are refused."""

    def test_training_info_and_score(self, start: Start, root: Path, tmp_path: Path) -> None:
        policy = 'keep_last = 1\nkeep_best = { k = 1, metric = "val:accuracy", mode = "max" }'
        daemon = start_with(start, configure(tmp_path, root, policy))
        info = {"step": 10, "val:accuracy": 0.5, "note": "x", "flag": True}
        promote(daemon, root, 10, info=info)
        report = settle(daemon, root)
        by = {s["step"]: s for s in report["steps"]}
        assert by[10]["metrics"] == {"step": 10.0, "val:accuracy": 0.5}
        promote(daemon, root, 20)  # no metric: kept unscored within the grace period
        report = settle(daemon, root)
        assert {s["step"]: s["kept"] for s in report["steps"]} == {
            10: ["best", "best-1"],
            20: ["newest", "latest", "last-1", "unscored"],
        }
        promote(daemon, root, 30, metrics={"val:accuracy": 0.1})
        settle(daemon, root)
        assert steps_on_disk(root) == [10, 20, 30]
        socket = str(daemon.socket_path)
        assert main(["score", str(root), "20", "val:accuracy=0.9", "--socket", socket]) == 0
        report = settle(daemon, root)
        assert pointer(root, "best") == "step_20"
        assert steps_on_disk(root) == [20, 30]  # 10 lost best; 30 is the newest

    def test_bad_metrics_are_refused(self, start: Start, root: Path, tmp_path: Path) -> None:
        daemon = start_with(start, configure(tmp_path, root, POLICY))
        with connect(daemon) as client:
            ok(begin(client, root, 1, 0, 1))
            files = write_files(root / "tmp_step_1", 0)
            bad = client.request(
                "done", root=str(root), step=1, rank=0, files=files, metrics={"val_loss": "low"}
            )
            assert error_code(bad) == "invalid_field"
            ok(done(client, root, 1, 0, files))
            ok(client.request("wait", root=str(root), step=1, timeout=TIMEOUT))
            assert (
                error_code(
                    client.request("score", root=str(root), step=1, metrics={"bad name": 1.0})
                )
                == "invalid_field"
            )
            assert (
                error_code(
                    client.request("score", root=str(root), step=9, metrics={"val_loss": 1.0})
                )
                == "not_found"
            )
            assert error_code(client.request("hold", root=str(root), step=9, ttl=5)) == "not_found"


class TestConfig:
    """[roots.retention] is validated with messages that say how to fix it."""

    @pytest.mark.parametrize(
        ("table", "message"),
        [
            ("", "no keep rule"),
            ("keep_last = -1", "keep_last must be an integer >= 0"),
            ("keep_every_steps = 0", "keep_every_steps must be an integer >= 1"),
            ('keep_best = { k = 1, metric = "x" }', "keep_best needs mode"),
            ('keep_best = { k = 1, metric = "x", mode = "up" }', 'mode must be "min"'),
            ('keep_best = { k = 0, metric = "x", mode = "min" }', "keep_best.k must be"),
            ("keep_last = 1\nkeep_forever = true", "unknown keys"),
            ('keep_last = 1\nbest_pointer = "latest"', "is the root's pointer too"),
            ('keep_best = { k = 1, unscored = "later" }', 'unscored must be "grace"'),
            ("keep_best = { k = 1 }", "keep_best needs metric"),
            ('keep_best = { k = 1, unscored = "worst", every_steps = 0 }', "every_steps must"),
            ('keep_best = { k = 1, unscored = "worst", grace_s = 5 }', "remove grace_s"),
        ],
    )
    def test_bad_tables(
        self,
        root: Path,
        tmp_path: Path,
        table: str,
        message: str,
        capsys: pytest.CaptureFixture[str],
    ) -> None:
        config = configure(tmp_path, root, table)
        code = main(["serve", "--config", str(config), "--socket", str(tmp_path / "x.sock")])
        assert code == 2
        assert message in capsys.readouterr().err


class TestHoldsAndPins:
    """A held step outlives the policy until its hold ends; then a pass retires it."""

    def test_hold_then_expiry(self, start: Start, root: Path, tmp_path: Path) -> None:
        daemon = start_with(start, configure(tmp_path, root, "keep_last = 1"))
        promote(daemon, root, 1)
        socket = str(daemon.socket_path)
        assert main(["hold", str(root), "1", "--ttl", "3", "--socket", socket]) == 0
        promote(daemon, root, 2)
        report = settle(daemon, root)
        assert steps_on_disk(root) == [1, 2]
        assert {s["step"]: s["kept"] for s in report["steps"]}[1] == ["held"]
        # No request needed: the pass due when the hold ends retires it.
        event = daemon.wait_event("checkpoint.retired", TIMEOUT, of(root, 1))
        assert event["rule"].startswith("keep_last=1")
        daemon.wait_event("checkpoint.deleted", TIMEOUT, of(root, 1))
        assert steps_on_disk(root) == [2]

    def test_hold_survives_a_restart(self, start: Start, root: Path, tmp_path: Path) -> None:
        config = configure(tmp_path, root, "keep_last = 1")
        daemon = start_with(start, config)
        promote(daemon, root, 1)
        with connect(daemon) as client:
            ok(client.request("hold", root=str(root), step=1, ttl=600))
        daemon.kill()
        daemon = start_with(start, config)
        promote(daemon, root, 2)
        settle(daemon, root)
        assert steps_on_disk(root) == [1, 2]
        with connect(daemon) as client:
            ok(client.request("hold", root=str(root), step=1, ttl=0))  # released
        settle(daemon, root)
        assert steps_on_disk(root) == [2]

    def test_pin_unknown_step_is_refused(self, start: Start, root: Path, tmp_path: Path) -> None:
        daemon = start_with(start, configure(tmp_path, root, "keep_last = 1"))
        socket = str(daemon.socket_path)
        assert main(["pin", str(root), "7", "--socket", socket]) == 1
        promote(daemon, root, 7)
        assert main(["pin", str(root), "7", "--socket", socket]) == 0
        promote(daemon, root, 8)
        promote(daemon, root, 9)
        settle(daemon, root)
        assert steps_on_disk(root) == [7, 9]
        assert main(["unpin", str(root), "7", "--socket", socket]) == 0
        settle(daemon, root)
        assert steps_on_disk(root) == [9]


class TestCrash:
    """A crash after the renames into the trash, before the journal: deletion resumes."""

    def test_killed_after_doom(self, start: Start, root: Path, tmp_path: Path) -> None:
        config = configure(tmp_path, root, "keep_last = 1")
        daemon = start_with(start, config)
        promote(daemon, root, 1)
        daemon.kill()
        daemon = start_with(start, config, env={"CKPTD_CRASH_AT": "retention_after_doom"})
        clients = [LineClient(daemon.socket_path, timeout=TIMEOUT)]
        try:
            ok(begin(clients[0], root, 2, 0, 1))
            ok(done(clients[0], root, 2, 0, write_files(root / "tmp_step_2", 0)))
        finally:
            clients[0].close()
        daemon.wait_event("_exit", TIMEOUT)
        assert daemon.stop() == 137
        assert steps_on_disk(root) == [2]
        assert [n.split(".")[0] for n in doomed(root)] == ["step_1"]
        daemon = start_with(start, config)  # resumes the deletion, keeps exactly step 2
        daemon.wait_event("checkpoint.deleted", TIMEOUT, of(root, 1))
        assert doomed(root) == []
        assert steps_on_disk(root) == [2]
        assert pointer(root, "latest") == "step_2"
        with connect(daemon) as client:  # the retired step may be saved afresh
            ok(begin(client, root, 1, 0, 1))


class TestCli:
    """`ckptd ls` says why each step is kept; `ckptd gc --policy` what would go."""

    def test_ls_and_gc_policy(
        self, start: Start, root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        policy = 'keep_every_steps = 10\nkeep_best = { k = 1, metric = "loss", mode = "min" }'
        config = configure(tmp_path, root, policy)
        daemon = start_with(start, config)
        socket = str(daemon.socket_path)
        for step, loss in ((10, 1.0), (15, 2.0), (20, 3.0)):
            promote(daemon, root, step, metrics={"loss": loss})
        settle(daemon, root)
        capsys.readouterr()
        assert main(["ls", str(root), "--socket", socket]) == 0
        out = capsys.readouterr().out
        assert out.splitlines()[0].split() == ["STEP", "STATE", "SIZE", "FILES", "KEPT", "PATH"]
        lines = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
        assert lines["10"][5] == "best,every-10,best-1"
        assert lines["20"][6] == "newest,latest,every-10"  # "20 *": the latest mark
        assert "15" not in lines  # ranked 2nd of k=1, not a multiple of 10: retired
        assert main(["gc", str(root), "--policy", "--socket", socket]) == 0
        out = capsys.readouterr().out
        assert "policy keep_every_steps=10 keep_best=1:loss:min" in out
        assert "nothing to retire" in out
        assert steps_on_disk(root) == [10, 20]


class TestDocumentedConfig:
    """The policy in systemd/ckptd.toml (commented out there) loads as documented."""

    def test_example(self, root: Path, tmp_path: Path) -> None:
        from daemon import load_config

        text = (Path(__file__).parent.parent / "systemd" / "ckptd.toml").read_text()
        block = text[text.index("# [roots.retention]") :].split("\n\n")[0]
        table = "\n".join(line[2:] for line in block.splitlines())
        path = tmp_path / "example.toml"
        path.write_text(f'[[roots]]\npath = "{root}"\n\n{table}\n')
        (loaded,) = load_config(config_file=str(path)).roots
        assert loaded.retention is not None
        assert loaded.retention.policy.describe() == (
            "keep_last=3 keep_every_steps=1000 keep_best=2:val_loss:min"
        )
        assert loaded.retention.best_pointer == "best"


class TestNotOurs:
    """A step_N the daemon did not promote is never retired, and never counted."""

    def test_foreign_step_dirs_stay(self, start: Start, root: Path, tmp_path: Path) -> None:
        (root / "step_1").mkdir()  # copied in by hand: no manifest
        (root / "step_1" / "weights.bin").write_bytes(b"x")
        (root / "step_2").write_text("a file, not a checkpoint")
        (root / "step_3").mkdir()  # a manifest naming another step
        (root / "step_3" / ".ckptd-manifest.json").write_text(
            json.dumps({"root": str(root), "step": 30, "created": ""})
        )
        daemon = start_with(start, configure(tmp_path, root, "keep_last = 1"))
        for step in (10, 11, 12):
            promote(daemon, root, step)
        report = settle(daemon, root)
        kept = {s["step"]: s["kept"] for s in report["steps"]}
        assert kept == {
            1: ["incomplete"],
            2: ["incomplete"],
            3: ["incomplete"],
            12: ["newest", "latest", "last-1"],
        }
        assert steps_on_disk(root) == [1, 2, 3, 12]
        assert (root / "step_1" / "weights.bin").read_bytes() == b"x"

    def test_a_step_restored_from_a_backup_stays(
        self, start: Start, root: Path, tmp_path: Path
    ) -> None:
        backup = tmp_path / "backup"
        backup.mkdir()
        daemon = start_with(start, configure(tmp_path, root, "keep_last = 2"))
        promote(daemon, root, 1)
        promote(daemon, root, 2)
        # An operator's backup of a promoted checkpoint, manifest and all.
        subprocess.run(["cp", "-a", str(root / "step_1"), str(backup)], check=True)
        promote(daemon, root, 3)
        daemon.wait_event("checkpoint.deleted", TIMEOUT, of(root, 1))
        assert steps_on_disk(root) == [2, 3]
        # Restored: as itself, beside newer steps, and under another step's name.
        subprocess.run(["cp", "-a", str(backup / "step_1"), str(root / "step_1")], check=True)
        subprocess.run(["cp", "-a", str(backup / "step_1"), str(root / "step_7")], check=True)
        promote(daemon, root, 4)
        promote(daemon, root, 5)
        report = settle(daemon, root)
        kept = {s["step"]: s["kept"] for s in report["steps"]}
        assert kept == {
            1: ["incomplete"],
            5: ["newest", "latest", "last-2"],
            4: ["last-2"],
            7: ["incomplete"],
        }
        assert steps_on_disk(root) == [1, 4, 5, 7]
        assert main(["verify", str(root / "step_1")]) == 0  # still a whole checkpoint
        # Events reach stdout a moment after they happen: up to step 3's retirement.
        daemon.wait_event("checkpoint.retired", TIMEOUT, of(root, 3))
        retired = [e["step"] for e in daemon.drain() if e["event"] == "checkpoint.retired"]
        assert sorted(retired) == [1, 2, 3]  # step 1 once, before its backup came back


class TestSharedRoot:
    """On a root shared between nodes, only the leader (rank 0's daemon) prunes."""

    def test_only_the_leader_prunes(
        self, cluster: Callable[..., Job], tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        root = tmp_path / "ckpt"
        root.mkdir()
        config = configure(tmp_path, root, "keep_last = 1")
        job = cluster(2, 1, "--config", str(config), configured=True)
        leader, follower = job.daemons
        with connect(leader) as client:
            for step in (1, 2):
                assert all(r["ok"] for r in job.begin_all(step).values())
                for rank in (0, 1):
                    ok(job.write_and_done(step, rank))
                assert job.wait(0, step)["state"] == "promoted"
                if step == 1:
                    ok(client.request("pin", root=str(root), step=1))  # the leader's pin
        with connect(follower) as client:  # the leader's pin is on the root: it knows it
            report = ok(client.request("retention", root=str(root), apply=True))
        assert report["info"]["prunes"] is False and report["retired"] == []
        assert {s["step"]: s.get("pinned", False) for s in report["steps"]} == {1: True, 2: False}
        assert steps_on_disk(root) == [1, 2]
        capsys.readouterr()
        socket = str(follower.socket_path)
        assert main(["gc", str(root), "--policy", "--yes", "--socket", socket]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0] == f"{root}: policy keep_last=1 (not pruned here)"
        assert out[1].startswith("nothing to retire"), out
        assert steps_on_disk(root) == [1, 2]
        with connect(leader) as client:
            report = ok(client.request("retention", root=str(root), apply=True))
            assert "prunes" not in report["info"]  # true, the default, is left out
            ok(client.request("unpin", root=str(root), step=1))
            ok(client.request("retention", root=str(root), apply=True))
        assert steps_on_disk(root) == [2]


class TestReload:
    """A reload (SIGHUP) applies a changed policy at once, and a new one."""

    def test_policy_shrinks_and_appears(self, start: Start, root: Path, tmp_path: Path) -> None:
        import signal

        other = tmp_path / "other"
        other.mkdir()
        config = configure(tmp_path, root, "keep_last = 3")
        text = config.read_text()
        config.write_text(f'[[roots]]\npath = "{other}"\n\n' + text)
        daemon = start_with(start, config)
        for step in (1, 2, 3):
            promote(daemon, root, step)
            promote(daemon, other, step)
        assert steps_on_disk(root) == [1, 2, 3] and steps_on_disk(other) == [1, 2, 3]
        config.write_text(
            f'[[roots]]\npath = "{other}"\n[roots.retention]\nkeep_last = 2\n\n'
            + text.replace("keep_last = 3", "keep_last = 1")
        )
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGHUP)
        reloaded = daemon.wait_event("config.reloaded", TIMEOUT)
        assert sorted(reloaded["changed"]) == sorted([str(root), str(other)])
        for step in (1, 2):
            daemon.wait_event("checkpoint.retired", TIMEOUT, of(root, step))
        daemon.wait_event("checkpoint.retired", TIMEOUT, of(other, 1))
        assert steps_on_disk(root) == [3] and steps_on_disk(other) == [2, 3]


class TestCheckConfig:
    """`ckptd check-config` shows a root's policy, and refuses a bad one with exit 2."""

    def test_summary_and_refusal(
        self, root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        good = configure(tmp_path, root, POLICY)
        assert main(["check-config", str(good)]) == 0
        out = capsys.readouterr().out
        assert "    retention: keep_last=2 keep_best=1:val_loss:min, best pointer best" in out
        bad = configure(tmp_path, root, 'keep_last = "two"')
        assert main(["check-config", str(bad)]) == 2
        assert "keep_last must be an integer >= 0, got 'two'" in capsys.readouterr().err

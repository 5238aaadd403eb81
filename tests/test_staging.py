"""A root's ``staging`` directory: steps written outside the root, promoted into it.

A trainer that lists its output directory (transformers' ``Trainer`` counts every
``checkpoint-*`` entry) must never see a save in flight there. With ``staging`` set,
``tmp_step_N`` lives in that directory, beside the root on its filesystem, and the
promotion renames it into the root. Real daemons, real files, a real restart.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from daemon.base._errors import ConfigError
from daemon.cli import main
from daemon.config._config import load_config
from daemon.config._root import RootConfig
from daemon.ops._reload import LAYOUT, plan_reload
from orchestrator import protocol as p
from orchestrator._layout import Layouts, read_layout_file
from tests.conftest import DaemonProcess, LineClient
from tests.test_server import TIMEOUT, begin, connect, done, of, ok, set_mtime, write_files

Start = Callable[..., DaemonProcess]


def config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "ckptd.toml"
    path.write_text(body)
    return path


def dirs(tmp_path: Path) -> tuple[Path, Path]:
    """An output directory (the root) and a staging directory beside it."""
    root, staging = tmp_path / "out", tmp_path / "out.staging"
    root.mkdir()
    staging.mkdir()
    return root, staging


class TestConfig:
    """A staging directory is absolute, existing, outside every root, on the root's device."""

    def test_accepted(self, tmp_path: Path) -> None:
        root, staging = dirs(tmp_path)
        cfg = load_config(
            config_file=str(
                config(tmp_path, f'[[roots]]\npath = "{root}"\nstaging = "{staging}"\n')
            ),
            env={},
        )
        (loaded,) = cfg.roots
        assert loaded.staging == str(staging)
        assert loaded.tmp_dir(3) == str(staging / "tmp_step_3")
        assert loaded.final_dir(3) == str(root / "step_3")

    @pytest.mark.parametrize(
        ("where", "message"),
        [
            ("inside", "must be outside the root"),
            ("holder", "must be outside the root"),
            ("relative", "must be an absolute path"),
            ("missing", "is not an existing directory"),
            ("other-fs", "on another filesystem"),
        ],
    )
    def test_refused(self, tmp_path: Path, where: str, message: str) -> None:
        root, _ = dirs(tmp_path)
        inside = root / "stage"
        inside.mkdir()
        value = {
            "inside": str(inside),
            "holder": str(tmp_path),
            "relative": "out.staging",
            "missing": str(tmp_path / "nowhere"),
            "other-fs": "/dev/shm",
        }[where]
        if where == "other-fs" and os.stat("/dev/shm").st_dev == os.stat(root).st_dev:
            pytest.skip("/dev/shm is on the same filesystem as the test's directory here")
        body = f'[[roots]]\npath = "{root}"\nstaging = "{value}"\n'
        with pytest.raises(ConfigError, match=message):
            load_config(config_file=str(config(tmp_path, body)), env={})

    @pytest.mark.parametrize("other", ["same-staging", "staging-is-a-root", "inside-a-root"])
    def test_overlap_refused(self, tmp_path: Path, other: str) -> None:
        root, staging = dirs(tmp_path)
        second = tmp_path / "second"
        second.mkdir()
        (second / "stage").mkdir()
        theirs = {
            "same-staging": f'staging = "{staging}"',
            "staging-is-a-root": "",
            "inside-a-root": "",
        }[other]
        mine = {
            "same-staging": staging,
            "staging-is-a-root": second,
            "inside-a-root": second / "stage",
        }[other]
        body = (
            f'[[roots]]\npath = "{root}"\nstaging = "{mine}"\n\n'
            f'[[roots]]\npath = "{second}"\n{theirs}\n'
        )
        with pytest.raises(ConfigError, match="overlap"):
            load_config(config_file=str(config(tmp_path, body)), env={})

    def test_check_config_names_it(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        root, staging = dirs(tmp_path)
        path = config(tmp_path, f'[[roots]]\npath = "{root}"\nstaging = "{staging}"\n')
        assert main(["check-config", str(path)]) == 0
        assert (
            f"  {root}: {staging}/tmp_step_N -> step_N, pointer latest" in capsys.readouterr().out
        )

    def test_object_store_root_has_none(self) -> None:
        with pytest.raises(ConfigError, match="no staging directory"):
            RootConfig(path="s3://bucket/run", staging="/tmp")

    def test_reload_treats_it_as_layout(self, tmp_path: Path) -> None:
        """A reload may change it, as it may the names, once no save is in flight there."""
        root, staging = dirs(tmp_path)
        before = load_config(
            config_file=str(config(tmp_path, f'[[roots]]\npath = "{root}"\n')), env={}
        )
        after = load_config(
            config_file=str(
                config(tmp_path, f'[[roots]]\npath = "{root}"\nstaging = "{staging}"\n')
            ),
            env={},
        )
        (change,) = plan_reload(before, after).changed
        assert change.fields == ("staging",) and change.layout and "staging" in LAYOUT


class TestLayoutFile:
    """A client names the staged directory without asking, from the root's layout file."""

    def test_client_reads_it(self, tmp_path: Path) -> None:
        root, staging = dirs(tmp_path)
        info = p.RootInfo(str(root), "tmp_step_", "checkpoint-", "latest", str(staging))
        (root / p.LAYOUT_FILE).write_bytes(msgspec.json.encode(info))
        assert read_layout_file(str(root)) == (str(staging), "tmp_step_")
        assert Layouts().known(str(root), 7) == str(staging / "tmp_step_7")

    def test_a_relative_staging_is_not_trusted(self, tmp_path: Path) -> None:
        root, _ = dirs(tmp_path)
        layout = {"path": str(root), "tmp_prefix": "t_", "final_prefix": "s_", "pointer": "l"}
        (root / p.LAYOUT_FILE).write_text(json.dumps({**layout, "staging": "rel"}))
        assert read_layout_file(str(root)) is None
        (root / p.LAYOUT_FILE).write_text(json.dumps(layout))  # no staging: the root
        assert read_layout_file(str(root)) == (str(root), "t_")


def serve(start: Start, tmp_path: Path, root: Path, staging: Path) -> DaemonProcess:
    body = f'[[roots]]\npath = "{root}"\nstaging = "{staging}"\nfinal_prefix = "checkpoint-"\n'
    return start([], "--config", str(config(tmp_path, body)))


class TestDaemon:
    """Attempts, promotion, set-asides, recovery and gc work in the staging directory."""

    def test_promoted_from_staging(self, start: Start, tmp_path: Path) -> None:
        root, staging = dirs(tmp_path)
        daemon = serve(start, tmp_path, root, staging)
        written = json.loads((root / p.LAYOUT_FILE).read_text())
        assert written["staging"] == str(staging)
        with connect(daemon) as client:
            reply = ok(begin(client, root, 2, 0, 1))
            assert reply["path"] == str(staging / "tmp_step_2")
            assert (staging / "tmp_step_2" / p.ATTEMPT_MARKER).is_file()
            assert not [n for n in os.listdir(root) if n.startswith("tmp_step_")]
            ok(done(client, root, 2, 0, write_files(staging / "tmp_step_2", 0)))
            daemon.wait_event("checkpoint.promoted", TIMEOUT, of(root, 2))
        assert (root / "checkpoint-2" / "model" / "rank0-0.bin").is_file()
        assert os.readlink(root / "latest") == "checkpoint-2"
        assert os.listdir(staging) == []

    def test_failed_attempt_set_aside_then_collected(
        self, start: Start, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        root, staging = dirs(tmp_path)
        orphan = staging / "tmp_step_9"
        write_files(orphan, 0)
        set_mtime(orphan, 1_000_000_000.0)  # untouched for years: an orphan
        daemon = serve(start, tmp_path, root, staging)
        with connect(daemon) as client:
            ok(begin(client, root, 4, 0, 1))
            write_files(staging / "tmp_step_4", 0)
            ok(client.request("fail", root=str(root), step=4, rank=0, reason="boom"))
            kept = Path(daemon.wait_event("save.set_aside", TIMEOUT, of(root, 4))["path"])
        assert kept.parent == root / ".ckptd-trash" and not (staging / "tmp_step_4").exists()
        argv = ["gc", str(root), "--socket", str(daemon.socket_path)]
        capsys.readouterr()
        assert main(argv) == 0
        listed = capsys.readouterr().out
        assert f"would remove (pass --yes): {orphan}\n" in listed
        assert f"would remove (pass --yes): {kept}\n" in listed
        assert main([*argv, "--yes"]) == 0
        assert not orphan.exists() and not kept.exists()

    def test_restarted_daemon_finishes_the_save(self, start: Start, tmp_path: Path) -> None:
        """A save begun before a SIGKILL is recovered from the staging directory."""
        root, staging = dirs(tmp_path)
        daemon = serve(start, tmp_path, root, staging)
        client = LineClient(daemon.socket_path)
        ok(begin(client, root, 5, 0, 1))
        files = write_files(staging / "tmp_step_5", 0)
        daemon.stop(signal.SIGKILL)
        client.sock.close()
        client.file.close()
        again = start([], "--config", str(tmp_path / "ckptd.toml"))  # its journal kept
        with connect(again) as client2:
            ok(begin(client2, root, 5, 0, 1))
            ok(done(client2, root, 5, 0, files))
            again.wait_event("checkpoint.promoted", TIMEOUT, of(root, 5))
        assert (root / "checkpoint-5" / "model" / "rank0-1.bin").is_file()
        assert os.listdir(staging) == []

    def test_ls_shows_the_staged_save(
        self, start: Start, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        root, staging = dirs(tmp_path)
        daemon = serve(start, tmp_path, root, staging)
        with connect(daemon) as client:
            ok(begin(client, root, 6, 0, 1))
            capsys.readouterr()
            assert main(["ls", str(root), "--json", "--socket", str(daemon.socket_path)]) == 0
            rows = json.loads(capsys.readouterr().out)
        assert [(r["step"], r["path"]) for r in rows] == [(6, str(staging / "tmp_step_6"))]

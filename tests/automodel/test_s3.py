"""``AutomodelCheckpointManager`` on an ``s3://`` root served by a real SeaweedFS.

Two real gloo ranks run nemo_automodel's real ``Checkpointer`` (async, DCP in each
rank's upload process) through the manager; each rank stages its part locally and
uploads its own files under the attempt's prefix; a real daemon verifies by LIST and
``.metadata`` and commits with one create-only write. A fresh manager then loads
``orchestrator.latest``'s URL and gets the saved weights, optimizer and scheduler back.
A rank whose upload the store refuses fails the step: nothing is committed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from daemon.cli import main as ckptd
from tests._s3 import S3Server, serve
from tests.automodel.conftest import RankJob
from tests.conftest import DaemonProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def seaweed() -> Iterator[S3Server]:
    yield from serve("seaweedfs")


def _commit(server: S3Server, root: str, step: int) -> dict[str, Any] | None:
    """The step's commit object, or None if it has none."""
    key = f"{root.split('/', 3)[3]}/step_{step}/.ckptd-commit.json"
    if f"step_{step}/.ckptd-commit.json" not in server.keys(root):
        return None
    body = server.client().get_object(Bucket=server.bucket, Key=key)["Body"]
    with body:
        found: dict[str, Any] = msgspec.json.decode(body.read())
    return found


def _start(
    server: S3Server,
    daemon_factory: Callable[..., DaemonProcess],
    rank_jobs: Callable[..., RankJob],
    staging: Path,
    *args: str,
) -> tuple[str, DaemonProcess, RankJob]:
    root = server.root()
    daemon = daemon_factory([], "--root", root, "--lease", "2", env=server.env())
    env = {**server.env(), "CKPTD_STAGING_DIR": str(staging)}
    job = rank_jobs("s3", "--root", root, *args, socket_path=daemon.socket_path, env=env)
    for rank in (0, 1):
        assert job.wait_line("ready", rank=rank, timeout=120)["uses_daemon"] is True
    return root, daemon, job


def _of(step: int) -> Callable[[dict[str, Any]], bool]:
    """Matches an event of ``step``."""
    return lambda event: event.get("step") == step


def _staged_files(staging: Path) -> list[Path]:
    return [p for p in staging.rglob("*") if p.is_file()]


class TestSaveCommitLoad:
    """Each rank uploads its own files; the daemon commits; a fresh manager loads them."""

    @pytest.mark.parametrize("fmt", ["torch_save", "safetensors"])
    def test_roundtrip(
        self,
        fmt: str,
        seaweed: S3Server,
        daemon_factory: Callable[..., DaemonProcess],
        rank_jobs: Callable[..., RankJob],
        tmp_path: Path,
    ) -> None:
        staging = tmp_path / "staging"
        args = ("--format", fmt, "--steps", "1,2")
        root, daemon, job = _start(seaweed, daemon_factory, rank_jobs, staging, *args)
        urls = {}
        for step in (1, 2):
            promoted = daemon.wait_event("checkpoint.promoted", timeout=120, match=_of(step))
            urls[step] = f"{root}/step_{step}/{promoted['attempt']}"
            assert promoted["path"] == urls[step]
        for rank in (0, 1):
            settled = job.wait_line("settled", rank=rank)
            assert settled["states"] == {"1": "promoted", "2": "promoted"}
            # The fresh manager loaded the latest step, and got back what was saved.
            loaded = job.wait_line("loaded", rank=rank, timeout=120)
            assert loaded["url"] == urls[2]
            assert loaded["mismatches"] == [], loaded
            assert loaded["optimizer_entries"] > 0
        assert job.wait() == [0, 0]

        # Every rank's files are objects of the attempt, named by the commit object.
        attempt = urls[2].rsplit("/", 1)[1]
        commit = _commit(seaweed, root, 2)
        assert commit is not None and commit["attempt"] == attempt
        named = set(commit["objects"])
        dcp_dirs = ["policy/optimizer/optim"]
        if fmt == "torch_save":
            dcp_dirs.append("policy/weights/model")
        else:  # nemo_automodel's sharded safetensors: one file per rank
            for rank in (0, 1):
                shard = f"policy/weights/model/shard-{rank + 1:05d}-model-"
                assert any(k.startswith(shard) for k in named), (rank, named)
        for dcp_dir in dcp_dirs:
            assert f"{dcp_dir}/.metadata" in named
            for rank in (0, 1):
                assert any(k.startswith(f"{dcp_dir}/__{rank}_") for k in named), (rank, named)
        assert {"policy/tokenizer/tokenizer.json", "train_dataloader.pt"} <= named
        keys = seaweed.keys(root)
        for key, (size, *_etag) in commit["objects"].items():
            assert keys[f"step_2/{attempt}/{key}"] == size
        # Nothing of the step lives under a tmp prefix, and the ranks kept no copies.
        assert not [k for k in keys if k.startswith("tmp_step_")]
        assert _staged_files(staging) == []
        with pytest.MonkeyPatch.context() as patch:
            for key, value in seaweed.env().items():
                patch.setenv(key, value)
            for step in (1, 2):
                assert ckptd(["verify", f"{root}/step_{step}"]) == 0


class TestUploadFails:
    """A rank whose upload the store refuses fails the step; nothing is committed."""

    def test_refused_upload_commits_nothing(
        self,
        seaweed: S3Server,
        daemon_factory: Callable[..., DaemonProcess],
        rank_jobs: Callable[..., RankJob],
        tmp_path: Path,
    ) -> None:
        staging = tmp_path / "staging"
        args = ("--bad-secret-rank", "1", "--steps", "1")
        root, daemon, job = _start(seaweed, daemon_factory, rank_jobs, staging, *args)
        failed = daemon.wait_event("checkpoint.failed", timeout=120)
        assert failed["step"] == 1
        # The store's refusal of rank 1's PUT, as the rank reported it.
        assert failed["reason"].startswith("rank 1 failed: PermissionError"), failed
        for rank in (0, 1):
            assert job.wait_line("settled", rank=rank)["states"] == {"1": "failed"}
        assert job.wait() == [0, 0]
        assert not [e for e in daemon.drain() if e["event"] == "checkpoint.promoted"]
        keys = seaweed.keys(root)
        assert _commit(seaweed, root, 1) is None
        assert "latest" not in keys
        # Rank 0's objects are kept under the failed attempt's prefix, for inspection.
        attempt = failed["attempt"]
        assert f"step_1/{attempt}/policy/weights/model/.metadata" in keys
        assert not [k for k in keys if k.startswith(f"step_1/{attempt}/") and "/__1_" in k]
        assert _staged_files(staging) == []

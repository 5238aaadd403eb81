"""A real 2-rank NeMo-RL loop checkpointing through a real ``ckptd serve`` (gloo, CPU).

Each rank runs ``AutomodelCheckpointManager`` on the real Checkpointer with async
saves: model and optimizer uploads run in each rank's DCP upload process. The test
holds a step in two ways, without sleeping: it freezes rank 1's upload process
(SIGSTOP, before the step's save starts, so its uploads cannot land), or it holds rank 0
at a FIFO gate before the caller's last file. Nothing is promoted while either holds.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from daemon.cli import main as ckptd
from tests._files import snapshot
from tests.automodel.conftest import RankJob, release
from tests.conftest import DaemonProcess, LineClient

pytestmark = pytest.mark.slow


def _state(daemon: DaemonProcess, root: Path, step: int) -> str | None:
    with LineClient(daemon.socket_path) as client:
        reply = client.request("status", root=str(root))
    states = [s["state"] for s in reply["saves"] if s["step"] == step]
    return states[0] if states else None


def _gates(directory: Path) -> Path:
    for rank in (0, 1):
        os.mkfifo(directory / f"gate{rank}")
    return directory


def _assert_model_loads(step_dir: Path, side: Path, step: int) -> None:
    """``dcp.load`` from the promoted step gives back the model rank 0 saved."""
    expected: dict[str, torch.Tensor] = torch.load(side / f"model_step_{step}.pt")
    loaded = {key: torch.empty_like(value) for key, value in expected.items()}
    dcp_load(loaded, checkpoint_id=str(step_dir / "policy/weights/model"), no_dist=True)
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key


def _assert_optimizer_loads(step_dir: Path) -> int:
    """Every tensor the optimizer checkpoint's metadata lists can be read back."""
    path = str(step_dir / "policy/optimizer/optim")
    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    tensors = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    dcp_load(tensors, checkpoint_id=path, no_dist=True)
    assert any(key.endswith(".exp_avg") for key in tensors)
    return len(tensors)


class TestNemoRlLoop:
    """step_N appears only when every rank's uploads and the caller's last file landed."""

    def test_loop_through_daemon(
        self,
        daemon_factory: Callable[..., DaemonProcess],
        rank_jobs: Callable[..., RankJob],
        root: Path,
        short_dir: Path,
        tmp_path: Path,
    ) -> None:
        gates = _gates(short_dir)
        side = tmp_path / "side"
        side.mkdir()
        daemon = daemon_factory([root])
        job = rank_jobs(
            "loop",
            "--root", str(root),
            "--side", str(side),
            "--steps", "1,2,3",
            "--hold-rank", "1",
            "--hold-before-step", "2",
            "--hold-file-step", "3",
            "--final-step", "4",
            "--gate-dir", str(gates),
            socket_path=daemon.socket_path,
        )  # fmt: skip
        for rank in (0, 1):
            assert job.wait_line("ready", rank=rank)["uses_daemon"] is True
        daemon.wait_event("checkpoint.promoted", timeout=120, match=lambda e: e["step"] == 1)

        # Step 2: rank 1's upload process is frozen before the save starts.
        held = job.wait_line("held", rank=1, at="before_save", step=2)
        upload_pid = int(held["upload_pid"])
        os.kill(upload_pid, signal.SIGSTOP)
        try:
            release(gates / "gate1")
            for rank in (0, 1):
                # save_checkpoint returned, the step was sealed, training went on.
                job.wait_line("save_returned", rank=rank, step=2)
                job.wait_line("trained", rank=rank, after_step=2)
            assert _state(daemon, root, 2) == "open"
            assert not (root / "step_2").exists()
            assert not (root / "tmp_step_2/policy/optimizer/optim/.metadata").exists()
        finally:
            os.kill(upload_pid, signal.SIGCONT)
        promoted = daemon.wait_event("checkpoint.promoted", match=lambda e: e["step"] == 2)
        assert promoted["path"] == str(root / "step_2")

        # Step 3: every upload lands; rank 0 has not written the caller's last file.
        job.wait_line("held", rank=0, at="before_last_file", step=3)
        daemon.wait_event("save.rank_done", match=lambda e: e["step"] == 3 and e["rank"] == 1)
        assert (root / "tmp_step_3/policy/optimizer/optim/.metadata").is_file()
        assert (root / "tmp_step_3/policy/weights/model/.metadata").is_file()
        assert _state(daemon, root, 3) == "open"
        assert not (root / "step_3").exists()
        release(gates / "gate0")
        daemon.wait_event("checkpoint.promoted", match=lambda e: e["step"] == 3)

        # Step 4: safetensors, consolidated to HF format after the upload.
        daemon.wait_event("checkpoint.promoted", timeout=120, match=lambda e: e["step"] == 4)
        assert job.wait() == [0, 0]

        events = daemon.drain()
        for step in (2, 3, 4):
            names = [
                (e["event"], e.get("rank"))
                for e in events
                if e.get("step") == step and e["event"].startswith(("save.", "checkpoint."))
            ]
            last_done = max(i for i, n in enumerate(names) if n[0] == "save.rank_done")
            assert sorted(int(r or 0) for n, r in names if n == "save.rank_done") == [0, 1]
            assert names.index(("checkpoint.promoting", None)) > last_done
        assert not [e for e in events if e["event"] == "checkpoint.failed"]
        assert os.readlink(root / "latest") == "step_4"

        # The NeMo-RL layout, whole, in every promoted step; the trainer renamed nothing.
        for step in (1, 2, 3):
            step_dir = root / f"step_{step}"
            assert not (root / f"tmp_step_{step}").exists()
            for name in ("training_info.json", "config.yaml", "train_dataloader.pt"):
                assert (step_dir / name).is_file(), name
            assert (step_dir / "policy/tokenizer/tokenizer.json").is_file()
            _assert_model_loads(step_dir, side, step)
            assert _assert_optimizer_loads(step_dir) > 0
            assert ckptd(["verify", str(step_dir)]) == 0
        final = root / "step_4/policy/weights/model"
        assert sorted(p.name for p in final.glob("shard-*.safetensors")) == [
            "shard-00001-model-00001-of-00001.safetensors",
            "shard-00002-model-00001-of-00001.safetensors",
        ]
        assert (final / "consolidated/model.safetensors.index.json").is_file()
        assert list((final / "consolidated").glob("model-*.safetensors"))
        _assert_optimizer_loads(root / "step_4")

        # The tokenizer was written once per step, by rank 0 only.
        writes = [line for line in job.drain() if line["event"] == "tokenizer_saved"]
        assert [(w["rank"], w["step"]) for w in writes] == [(0, 1), (0, 2), (0, 3)]


class TestRankKilled:
    """A rank killed mid-save: the step is never promoted and the event says why."""

    def test_killed_rank_leaves_step_unpromoted(
        self,
        daemon_factory: Callable[..., DaemonProcess],
        rank_jobs: Callable[..., RankJob],
        root: Path,
        short_dir: Path,
        tmp_path: Path,
    ) -> None:
        gates = _gates(short_dir)
        side = tmp_path / "side"
        side.mkdir()
        daemon = daemon_factory([root], "--lease", "1")
        job = rank_jobs(
            "loop",
            "--root", str(root),
            "--side", str(side),
            "--steps", "1,2",
            "--hold-rank", "1",
            "--hold-before-step", "2",
            "--gate-dir", str(gates),
            socket_path=daemon.socket_path,
        )  # fmt: skip
        held = job.wait_line("held", rank=1, at="before_save", step=2, timeout=120)
        daemon.wait_event("checkpoint.promoted", match=lambda e: e["step"] == 1)
        # Rank 1's uploads of step 2 cannot land: its upload process is frozen first.
        upload_pid = int(held["upload_pid"])
        os.kill(upload_pid, signal.SIGSTOP)
        release(gates / "gate1")
        for rank in (0, 1):
            job.wait_line("save_returned", rank=rank, step=2)
        assert _state(daemon, root, 2) == "open"
        job.procs[1].send_signal(signal.SIGKILL)
        os.kill(upload_pid, signal.SIGKILL)
        assert job.procs[1].wait(30) == -signal.SIGKILL

        failed = daemon.wait_event("checkpoint.failed", timeout=60)
        assert failed["step"] == 2
        # The dead rank's lease ran out, or rank 0's upload failed when its peer
        # vanished: either way a reason, never a promotion.
        assert "lease" in failed["reason"] or "rank 0" in failed["reason"], failed
        assert job.procs[0].wait(60) != 0
        assert not (root / "step_2").exists()
        assert list((root / ".ckptd-trash").glob("tmp_step_2.attempt-*"))  # kept, set aside
        assert os.readlink(root / "latest") == "step_1"
        assert _state(daemon, root, 2) == "failed"
        _assert_model_loads(root / "step_1", side, 1)


class TestRefusedBegin:
    """A save the daemon refuses stops on every rank before the Checkpointer writes."""

    def test_save_of_a_promoted_step_writes_nothing(
        self,
        daemon_factory: Callable[..., DaemonProcess],
        rank_jobs: Callable[..., RankJob],
        root: Path,
        short_dir: Path,
    ) -> None:
        gates = _gates(short_dir)
        daemon = daemon_factory([root])
        job = rank_jobs(
            "refused", "--root", str(root), "--gate-dir", str(gates),
            socket_path=daemon.socket_path,
        )  # fmt: skip
        assert job.wait_line("settled", timeout=120)["state"] == "promoted"
        for rank in (0, 1):
            job.wait_line("held", rank=rank, at="before_again")
        before = snapshot(root / "step_1")
        assert "policy/weights/model/.metadata" in before
        for rank in (0, 1):
            release(gates / f"gate{rank}")
        for rank in (0, 1):
            refused = job.wait_line("refused", rank=rank)
            assert refused["code"] == "already_promoted", refused
        assert job.wait() == [0, 0]
        assert snapshot(root / "step_1") == before
        # Only what the driver wrote before the save (NeMo-RL's own files) is there.
        assert sorted(p.name for p in (root / "tmp_step_1").iterdir()) == [
            "config.yaml",
            "training_info.json",
        ]
        assert ckptd(["verify", str(root / "step_1")]) == 0
        assert not [e for e in daemon.drain() if e["event"] == "checkpoint.failed"]

"""Every save form of torchtitan's manager, promoted by a real daemon and read back.

One 2-rank gloo job (``tests/_titan_worker.py forms``) builds
``orchestrator.torchtitan.CheckpointManager`` from torchtitan configs, one per form,
and saves one step with each: ``async_mode`` ``disabled`` (a synchronous ``dcp.save``),
``async`` (DCP's thread writer), ``async_with_pinned_mem`` (DCP's process writer with
torchtitan's stager), the last step model-only in bfloat16, and the last step in HF
safetensors, unsharded (the writer consolidates) and sharded (consolidated on every
rank). The tests read what the job and the daemon left.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._titan import TitanJob, step_dirs, titan_daemon

pytestmark = pytest.mark.slow

STEPS = (1, 2, 3, 4, 5, 6)
DCP_STEPS = (1, 2, 3)
HF_STEPS = (5, 6)


class Forms:
    """What the job said, and where it saved."""

    def __init__(self, root: Path, job: TitanJob, events: list[dict[str, Any]]) -> None:
        self.root = root
        self.job = job
        self.events = events

    def said(self, event: str, step: int, rank: int = 0) -> dict[str, Any]:
        return next(
            line
            for line in self.job.seen
            if (line.get("event"), line.get("step"), line.get("rank")) == (event, step, rank)
        )


@pytest.fixture(scope="module")
def forms(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Forms]:
    base = tmp_path_factory.mktemp("titan-forms")
    socket_dir = Path(tempfile.mkdtemp(prefix="ck-tf-", dir="/tmp"))
    daemon, root = titan_daemon(base, socket_dir, keep_latest_k=0)
    try:
        job = TitanJob(daemon, ["forms", str(root)], run="titan-forms")
        for rank in (0, 1):
            for step in DCP_STEPS:
                job.wait("reloaded", rank, step=step)
        job.finish()
        events = daemon.drain()
        yield Forms(root, job, events)
    finally:
        daemon.kill()
        if daemon.proc is not None and daemon.proc.stdout is not None:
            daemon.proc.stdout.close()


class TestEveryFormPromoted:
    """Each form's step is promoted to step-N through the daemon, and no step is left staged."""

    def test_every_rank_used_the_daemon(self, forms: Forms) -> None:
        for step in STEPS:
            assert forms.said("saved", step, 0)["daemon"] is True
            assert forms.said("saved", step, 1)["daemon"] is True

    def test_every_step_promoted(self, forms: Forms) -> None:
        for step in STEPS:
            assert forms.said("verdict", step)["state"] == "promoted"
        promoted = {e["step"] for e in forms.events if e["event"] == "checkpoint.promoted"}
        assert promoted == set(STEPS)
        assert step_dirs(forms.root) == sorted(f"step-{s}" for s in STEPS)
        assert not [p.name for p in forms.root.iterdir() if p.name.startswith("tmp_step_")]
        assert (forms.root / "latest").resolve().name == "step-6"

    def test_no_step_promoted_without_files(self, forms: Forms) -> None:
        for step in STEPS:
            manifest = json.loads(
                (forms.root / f"step-{step}" / ".ckptd-manifest.json").read_text()
            )
            assert manifest["files"], f"step {step} promoted with no file"

    def test_torchtitan_resumes_from_the_newest(self, forms: Forms) -> None:
        from orchestrator.torchtitan import CheckpointManager

        bare = CheckpointManager.__new__(CheckpointManager)
        assert bare._find_load_step(folder=str(forms.root)) == 6


class TestReadBack:
    """What each form saved loads back as it was saved."""

    def test_dcp_steps_reload_through_the_manager(self, forms: Forms) -> None:
        for rank in (0, 1):
            for step in DCP_STEPS:
                line = forms.said("reloaded", step, rank)
                assert line["digest"] == line["saved"], line
                assert line["train_step"] == step

    def test_last_step_is_model_only_in_export_dtype(self, forms: Forms) -> None:
        import torch
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        metadata = FileSystemReader(str(forms.root / "step-4")).read_metadata()
        entries = metadata.state_dict_metadata
        assert sorted(entries) == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert {entries[k].properties.dtype for k in entries} == {torch.bfloat16}  # type: ignore[union-attr]

    @pytest.mark.parametrize("step", HF_STEPS)
    def test_hf_safetensors_hold_the_saved_weights(self, forms: Forms, step: int) -> None:
        from safetensors.torch import load_file

        directory = forms.root / f"step-{step}"
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        files = set(index["weight_map"].values())
        assert files and all((directory / name).is_file() for name in files)
        weights: dict[str, Any] = {}
        for name in files:
            weights.update(load_file(str(directory / name)))
        order = ["0.weight", "0.bias", "2.weight", "2.bias"]
        total = sum(
            float((weights[f"model.layers.{k}"].double() * (i + 1)).sum())
            for i, k in enumerate(order)
        )
        assert total == pytest.approx(forms.said("saved", step)["digest"], rel=1e-6)

"""Without a daemon, the reference behaviour, on a real 2-rank job (gloo, CPU).

One job runs every scenario once (importing torch, transformers and nemo_automodel
costs most of its time); the tests below check what it reported. Each rank saves a tiny
Llama, AdamW and a scheduler in the NeMo-RL layout with the real Checkpointer, blocks on
``finalize_async_save``, renames ``tmp_step_N`` itself (as NeMo-RL's loop does without
ckptd), loads everything into fresh objects and compares exactly.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.automodel.conftest import RankJob

pytestmark = pytest.mark.slow

CASES = [
    ("torch_save", "sync"),
    ("safetensors", "sync"),
    ("torch_save", "async"),
    ("safetensors", "async"),
]


class Report:
    """Every line both ranks printed, and the root they wrote into."""

    def __init__(self, root: Path, lines: list[dict[str, Any]], codes: list[int]) -> None:
        self.root = root
        self.lines = lines
        self.codes = codes

    def of(self, event: str, **match: Any) -> list[dict[str, Any]]:
        """Lines of ``event`` with the given fields, rank 0's first."""
        found = [
            line
            for line in self.lines
            if line["event"] == event and all(line.get(k) == v for k, v in match.items())
        ]
        return sorted(found, key=lambda line: int(line.get("rank", -1)))


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Report]:
    root = tmp_path_factory.mktemp("run")
    job = RankJob("roundtrip", ["--root", str(root)], root / "no-daemon.sock")
    try:
        codes = job.wait(110)
        yield Report(root, job.drain(), codes)
    finally:
        job.kill()


class TestJob:
    """The job ran to the end on both ranks."""

    def test_both_ranks_exit_cleanly(self, report: Report) -> None:
        output = [line.get("line") for line in report.lines if line["event"] == "_output"]
        assert report.codes == [0, 0], output[-20:]
        assert [line["rank"] for line in report.of("exit")] == [0, 1]


class TestRoundTrip:
    """Model, AdamW state and scheduler come back exactly, in both formats, sync and async."""

    @pytest.mark.parametrize(("fmt", "mode"), CASES)
    def test_loaded_equals_saved(self, report: Report, fmt: str, mode: str) -> None:
        lines = report.of("roundtrip", format=fmt, mode=mode)
        assert [line["rank"] for line in lines] == [0, 1]
        for line in lines:
            assert line["mismatches"] == [], line
            assert line["optimizer_entries"] > 0  # AdamW state was really saved and loaded
            assert line["uses_daemon"] is False  # no daemon: the reference behaviour

    @pytest.mark.parametrize(("fmt", "mode"), CASES)
    def test_on_disk_layout(self, report: Report, fmt: str, mode: str) -> None:
        step = CASES.index((fmt, mode)) + 1
        final = report.root / f"step_{step}"
        assert not (report.root / f"tmp_step_{step}").exists()
        model = final / "policy" / "weights" / "model"
        if fmt == "torch_save":
            assert {p.name for p in model.iterdir()} == {
                ".metadata",
                "__0_0.distcp",
                "__1_0.distcp",
            }
        else:
            shards = sorted(p.name for p in model.glob("shard-*.safetensors"))
            assert shards == [
                "shard-00001-model-00001-of-00001.safetensors",
                "shard-00002-model-00001-of-00001.safetensors",
            ]
        optim = final / "policy" / "optimizer" / "optim"
        assert {p.name for p in optim.iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
        for name in ("training_info.json", "config.yaml"):
            assert (final / name).is_file()

    def test_async_returns_before_the_upload_lands(self, report: Report) -> None:
        # After the first async save has started the upload process, save_checkpoint
        # returns after staging and finalize_async_save is where the upload is waited on.
        for line in report.of("roundtrip", format="safetensors", mode="async"):
            assert line["finalize_s"] > 0
        for line in report.of("roundtrip", mode="sync"):
            assert line["finalize_s"] < 0.05


class TestTokenizer:
    """Written once per save, by rank 0 only, and loadable from the checkpoint."""

    def test_rank0_writes_once_per_save(self, report: Report) -> None:
        writes = report.of("tokenizer_saved")
        assert [line["rank"] for line in writes] == [0] * len(CASES)
        assert sorted(
            os.path.basename(os.path.dirname(os.path.dirname(w["path"]))) for w in writes
        ) == [f"tmp_step_{n}" for n in range(1, len(CASES) + 1)]

    def test_loads_back(self, report: Report) -> None:
        from transformers import PreTrainedTokenizerFast

        from tests.automodel._models import tiny_tokenizer

        loaded = PreTrainedTokenizerFast.from_pretrained(report.root / "step_1/policy/tokenizer")
        assert loaded.get_vocab() == tiny_tokenizer().get_vocab()
        assert loaded("the quick fox").input_ids == tiny_tokenizer()("the quick fox").input_ids


class TestLora:
    """An adapter saved through Automodel's PEFT path is found three ways and loads exactly."""

    @pytest.mark.parametrize(
        ("layout", "resolved"),
        [
            ("weights", "tmp_step_50/policy/weights/model"),
            ("model", "tmp_step_50/policy/weights/model"),
            ("hf", "hf_adapter"),
        ],
    )
    def test_load_into_fresh_model(self, report: Report, layout: str, resolved: str) -> None:
        lines = report.of("lora", layout=layout)
        assert [line["rank"] for line in lines] == [0, 1]
        for line in lines:
            assert line["resolved"] == resolved
            assert line["tensors"] == 8  # lora_A and lora_B of q_proj and v_proj, 2 layers
            assert line["differed_before"] is True
            assert line["equal"] is True

    def test_adapter_files(self, report: Report) -> None:
        model = report.root / "tmp_step_50" / "policy" / "weights" / "model"
        names = {p.name for p in model.iterdir()}
        assert {"adapter_model.safetensors", "adapter_config.json"} <= names
        assert not list(model.glob("*.distcp"))  # adapter-only: no sharded base weights


class TestMasterWeightDtypes:
    """Matching master-weight dtypes load; each drift direction raises, naming both dtypes."""

    @pytest.mark.parametrize("case", ["fp32_matches", "remainders_match"])
    def test_matching_dtypes_load(self, report: Report, case: str) -> None:
        for line in report.of("dtype", case=case):
            assert line["error"] is None
            assert line["restored"] is True

    @pytest.mark.parametrize(
        ("case", "on_disk", "live"),
        [
            ("fp32_saved_remainders_live", "torch.float32", "torch.int16"),
            ("remainders_saved_fp32_live", "torch.int16", "torch.float32"),
        ],
    )
    def test_drift_raises(self, report: Report, case: str, on_disk: str, live: str) -> None:
        lines = report.of("dtype", case=case)
        assert [line["rank"] for line in lines] == [0, 1]
        for line in lines:
            error = line["error"]
            assert error is not None
            assert f"stored as {on_disk} in the checkpoint" in error
            assert f"keeps it as {live}" in error
            assert ".master_param" in error

    def test_no_master_weights(self, report: Report) -> None:
        assert [line["error"] for line in report.of("dtype", case="no_master_weights_live")] == [
            None,
            None,
        ]

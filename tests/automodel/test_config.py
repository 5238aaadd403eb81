"""``build_checkpoint_config`` against the installed nemo_automodel ``CheckpointingConfig``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig

    from orchestrator.automodel import _config, build_checkpoint_config


@pytest.fixture(scope="module", autouse=True)
def _imported() -> None:
    """Import nemo_automodel when these tests run, not as every worker collects them."""
    global CheckpointingConfig, _config, build_checkpoint_config
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig

    from orchestrator.automodel import _config, build_checkpoint_config


FLAGS: dict[str, Any] = {
    "model_repo_id": "Qwen/Qwen2.5-0.5B",
    "dequantize_base_checkpoint": True,
    "is_peft": False,
    "is_async": True,
}


def _cfg(**checkpoint: Any) -> dict[str, Any]:
    block = {"model_save_format": "safetensors", "save_consolidated": "false", **checkpoint}
    return {"checkpoint": block, "precision": "bfloat16", "sequence_packing": {"enabled": True}}


class TestFields:
    """Every returned key is a field the installed dataclass accepts, and it builds."""

    def test_result_is_a_subset_of_the_real_dataclass_fields(self) -> None:
        result = build_checkpoint_config(
            _cfg(single_rank_consolidation=True, consolidation_timeout_minutes=5),
            **FLAGS,
            skip_task_head_prefixes_for_base_model=["score."],
        )
        fields = {f.name for f in dataclasses.fields(CheckpointingConfig)}
        assert set(result) <= fields
        # Each key this function may ever set, so a dropped field fails here by name.
        assert set(result) == {
            "model_save_format",
            "save_consolidated",
            "model_repo_id",
            "dequantize_base_checkpoint",
            "is_peft",
            "is_async",
            "single_rank_consolidation",
            "consolidation_timeout_minutes",
            "skip_task_head_prefixes_for_base_model",
        }

    @pytest.mark.parametrize("fmt", ["torch_save", "safetensors"])
    def test_builds_the_real_config(self, fmt: str) -> None:
        result = build_checkpoint_config(_cfg(model_save_format=fmt), **FLAGS)
        config = CheckpointingConfig(enabled=True, checkpoint_dir="", **result)
        assert config.model_save_format.value == fmt
        assert config.model_repo_id == "Qwen/Qwen2.5-0.5B"
        assert config.is_async is True
        assert config.dequantize_base_checkpoint is True

    def test_a_field_automodel_dropped_fails_loudly(self, monkeypatch: pytest.MonkeyPatch) -> None:
        # What an upgrade that removed the field would look like to this function.
        dropped = _config.accepted_fields() - {"consolidation_timeout_minutes"}
        monkeypatch.setattr(_config, "accepted_fields", lambda: dropped)
        with pytest.raises(TypeError, match="consolidation_timeout_minutes"):
            build_checkpoint_config(_cfg(consolidation_timeout_minutes=5), **FLAGS)
        assert "consolidation_timeout_minutes" not in build_checkpoint_config(_cfg(), **FLAGS)


class TestForwarding:
    """Named flags are forwarded; optional keys only when present; other keys ignored."""

    def test_named_flags_and_required_keys(self) -> None:
        result = build_checkpoint_config(
            _cfg(save_consolidated="final"),
            model_repo_id="m",
            dequantize_base_checkpoint=False,
            is_peft=True,
            is_async=False,
        )
        assert result == {
            "model_save_format": "safetensors",
            "save_consolidated": "final",
            "model_repo_id": "m",
            "dequantize_base_checkpoint": False,
            "is_peft": True,
            "is_async": False,
        }

    def test_optional_keys_copied_only_when_present(self) -> None:
        absent = build_checkpoint_config(_cfg(), **FLAGS)
        assert "single_rank_consolidation" not in absent
        assert "consolidation_timeout_minutes" not in absent
        present = build_checkpoint_config(
            _cfg(single_rank_consolidation=False, consolidation_timeout_minutes=7), **FLAGS
        )
        assert present["single_rank_consolidation"] is False
        assert present["consolidation_timeout_minutes"] == 7

    def test_unknown_keys_of_the_block_are_not_forwarded(self) -> None:
        result = build_checkpoint_config(_cfg(checkpoint_dir="/elsewhere", is_async=False), **FLAGS)
        assert "checkpoint_dir" not in result
        assert result["is_async"] is True  # the argument, not the YAML key

    def test_skip_task_head_prefixes_only_when_given(self) -> None:
        assert "skip_task_head_prefixes_for_base_model" not in build_checkpoint_config(
            _cfg(), **FLAGS
        )
        result = build_checkpoint_config(
            _cfg(), **FLAGS, skip_task_head_prefixes_for_base_model=["score."]
        )
        assert result["skip_task_head_prefixes_for_base_model"] == ["score."]
        empty = build_checkpoint_config(_cfg(), **FLAGS, skip_task_head_prefixes_for_base_model=[])
        assert empty["skip_task_head_prefixes_for_base_model"] == []


class TestValidation:
    """Bad input says which key is wrong and what it may be."""

    @pytest.mark.parametrize("fmt", ["dcp", "torch", "SAFETENSORS", ""])
    def test_model_save_format(self, fmt: str) -> None:
        with pytest.raises(ValueError, match="model_save_format") as info:
            build_checkpoint_config(_cfg(model_save_format=fmt), **FLAGS)
        assert "'torch_save'" in str(info.value)
        assert "'safetensors'" in str(info.value)
        assert repr(fmt) in str(info.value)

    def test_missing_block_or_required_keys(self) -> None:
        with pytest.raises(KeyError, match="checkpoint"):
            build_checkpoint_config({"precision": "bf16"}, **FLAGS)
        with pytest.raises(KeyError, match="save_consolidated"):
            build_checkpoint_config({"checkpoint": {"model_save_format": "safetensors"}}, **FLAGS)

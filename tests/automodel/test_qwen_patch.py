"""The Qwen-VL ``visual.`` key rename, against nemo_automodel 0.7.0's real mapping function."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    import nemo_automodel.components.checkpoint.checkpointing as am_checkpointing
    from nemo_automodel.components.checkpoint.checkpointing import _apply_key_mapping
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    import orchestrator.automodel
    from orchestrator.automodel import _patch_qwen_vl_vision_key_mapping
    from orchestrator.automodel._qwen_patch import DISABLE_ENV, _with_visual_rule, apply_at_import


@pytest.fixture(scope="module", autouse=True)
def _imported() -> None:
    """Import nemo_automodel when these tests run, not as every worker collects them."""
    global REAL, am_checkpointing, _apply_key_mapping, Qwen2_5_VLConfig
    global Qwen2_5_VLForConditionalGeneration, orchestrator, _patch_qwen_vl_vision_key_mapping
    global DISABLE_ENV, _with_visual_rule, apply_at_import
    import nemo_automodel.components.checkpoint.checkpointing as am_checkpointing
    from nemo_automodel.components.checkpoint import conversion_mapping
    from nemo_automodel.components.checkpoint.checkpointing import _apply_key_mapping
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    import orchestrator.automodel
    from orchestrator.automodel import _patch_qwen_vl_vision_key_mapping
    from orchestrator.automodel._qwen_patch import DISABLE_ENV, _with_visual_rule, apply_at_import

    REAL = conversion_mapping.get_combined_key_mapping


REAL: Callable[..., Any]
"""nemo_automodel's own ``get_combined_key_mapping``, before any patch."""
VISION_KEY = "visual.blocks.0.attn.qkv.weight"


def _patched() -> Callable[..., Any]:
    function: Callable[..., Any] = am_checkpointing.get_combined_key_mapping
    return function


def _rename(mapping: Any, *keys: str) -> list[str]:
    """Keys as nemo_automodel's own loader renames them with ``mapping``."""
    tensors = {key: torch.zeros(1) for key in keys}
    return list(_apply_key_mapping(tensors, mapping))


@pytest.fixture(scope="module")
def tiny_qwen_vl() -> torch.nn.Module:
    text = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2}
    config = Qwen2_5_VLConfig(text_config=text, vision_config={**vision, "out_hidden_size": 32})
    model: torch.nn.Module = Qwen2_5_VLForConditionalGeneration(config)  # type: ignore[no-untyped-call]
    return model


class TestApplied:
    """Importing orchestrator.automodel wraps the function Checkpointer.load_base_model calls."""

    def test_wraps_the_real_function(self) -> None:
        assert orchestrator.automodel is not None
        assert _patched() is not REAL
        assert _patched().__wrapped__ is REAL  # type: ignore[attr-defined]
        # NeMo-RL's names for the same: its code and tests look for these.
        assert _patched()._nrl_orig is REAL  # type: ignore[attr-defined]
        assert _patched()._nrl_vision_patch is True  # type: ignore[attr-defined]

    def test_idempotent(self) -> None:
        before = _patched()
        _patch_qwen_vl_vision_key_mapping()
        _patch_qwen_vl_vision_key_mapping()
        assert _patched() is before
        assert _patched().__wrapped__ is REAL  # type: ignore[attr-defined]


class TestQwenVl:
    """qwen2_5_vl / qwen2_vl gain ``^visual.`` -> ``model.visual.`` unless a rule has it."""

    @pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen2_vl"])
    def test_rule_added_when_nothing_targets_model_visual(self, model_type: str) -> None:
        assert REAL(model_type, None) is None  # what transformers v5 gives by model type
        mapping = _patched()(model_type, None)
        assert mapping == {r"^visual\.": "model.visual."}
        renamed = _rename(mapping, VISION_KEY, "model.language_model.layers.0.mlp.up_proj.weight")
        assert renamed == [
            "model.visual.blocks.0.attn.qkv.weight",
            "model.language_model.layers.0.mlp.up_proj.weight",
        ]

    def test_kept_after_existing_rules(self) -> None:
        own = {r"^lm_head\.": "lm_head.", r"^model\.": "model.language_model."}
        mapping = _patched()("qwen2_5_vl", own)
        assert list(mapping) == [*own, r"^visual\."]  # first-match: existing rules first

    def test_unchanged_when_a_rule_already_targets_model_visual(self) -> None:
        own = {r"^visual": "model.visual"}
        assert _patched()("qwen2_5_vl", own) == REAL("qwen2_5_vl", own) == own

    def test_real_model_mapping_left_alone(self, tiny_qwen_vl: torch.nn.Module) -> None:
        # With the model, transformers' class rules already map visual.* (fixed in 5.6),
        # and nemo_automodel returns a scoped-rename callable: nothing to add.
        real = REAL("qwen2_5_vl", None, model=tiny_qwen_vl)
        patched = _patched()("qwen2_5_vl", None, model=tiny_qwen_vl)
        assert _rename(patched, VISION_KEY) == _rename(real, VISION_KEY)
        names = {name for name, _ in tiny_qwen_vl.named_parameters()}
        assert _rename(patched, "visual.blocks.0.norm1.weight")[0] in names

    def test_a_callable_without_the_rule_gets_it_after_its_own_renames(self) -> None:
        def scoped(key: str) -> str:
            return key.replace("model.", "model.language_model.", 1)

        wrapped = _with_visual_rule(scoped)
        assert callable(wrapped)
        assert wrapped(VISION_KEY) == "model.visual.blocks.0.attn.qkv.weight"
        assert wrapped("model.layers.0.x") == "model.language_model.layers.0.x"


class TestOtherModels:
    """Every other model type gets exactly what the real function returns."""

    @pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3", "mixtral", "qwen3_vl"])
    def test_no_op(self, model_type: str) -> None:
        assert _patched()(model_type, None) == REAL(model_type, None)
        own = {r"^foo\.": "bar."}
        assert _patched()(model_type, own) == REAL(model_type, own)


class TestSwitches:
    """The environment variable turns it off; a failure to apply never breaks import."""

    def test_environment_variable_turns_it_off(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(am_checkpointing, "get_combined_key_mapping", REAL)
        monkeypatch.setenv(DISABLE_ENV, "1")
        _patch_qwen_vl_vision_key_mapping()
        assert am_checkpointing.get_combined_key_mapping is REAL
        monkeypatch.setenv(DISABLE_ENV, "0")
        _patch_qwen_vl_vision_key_mapping()
        assert am_checkpointing.get_combined_key_mapping is not REAL

    def test_failure_is_a_warning(
        self, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        # An Automodel that moved the function away.
        monkeypatch.delattr(am_checkpointing, "get_combined_key_mapping")
        with caplog.at_level(logging.WARNING, logger="orchestrator.automodel"):
            apply_at_import()
        assert "Qwen-VL vision key-mapping workaround" in caplog.text
        assert "get_combined_key_mapping" in caplog.text

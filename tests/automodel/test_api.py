"""Every name NeMo-RL's ``nemo_rl.models.automodel.checkpoint`` documents, same signatures.

The reference (``shared/reference/nemo_rl_automodel_checkpoint_api.txt``) is the
contract: a NeMo-RL worker switches by changing its import, so each documented parameter
must keep its name, kind, order and default. ckptd's additions come after them and are
keyword-only with defaults. NeMo-RL main's previous generation (``UPSTREAM_MAIN``) is
accepted too: its parameters may sit where the reference has keyword-only ones, so a
parameter documented keyword-only may also be positional-or-keyword (after every
reference positional one), and one the reference requires may default to None when the
previous generation leaves it out (``save_checkpoint`` then raises ``TypeError``).
"""

from __future__ import annotations

import inspect
import logging
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import orchestrator.automodel as module
    from orchestrator.automodel import AutomodelCheckpointManager, _manager


@pytest.fixture(scope="module", autouse=True)
def _imported() -> None:
    """Import nemo_automodel when these tests run, not as every worker collects them."""
    global module, AutomodelCheckpointManager, _manager
    import orchestrator.automodel as module
    from orchestrator.automodel import AutomodelCheckpointManager, _manager


P = inspect.Parameter
POS, KW = P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY
REQUIRED = P.empty

# (name, kind, default) per documented parameter, in order ("self" left out).
REFERENCE: dict[str, list[tuple[str, Any, Any]]] = {
    "_resolve_lora_adapter_dir": [("restore_from", POS, REQUIRED)],
    "build_checkpoint_config": [
        ("automodel_cfg", POS, REQUIRED),
        ("model_repo_id", KW, REQUIRED),
        ("dequantize_base_checkpoint", KW, REQUIRED),
        ("is_peft", KW, REQUIRED),
        ("is_async", KW, REQUIRED),
        ("skip_task_head_prefixes_for_base_model", KW, None),
    ],
    "_patch_qwen_vl_vision_key_mapping": [],
    "AutomodelCheckpointManager.__init__": [
        ("dp_mesh", POS, REQUIRED),
        ("tp_mesh", POS, REQUIRED),
        ("moe_mesh", POS, None),
    ],
    "AutomodelCheckpointManager._get_dp_rank": [],
    "AutomodelCheckpointManager._get_tp_rank": [],
    "AutomodelCheckpointManager.init_checkpointer": [("config_updates", POS, None)],
    "AutomodelCheckpointManager.finalize_async_save": [],
    "AutomodelCheckpointManager._save_tokenizer_on_rank0": [
        ("tokenizer", POS, REQUIRED),
        ("tokenizer_path", POS, REQUIRED),
    ],
    "AutomodelCheckpointManager.save_checkpoint": [
        ("model", POS, REQUIRED),
        ("weights_path", POS, REQUIRED),
        ("optimizer", POS, None),
        ("optimizer_path", POS, None),
        ("scheduler", POS, None),
        ("tokenizer", POS, None),
        ("tokenizer_path", POS, None),
        ("is_final_checkpoint", KW, REQUIRED),
        ("peft_config", KW, None),
    ],
    "AutomodelCheckpointManager.load_lora_adapter": [
        ("model", POS, REQUIRED),
        ("adapter_dir", POS, REQUIRED),
    ],
    "AutomodelCheckpointManager.load_checkpoint": [
        ("model", POS, REQUIRED),
        ("weights_path", POS, REQUIRED),
        ("optimizer", POS, None),
        ("optimizer_path", POS, None),
        ("scheduler", POS, None),
    ],
    "AutomodelCheckpointManager.check_master_weight_dtypes": [
        ("model", POS, REQUIRED),
        ("optimizer", POS, REQUIRED),
        ("optimizer_path", POS, REQUIRED),
    ],
}


# NeMo-RL main (NVIDIA-NeMo/RL 7ea279a), the previous generation: only what differs.
UPSTREAM_MAIN: dict[str, list[tuple[str, Any, Any]]] = {
    "AutomodelCheckpointManager.init_checkpointer": [
        ("config_updates", POS, None),
        ("checkpoint_root", POS, None),
    ],
    "AutomodelCheckpointManager.update_checkpointer_config": [
        ("config_updates", POS, None),
        ("checkpoint_root", POS, None),
    ],
    "AutomodelCheckpointManager.save_checkpoint": [
        ("model", POS, REQUIRED),
        ("weights_path", POS, REQUIRED),
        ("optimizer", POS, None),
        ("optimizer_path", POS, None),
        ("scheduler", POS, None),
        ("tokenizer", POS, None),
        ("tokenizer_path", POS, None),
        ("checkpointing_cfg", POS, None),
        ("lora_enabled", POS, False),
        ("peft_config", POS, None),
    ],
    "detect_checkpoint_format": [("weights_path", POS, REQUIRED)],
    "_infer_checkpoint_root": [("weights_path", POS, REQUIRED)],
}

RELAXED = {"is_final_checkpoint", "checkpointing_cfg"}
"""Required by one generation, left out by the other (default None, or "not given")."""

GENERATIONS = [(REFERENCE, d) for d in sorted(REFERENCE)] + [
    (UPSTREAM_MAIN, d) for d in sorted(UPSTREAM_MAIN)
]


def _resolve(dotted: str) -> Callable[..., Any]:
    target: Any = module
    for part in dotted.split("."):
        target = getattr(target, part)
    return target  # type: ignore[no-any-return]


class TestReferenceNames:
    """Each documented name exists and takes exactly the documented parameters first."""

    @pytest.mark.parametrize(("table", "dotted"), [*GENERATIONS])
    def test_signature(self, table: dict[str, list[tuple[str, Any, Any]]], dotted: str) -> None:
        parameters = inspect.signature(_resolve(dotted)).parameters
        params = [p for p in parameters.values() if p.name != "self"]
        documented = table[dotted]
        positional = [name for name, kind, _ in documented if kind is POS]
        assert [p.name for p in params[: len(positional)]] == positional
        for name, kind, default in documented:
            got = parameters[name]
            if kind is KW:
                assert got.kind in (KW, POS), name
            else:
                assert got.kind is POS, name
            relaxed = name in RELAXED and got.default in (None, _manager._UNSET)
            assert got.default == default or relaxed, name
        documented_names = {n for t in (REFERENCE, UPSTREAM_MAIN) for n, *_ in t.get(dotted, [])}
        for extra in params:
            if extra.name not in documented_names:
                assert extra.kind is KW and extra.default is not P.empty, extra

    def test_both_generations_bind(self) -> None:
        save = inspect.signature(AutomodelCheckpointManager.save_checkpoint)
        save.bind(None, "m", "/w", None, None, None, None, None, is_final_checkpoint=True)
        save.bind(None, "m", "/w", checkpointing_cfg={}, lora_enabled=True, peft_config=None)
        save.bind(None, "m", "/w", None, None, None, None, None, {}, False, None)
        init = inspect.signature(AutomodelCheckpointManager.init_checkpointer)
        init.bind(None, {"is_async": True}, "/ckpt")

    def test_documented(self) -> None:
        for dotted in REFERENCE:
            # __init__ is documented on the class (Args), as the house style has it.
            owner = dotted.removesuffix(".__init__")
            assert (_resolve(owner).__doc__ or "").strip(), dotted
        assert isinstance(module.logger, logging.Logger)
        assert set(module.__all__) >= {
            "AutomodelCheckpointManager",
            "_patch_qwen_vl_vision_key_mapping",
            "_resolve_lora_adapter_dir",
            "build_checkpoint_config",
            "logger",
        }

    def test_tokenizer_helper_is_static(self) -> None:
        raw = inspect.getattr_static(AutomodelCheckpointManager, "_save_tokenizer_on_rank0")
        assert isinstance(raw, staticmethod)

    def test_uninitialised_manager_explains(self) -> None:
        manager = AutomodelCheckpointManager(None, None)  # type: ignore[arg-type]
        assert manager.checkpointer is None
        manager.finalize_async_save()  # a no-op before init, as documented
        with pytest.raises(RuntimeError, match="init_checkpointer"):
            manager.load_checkpoint(None, "/nowhere")  # type: ignore[arg-type]


class TestImportIsLight:
    """``import orchestrator`` never pulls in torch; the subpackage is imported explicitly."""

    def test_orchestrator_alone(self) -> None:
        code = "import sys, orchestrator; print('torch' in sys.modules)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert out.stdout.strip() == "False", out.stderr

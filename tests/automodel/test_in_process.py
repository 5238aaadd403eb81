"""The workers' manager in one process: the module's names, its helpers, real saves and loads.

Every behaviour NeMo-RL's unit tests of ``nemo_rl.models.automodel.checkpoint`` check,
written again here without mocks: one rank on a real single-process gloo group, the
real nemo_automodel ``Checkpointer``, real files. That only rank 0 writes the tokenizer
(while every rank saves the model) needs two ranks: ``tests/automodel/test_daemon.py``.

torch and nemo_automodel are imported by the fixtures, not by this module: every test
worker collects every module.
"""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from orchestrator.automodel import AutomodelCheckpointManager

# nemo_automodel's safetensors writer calls tensor.storage(), and torch warns of it from
# there: not a defect of the code under test.
pytestmark = pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")

UPSTREAM = "nemo_rl.models.automodel.checkpoint"
"""The module ``orchestrator.automodel._manager`` stands in for (docs/nemo-rl.md)."""

SEED_NAMES = [
    "AutomodelCheckpointManager",
    "_patch_qwen_vl_vision_key_mapping",
    "_resolve_lora_adapter_dir",
    "build_checkpoint_config",
    "logger",
]
"""Every module-level name of the reference API (``shared/reference``)."""

PREVIOUS_NAMES = ["_infer_checkpoint_root", "detect_checkpoint_format"]
"""The previous generation's module functions (NeMo-RL main as of 7ea279a)."""


@pytest.fixture(scope="module", autouse=True)
def automodel() -> types.ModuleType:
    """``orchestrator.automodel``, imported once for the module.

    A module-scoped fixture also keeps the module's tests on one test worker
    (``tests/conftest.py``), so one worker pays for the import, not each.
    """
    import orchestrator.automodel

    return orchestrator.automodel


@pytest.fixture
def alias() -> Iterator[None]:
    """``nemo_rl.models.automodel.checkpoint`` as the documented alias, then removed."""
    import orchestrator.automodel._manager as ours

    parts = UPSTREAM.split(".")
    added = []
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        assert name not in sys.modules, f"{name} is already imported"
        package = types.ModuleType(name)
        package.__path__ = []
        sys.modules[name] = package
        added.append(name)
    sys.modules[UPSTREAM] = ours
    added.append(UPSTREAM)
    try:
        yield
    finally:
        for name in added:
            del sys.modules[name]


class TestOneModule:
    """Each of the reference module's names imports through the alias, as the package's own."""

    @pytest.mark.parametrize("name", SEED_NAMES + PREVIOUS_NAMES)
    def test_from_upstream_name_import(self, alias: None, name: str) -> None:
        import orchestrator.automodel

        module = __import__(UPSTREAM, fromlist=[name])  # what `from UPSTREAM import name` does
        assert getattr(module, name) is getattr(orchestrator.automodel, name)

    def test_all_lists_them(self) -> None:
        from orchestrator.automodel import _manager

        assert set(SEED_NAMES + PREVIOUS_NAMES) <= set(_manager.__all__)


class TestDetectCheckpointFormat:
    """The format and PEFT-ness from the files under the weights path; safetensors by default."""

    @pytest.mark.parametrize(
        ("files", "expected"),
        [
            (["model/model.safetensors"], ("safetensors", False)),
            (["model/__0_0.distcp"], ("torch_save", False)),
            (["model/pytorch_model.bin"], ("torch_save", False)),
            (["model/model.pt"], ("torch_save", False)),
            (["model/model.pth"], ("torch_save", False)),
            (["model/adapter_model.safetensors"], ("safetensors", True)),
            (["model/adapter_config.json", "model/model.safetensors"], ("safetensors", True)),
            (["model/rank_0/model-00001-of-00002.safetensors"], ("safetensors", False)),
            (["model/shard.safetensors", "model/__0_0.distcp"], ("torch_save", False)),
            ([], ("safetensors", False)),
        ],
        ids=[
            "safetensors",
            "distcp",
            "bin",
            "pt",
            "pth",
            "adapter",
            "adapter_config",
            "nested",
            "dcp_wins",
            "empty",
        ],
    )
    def test_files(self, tmp_path: Path, files: list[str], expected: tuple[str, bool]) -> None:
        from orchestrator.automodel import detect_checkpoint_format

        weights = tmp_path / "weights"
        weights.mkdir()
        for name in files:
            (weights / name).parent.mkdir(parents=True, exist_ok=True)
            (weights / name).write_bytes(b"")
        assert detect_checkpoint_format(str(weights)) == expected

    def test_missing_directory(self, tmp_path: Path) -> None:
        from orchestrator.automodel import detect_checkpoint_format

        assert detect_checkpoint_format(str(tmp_path / "nowhere")) == ("safetensors", False)


class TestInferCheckpointRoot:
    """The directory above ``weights`` (or ``weights/model``); else the parent."""

    @pytest.mark.parametrize(
        ("weights_path", "root"),
        [
            ("/ckpt/step_3/policy/weights/model", "/ckpt/step_3/policy"),
            ("/ckpt/step_3/policy/weights", "/ckpt/step_3/policy"),
            ("/ckpt/step_3/policy/weights/", "/ckpt/step_3/policy"),
            ("/ckpt/step_3/policy/custom", "/ckpt/step_3/policy"),
            ("run/weights/model", "run"),
            ("weights/model", ""),
        ],
    )
    def test_paths(self, weights_path: str, root: str) -> None:
        from orchestrator.automodel import _infer_checkpoint_root

        assert _infer_checkpoint_root(weights_path) == root


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    """A one-rank CPU mesh on a gloo group of this process, destroyed after the test."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import HashStore
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def manager(mesh: DeviceMesh) -> Iterator[AutomodelCheckpointManager]:
    """The workers' manager without a daemon (NeMo-RL's behaviour), closed after."""
    from orchestrator.automodel import AutomodelCheckpointManager

    made = AutomodelCheckpointManager(mesh, mesh, use_daemon=False)
    try:
        yield made
    finally:
        made.close()


class Net:
    """Upstream's model shape: Linear(4, 4), LayerNorm, ReLU, Linear(4, 1)."""

    @staticmethod
    def build(seed: int) -> torch.nn.Module:
        import torch

        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.ReLU(), torch.nn.Linear(4, 1)
        )


def same_state(loaded: Any, saved: Any) -> None:
    """Two (nested) state dicts hold equal tensors and values."""
    import torch

    assert type(loaded) is type(saved) or isinstance(saved, dict)
    if isinstance(saved, dict):
        assert set(loaded) == set(saved)
        for key, value in saved.items():
            same_state(loaded[key], value)
    elif isinstance(saved, torch.Tensor):
        assert torch.equal(loaded, saved)
    elif isinstance(saved, list | tuple):
        assert len(loaded) == len(saved)
        for a, b in zip(loaded, saved, strict=True):
            same_state(a, b)
    else:
        assert loaded == saved


class TestBeforeInit:
    """Before ``init_checkpointer``: the meshes kept, no Checkpointer, saves and loads refused."""

    def test_attributes(self, manager: AutomodelCheckpointManager, mesh: DeviceMesh) -> None:
        assert manager.checkpointer is None and manager.checkpoint_config is None
        assert manager.dp_mesh is mesh and manager.tp_mesh is mesh and manager.moe_mesh is None

    def test_ranks(self, manager: AutomodelCheckpointManager) -> None:
        assert (manager._get_dp_rank(), manager._get_tp_rank()) == (0, 0)

    def test_save_refused(self, manager: AutomodelCheckpointManager, tmp_path: Path) -> None:
        from orchestrator.automodel import CheckpointerNotInitialized

        with pytest.raises(CheckpointerNotInitialized, match="Checkpointer must be initialized"):
            manager.save_checkpoint(
                Net.build(0), str(tmp_path / "weights"), checkpointing_cfg={"enabled": True}
            )
        assert not (tmp_path / "weights").exists()

    def test_load_refused(self, manager: AutomodelCheckpointManager, tmp_path: Path) -> None:
        with pytest.raises(AssertionError, match="Checkpointer must be initialized"):
            manager.load_checkpoint(Net.build(0), str(tmp_path / "weights"))

    def test_refusal_is_both_kinds(self) -> None:
        from orchestrator.automodel import CheckpointerNotInitialized

        assert issubclass(CheckpointerNotInitialized, AssertionError)
        assert issubclass(CheckpointerNotInitialized, RuntimeError)

    def test_update_without_checkpointer(self, manager: AutomodelCheckpointManager) -> None:
        manager.update_checkpointer_config(config_updates={"is_peft": True}, checkpoint_root="/x")
        assert manager.checkpointer is None


class TestInitCheckpointer:
    """``init_checkpointer`` builds the real Checkpointer once; its config can be updated."""

    def test_builds_checkpointer(self, manager: AutomodelCheckpointManager) -> None:
        from nemo_automodel.components.checkpoint.checkpointing import Checkpointer

        manager.init_checkpointer({"model_repo_id": "tiny/model"}, checkpoint_root="/ckpt/run")
        assert isinstance(manager.checkpointer, Checkpointer)
        config = manager.checkpoint_config
        assert config is not None and config is manager.checkpointer.config
        assert config.model_repo_id == "tiny/model" and config.checkpoint_dir == "/ckpt/run"

    def test_second_call_keeps_the_first(self, manager: AutomodelCheckpointManager) -> None:
        manager.init_checkpointer({"model_repo_id": "first"})
        first = manager.checkpointer
        manager.init_checkpointer({"model_repo_id": "second"})
        assert manager.checkpointer is first
        assert first is not None and first.config.model_repo_id == "first"

    def test_update_sets_live_config(self, manager: AutomodelCheckpointManager) -> None:
        manager.init_checkpointer({"model_save_format": "torch_save"})
        manager.update_checkpointer_config(
            config_updates={"is_peft": True, "model_save_format": "safetensors"},
            checkpoint_root="/new/path",
        )
        assert manager.checkpointer is not None
        config = manager.checkpointer.config
        assert config.checkpoint_dir == "/new/path" and config.is_peft is True
        assert config.model_save_format.value == "safetensors"  # the enum, not the string

    def test_save_needs_checkpointing_cfg(
        self, manager: AutomodelCheckpointManager, tmp_path: Path
    ) -> None:
        manager.init_checkpointer()
        with pytest.raises(ValueError, match="checkpointing_cfg must be provided"):
            manager.save_checkpoint(Net.build(0), str(tmp_path / "w"), checkpointing_cfg=None)


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


class TestSave:
    """What a save writes: the model, the optimizer only when given, the tokenizer."""

    def test_model_only(self, manager: AutomodelCheckpointManager, tmp_path: Path) -> None:
        manager.init_checkpointer()
        weights = tmp_path / "step_1" / "policy" / "weights"
        manager.save_checkpoint(
            Net.build(0), str(weights), checkpointing_cfg={"model_save_format": "torch_save"}
        )
        assert ".metadata" in [p.name for p in (weights / "model").iterdir()]
        assert sorted(p.name for p in (tmp_path / "step_1" / "policy").iterdir()) == ["weights"]

    def test_model_and_optimizer(self, manager: AutomodelCheckpointManager, tmp_path: Path) -> None:
        import torch

        manager.init_checkpointer()
        model = Net.build(0)
        optimizer = torch.optim.Adam(model.parameters())
        weights, optim = tmp_path / "policy" / "weights", tmp_path / "policy" / "optimizer"
        manager.save_checkpoint(
            model,
            str(weights),
            optimizer,
            str(optim),
            checkpointing_cfg={"model_save_format": "torch_save", "is_peft": False},
        )
        assert any(name.endswith(".distcp") for name in files_under(weights))
        assert any(name.endswith(".distcp") for name in files_under(optim))

    def test_tokenizer(self, manager: AutomodelCheckpointManager, tmp_path: Path) -> None:
        from tests.automodel._models import tiny_tokenizer

        manager.init_checkpointer()
        tokenizer = tiny_tokenizer()
        written: list[str] = []
        tokenizer.on_save = written.append
        path = tmp_path / "policy" / "tokenizer"
        manager.save_checkpoint(
            Net.build(0),
            str(tmp_path / "policy" / "weights"),
            tokenizer=tokenizer,
            tokenizer_path=str(path),
            checkpointing_cfg={"enabled": True},
        )
        assert written == [str(path)]
        assert (path / "tokenizer.json").is_file()


class TestRoundTrip:
    """Saved, then loaded into fresh objects whose state was different: equal again."""

    @pytest.mark.parametrize(
        ("fmt", "suffix"), [("safetensors", ".safetensors"), ("torch_save", ".distcp")]
    )
    def test_model(
        self, manager: AutomodelCheckpointManager, tmp_path: Path, fmt: str, suffix: str
    ) -> None:
        manager.init_checkpointer({"model_save_format": fmt})
        model, fresh = Net.build(0), Net.build(1)
        weights = tmp_path / "weights"
        manager.save_checkpoint(model, str(weights), checkpointing_cfg={"model_save_format": fmt})
        assert any(name.endswith(suffix) for name in files_under(weights / "model"))
        manager.load_checkpoint(fresh, str(weights))
        same_state(fresh.state_dict(), model.state_dict())

    def test_model_optimizer_scheduler(
        self, manager: AutomodelCheckpointManager, tmp_path: Path
    ) -> None:
        import torch

        model = Net.build(0)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
        generator = torch.Generator().manual_seed(0)
        for _ in range(3):
            inputs, target = torch.randn(2, 4, generator=generator), torch.randn(2, 1)
            loss = (model(inputs) - target).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
        manager.init_checkpointer({"model_save_format": "safetensors"})
        weights, optim = tmp_path / "weights", tmp_path / "optimizer"
        manager.save_checkpoint(
            model,
            str(weights),
            optimizer,
            str(optim),
            scheduler,
            checkpointing_cfg={"enabled": True},
        )
        fresh = Net.build(1)
        fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=1e-3)
        fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_optimizer, step_size=4, gamma=0.2)
        manager.load_checkpoint(fresh, str(weights), fresh_optimizer, str(optim), fresh_scheduler)
        same_state(fresh.state_dict(), model.state_dict())
        same_state(fresh_optimizer.state_dict(), optimizer.state_dict())
        assert fresh_scheduler.state_dict() == scheduler.state_dict()

    def test_lora_adapter(self, manager: AutomodelCheckpointManager, tmp_path: Path) -> None:
        import torch

        from tests.automodel._models import import_nemo_lora

        with warnings.catch_warnings():
            # megatron_fsdp, under the LoRA module, says so on every host without them.
            warnings.filterwarnings("ignore", "Transformer Engine and Apex", UserWarning)
            lora = import_nemo_lora()
        config = lora.PeftConfig(
            target_modules=[],
            match_all_linear=True,
            dim=2,
            alpha=2,
            dropout=0.0,
            lora_A_init="xavier",
            use_triton=False,
        )
        model, fresh = Net.build(0), Net.build(1)
        for net in (model, fresh):
            lora.apply_lora_to_linear_modules(net, config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_()  # lora_B starts at zero: make the adapter tell apart
        adapter = {k: v for k, v in model.state_dict().items() if "lora_" in k}
        assert {k: tuple(v.shape) for k, v in adapter.items()} == {
            "0.lora_A.weight": (2, 4),
            "0.lora_B.weight": (4, 2),
            "3.lora_A.weight": (2, 4),
            "3.lora_B.weight": (1, 2),
        }
        manager.init_checkpointer({"model_save_format": "safetensors", "is_peft": True})
        weights = tmp_path / "weights"
        manager.save_checkpoint(
            model,
            str(weights),
            checkpointing_cfg={"model_save_format": "safetensors", "is_peft": True},
            lora_enabled=True,
            peft_config=config,
        )
        assert "model/adapter_model.safetensors" in files_under(weights)
        manager.load_checkpoint(fresh, str(weights))
        loaded = {k: v for k, v in fresh.state_dict().items() if "lora_" in k}
        same_state(loaded, adapter)


class TestQwenVisionTripwire:
    """The Qwen-VL workaround is still needed: the unwrapped mapping lacks ``model.visual``."""

    @pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen2_vl"])
    def test_real_mapping_lacks_the_rule(self, model_type: str) -> None:
        import nemo_automodel.components.checkpoint.checkpointing as checkpointing

        import orchestrator.automodel  # noqa: F401  # applies the patch

        patched = checkpointing.get_combined_key_mapping
        real = patched._nrl_orig
        assert real is not patched
        targets = [str(t) for t in (real(model_type, None) or {}).values()]
        assert not [t for t in targets if t.startswith("model.visual")], (
            "the installed transformers maps visual -> model.visual itself (#45358): "
            "_patch_qwen_vl_vision_key_mapping can go"
        )
        assert any(str(t).startswith("model.visual") for t in patched(model_type, None).values())

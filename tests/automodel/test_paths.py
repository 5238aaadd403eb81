"""Finding adapters and steps on disk and in a store; the CPU stager; upload ordering.

All in-process.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest
from torch.distributed.checkpoint.staging import DefaultStager

if TYPE_CHECKING:
    import nemo_automodel.components.checkpoint.checkpointing as am_checkpointing
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig

    from orchestrator.automodel import _resolve_lora_adapter_dir
    from orchestrator.automodel._lora import peft_load_dir
    from orchestrator.automodel._stager import accelerator_available, install_cpu_safe_stager
    from orchestrator.automodel._staging import refuse_on_store, stage_step
    from orchestrator.automodel._steps import locate_step
    from orchestrator.automodel._uploads import Turns


@pytest.fixture(scope="module", autouse=True)
def _imported() -> None:
    """Import nemo_automodel when these tests run, not as every worker collects them."""
    global am_checkpointing, CheckpointingConfig, _resolve_lora_adapter_dir, peft_load_dir
    global accelerator_available, install_cpu_safe_stager, refuse_on_store, stage_step
    global locate_step, Turns
    import nemo_automodel.components.checkpoint.checkpointing as am_checkpointing
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig

    from orchestrator.automodel import _resolve_lora_adapter_dir
    from orchestrator.automodel._lora import peft_load_dir
    from orchestrator.automodel._stager import accelerator_available, install_cpu_safe_stager
    from orchestrator.automodel._staging import refuse_on_store, stage_step
    from orchestrator.automodel._steps import locate_step
    from orchestrator.automodel._uploads import Turns


def _adapter(directory: Path, *names: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names or ("adapter_model.safetensors", "adapter_config.json"):
        (directory / name).write_bytes(b"{}")
    return directory


class TestResolveLoraAdapterDir:
    """A weights dir, its model subdir, or an HF PEFT dir; anything else says what it wanted."""

    def test_weights_directory(self, tmp_path: Path) -> None:
        weights = tmp_path / "step_3" / "policy" / "weights"
        _adapter(weights / "model")
        assert _resolve_lora_adapter_dir(str(weights)) == str(weights / "model")

    def test_model_subdirectory(self, tmp_path: Path) -> None:
        model = _adapter(tmp_path / "step_3" / "policy" / "weights" / "model")
        assert _resolve_lora_adapter_dir(str(model)) == str(model)

    def test_hf_peft_directory(self, tmp_path: Path) -> None:
        hf = _adapter(tmp_path / "my-adapter")
        assert _resolve_lora_adapter_dir(str(hf)) == str(hf)

    def test_nothing_there(self, tmp_path: Path) -> None:
        with pytest.raises(FileNotFoundError) as info:
            _resolve_lora_adapter_dir(str(tmp_path))
        message = str(info.value)
        assert "adapter_model.safetensors" in message and "adapter_config.json" in message
        assert str(tmp_path) in message and str(tmp_path / "model") in message

    def test_weights_without_config_is_not_an_adapter(self, tmp_path: Path) -> None:
        _adapter(tmp_path / "model", "adapter_model.safetensors")
        with pytest.raises(FileNotFoundError, match="found only .*adapter_model.safetensors"):
            _resolve_lora_adapter_dir(str(tmp_path))

    def test_missing_path(self, tmp_path: Path) -> None:
        with pytest.raises(FileNotFoundError, match="no LoRA adapter"):
            _resolve_lora_adapter_dir(str(tmp_path / "nope"))

    def test_load_dir_is_named_model(self, tmp_path: Path) -> None:
        hf = _adapter(tmp_path / "my-adapter")
        with peft_load_dir(str(hf)) as load_dir:
            assert os.path.basename(load_dir) == "model"
            assert os.path.realpath(load_dir) == str(hf)
        assert not os.path.exists(load_dir)
        model = _adapter(tmp_path / "w" / "model")
        with peft_load_dir(str(model)) as load_dir:
            assert load_dir == str(model)


class TestLocateStep:
    """The nearest ``tmp_step_N`` ancestor names the step; its parent is the root."""

    def test_nemo_rl_layout(self, tmp_path: Path) -> None:
        location = locate_step(str(tmp_path / "run" / "tmp_step_12" / "policy" / "weights"))
        assert location is not None
        assert (location.root, location.step) == (str(tmp_path / "run"), 12)
        assert location.tmp_dir == str(tmp_path / "run" / "tmp_step_12")
        assert location.relative(str(tmp_path / "run/tmp_step_12/policy/tokenizer")) == (
            "policy/tokenizer"
        )

    def test_nearest_ancestor_wins(self, tmp_path: Path) -> None:
        location = locate_step(str(tmp_path / "tmp_step_1" / "run" / "tmp_step_2" / "w"))
        assert location is not None and location.step == 2

    def test_relative_paths_and_other_prefixes(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.chdir(tmp_path)
        location = locate_step("ckpt/tmp-7/policy/weights", tmp_prefix="tmp-")
        assert location is not None
        assert (location.root, location.step) == (str(tmp_path / "ckpt"), 7)

    @pytest.mark.parametrize("path", ["/ckpt/step_3/policy/weights", "/tmp_step_x/w", "/a/b"])
    def test_not_a_step(self, path: str) -> None:
        assert locate_step(path) is None

    def test_parts_outside_the_step_are_refused(self, tmp_path: Path) -> None:
        location = locate_step(str(tmp_path / "tmp_step_1" / "policy" / "weights"))
        assert location is not None
        with pytest.raises(ValueError, match="not inside"):
            location.relative(str(tmp_path / "tmp_step_2" / "policy" / "optimizer"))
        with pytest.raises(ValueError, match="not inside"):
            location.relative(str(tmp_path / "tmp_step_10"))


class TestCpuStager:
    """On a host without an accelerator, Automodel's DefaultStager() becomes CPU-safe."""

    def test_default_options_fail_here(self) -> None:
        if accelerator_available():
            pytest.skip("this host has an accelerator: the default options work")
        with pytest.raises(AssertionError, match="accelerator"):
            DefaultStager()

    def test_installed_factory(self) -> None:
        if accelerator_available():
            assert install_cpu_safe_stager() is False
            return
        assert install_cpu_safe_stager() is True
        factory = am_checkpointing.DefaultStager
        assert install_cpu_safe_stager() is True
        assert am_checkpointing.DefaultStager is factory  # idempotent
        stager = factory()
        try:
            assert isinstance(stager, DefaultStager)
            options = stager._config
            assert not options.use_pinned_memory and not options.use_non_blocking_copy
            assert options.use_shared_memory and options.use_async_staging
        finally:
            stager.close()


class TestTurns:
    """Uploads run one at a time, in ticket order, whatever order their threads start in."""

    def test_ticket_order(self) -> None:
        turns = Turns()
        tickets = [turns.take() for _ in range(4)]
        order: list[int] = []
        threads = [
            threading.Thread(target=turns.run, args=(t, lambda t=t: order.append(t)))
            for t in reversed(tickets)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert order == tickets

    def test_a_released_ticket_does_not_block_the_next(self) -> None:
        turns = Turns()
        first, second = turns.take(), turns.take()
        turns.release(first)  # its job was never submitted
        assert turns.run(second, lambda: "ran") == "ran"

    def test_a_failing_job_passes_the_turn_on(self) -> None:
        turns = Turns()
        first, second = turns.take(), turns.take()

        def boom() -> None:
            raise RuntimeError("upload failed")

        with pytest.raises(RuntimeError):
            turns.run(first, boom)
        assert turns.run(second, lambda: 2) == 2


class TestObjectStoreSteps:
    """A path in an s3:// root names its step; the rank's local stand-in is its own."""

    @pytest.fixture(autouse=True)
    def _staging(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CKPTD_STAGING_DIR", str(tmp_path / "staging"))

    def test_the_step_and_its_stand_in(self, tmp_path: Path) -> None:
        staged = stage_step("s3://ckpt/runs/r1/tmp_step_12/policy/weights", "tmp_step_", 1)
        assert staged is not None
        assert (staged.root, staged.step) == ("s3://ckpt/runs/r1", 12)
        assert staged.url == "s3://ckpt/runs/r1/tmp_step_12"
        local = Path(staged.local)
        assert local.is_dir() and local.name == "tmp_step_12"
        assert local.is_relative_to(tmp_path / "staging" / "rank1")
        assert staged.local_path(f"{staged.url}/policy/weights") == str(
            local / "policy" / "weights"
        )
        assert staged.location.relative(str(local / "policy" / "optimizer")) == "policy/optimizer"
        staged.discard()
        assert not local.exists()

    def test_a_root_that_is_a_whole_bucket(self) -> None:
        staged = stage_step("s3://ckpt/tmp_step_3/policy/weights", "tmp_step_", 0)
        assert staged is not None and (staged.root, staged.step) == ("s3://ckpt", 3)

    def test_every_save_gets_a_fresh_stand_in(self) -> None:
        first = stage_step("s3://ckpt/r/tmp_step_1/w", "tmp_step_", 0)
        again = stage_step("s3://ckpt/r/tmp_step_1/w", "tmp_step_", 0)
        assert first is not None and again is not None and first.local != again.local

    @pytest.mark.parametrize(
        "path",
        ["s3://ckpt/r/tmp_step_2/policy/weights", "s3://ckpt/r/tmp_step_1/../tmp_step_2/x"],
    )
    def test_a_path_outside_the_step_is_refused(self, path: str) -> None:
        staged = stage_step("s3://ckpt/r/tmp_step_1/policy/weights", "tmp_step_", 0)
        assert staged is not None
        with pytest.raises(ValueError, match="is not inside s3://ckpt/r/tmp_step_1"):
            staged.local_path(path)

    def test_no_step_in_the_url(self) -> None:
        assert stage_step("s3://ckpt/r/step_1/policy/weights", "tmp_step_", 0) is None
        with pytest.raises(ValueError, match="not an object-store URL"):
            stage_step("/ckpt/r/tmp_step_1/policy/weights", "tmp_step_", 0)

    def test_consolidation_and_reference_mode_are_refused(self) -> None:
        staged = stage_step("s3://ckpt/r/tmp_step_1/policy/weights", "tmp_step_", 0)
        assert staged is not None
        updates = {"model_save_format": "safetensors", "save_consolidated": "final"}
        config = CheckpointingConfig(enabled=True, checkpoint_dir="", **updates)
        checkpointer = SimpleNamespace(config=config)
        with pytest.raises(ValueError, match="need the ckptd daemon"):
            refuse_on_store(checkpointer, None, staged, False)
        tracker = object()
        refuse_on_store(checkpointer, tracker, staged, False)  # not final: no consolidation
        with pytest.raises(ValueError, match="consolidated HF safetensors"):
            refuse_on_store(checkpointer, tracker, staged, True)

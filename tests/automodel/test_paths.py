"""Finding adapters and steps on disk; the CPU stager; upload ordering. All in-process."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import nemo_automodel.components.checkpoint.checkpointing as am_checkpointing
import pytest
from torch.distributed.checkpoint.staging import DefaultStager

from orchestrator.automodel import _resolve_lora_adapter_dir
from orchestrator.automodel._lora import peft_load_dir
from orchestrator.automodel._stager import accelerator_available, install_cpu_safe_stager
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

"""``orchestrator.torchtitan.CheckpointManager`` in one process: config, torchtitan's rules.

What torchtitan's own checkpoint tests check (release/0.3,
``tests/unit_tests/test_checkpoint.py``; ``docs/torchtitan.md``), checked here on the
drop-in with real DCP saves and loads: without a daemon every rule is torchtitan's (the
interval, ``last_step``, the first step, ``load_only``, the model-only last step and its
dtype, loading the newest ``step-N`` with ``.metadata``, ``initial_load_path``, purging
to ``keep_latest_k``, the async future waited for before the next save), with one
warning; with a daemon (a real one, world of one), the step is staged where
torchtitan's search cannot see it, promoted to ``step-N``, and never purged by the
trainer. The multi-rank forms and the loop are ``test_torchtitan_forms.py`` and
``test_torchtitan_loop.py``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DaemonProcess


class Optim:
    """A stateful stand-in for torchtitan's optimizer container."""

    def __init__(self) -> None:
        self.value = 1.0

    def state_dict(self) -> dict[str, Any]:
        import torch

        return {"param": torch.tensor([self.value])}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.value = float(state_dict["param"][0])


class Stateless:
    """A stateful with nothing to save (the scheduler and the dataloader here)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


@pytest.fixture
def titan(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Build a manager under ``tmp_path/dump``; no daemon unless a client is given."""
    import torch

    from orchestrator.torchtitan import CheckpointManager

    monkeypatch.setenv("CKPTD_SOCKET", str(tmp_path / "no-daemon.sock"))
    built: list[Any] = []

    def make(model: Any = None, *, client: Any = None, **config: Any) -> Any:
        config.setdefault("enable", True)
        config.setdefault("interval", 1)
        config.setdefault("keep_latest_k", 0)
        config.setdefault("last_save_model_only", False)
        cfg = CheckpointManager.Config(**config)
        manager = cfg.build(
            dataloader=Stateless(),
            model_parts=[model if model is not None else torch.nn.Linear(2, 2)],
            optimizers=Optim(),
            lr_schedulers=Stateless(),
            states={"trainer": torch.tensor([1.5])},
            sd_adapter=None,
            base_folder=str(tmp_path / "dump"),
            **({} if client is None else {"client": client}),
        )
        built.append(manager)
        return manager

    yield make
    for manager in built:
        manager.close()


@pytest.fixture
def world1() -> Iterator[None]:
    """A one-rank gloo group in this process (torchtitan's async modes make a group)."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import HashStore

    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def at(step: int) -> Callable[[dict[str, Any]], bool]:
    """An event matcher for ``step``."""
    return lambda event: event.get("step") == step


def folder(tmp_path: Path, name: str = "checkpoint") -> Path:
    return tmp_path / "dump" / name


def steps_in(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir()) if path.is_dir() else []


class TestConfig:
    """The nested Config is torchtitan's, selects the drop-in, and parses as flags."""

    def test_build_makes_the_drop_in(self, titan: Callable[..., Any]) -> None:
        from orchestrator.torchtitan import CheckpointManager

        assert type(titan()) is CheckpointManager

    def test_same_fields_as_torchtitan(self) -> None:
        from dataclasses import fields

        from torchtitan.components.checkpointer.dcp import CheckpointManager as Upstream

        from orchestrator.torchtitan import CheckpointManager

        ours = {(f.name, f.default) for f in fields(CheckpointManager.Config)}
        theirs = {(f.name, f.default) for f in fields(Upstream.Config)}
        assert ours == theirs
        assert issubclass(CheckpointManager.Config, Upstream.Config)

    def test_checkpoint_flags_keep_working(self) -> None:
        from dataclasses import field, make_dataclass

        import tyro
        from torchtitan.components.checkpointer import BaseCheckpointManager
        from torchtitan.config.manager import custom_registry

        from orchestrator.torchtitan import CheckpointManager

        # A trainer config's checkpoint field, as torchtitan's Trainer.Config declares it.
        default = field(default_factory=lambda: CheckpointManager.Config(interval=10))
        job_type = make_dataclass(
            "Job", [("checkpoint", BaseCheckpointManager.Config, default)], kw_only=True
        )
        args = ["--checkpoint.enable", "--checkpoint.interval", "5"]
        args += ["--checkpoint.async_mode", "async", "--checkpoint.keep_latest_k", "3"]
        job = tyro.cli(job_type, args=args, default=job_type(), registry=custom_registry)
        assert isinstance(job.checkpoint, CheckpointManager.Config)
        assert (job.checkpoint.enable, job.checkpoint.interval) == (True, 5)
        assert (job.checkpoint.async_mode, job.checkpoint.keep_latest_k) == ("async", 3)

    @pytest.mark.parametrize(
        ("fields", "message"),
        [
            ({"folder": "  "}, "folder.*cannot be empty"),
            ({"interval": 0}, "at least 1"),
            ({"keep_latest_k": -1}, "cannot be negative"),
            ({"keep_latest_k": 1}, "at least 2 checkpoint replicas"),
            ({"exclude_from_loading": ["model"]}, "shouldn't be in exclude_from_loading"),
            ({"initial_load_path": "relative/step-1"}, "absolute path or a remote"),
            ({"last_save_in_hf": True, "last_save_model_only": False}, "requires last_save"),
            ({"folder": "gs://b/run", "last_save_in_hf": True}, "not supported with a remote"),
            ({"async_mode": "sometimes"}, "Invalid async_mode"),
        ],
    )
    def test_torchtitan_validation(self, fields: dict[str, Any], message: str) -> None:
        from orchestrator.torchtitan import CheckpointManager

        with pytest.raises(ValueError, match=message):
            CheckpointManager.Config(**fields)

    def test_async_mode_case_normalised(self) -> None:
        from orchestrator.torchtitan import CheckpointManager

        mode: Any = "ASYNC"  # a flag as typed, upper case
        assert CheckpointManager.Config(async_mode=mode).async_mode == "async"

    def test_the_daemon_table(self) -> None:
        from orchestrator.torchtitan import root_toml

        text = root_toml("/ckpt/run/checkpoint", 3)
        assert 'final_prefix = "step-"' in text and "keep_last = 3" in text
        assert "retention" not in root_toml("/ckpt/run/checkpoint", 0)


class TestWithoutDaemon:
    """No daemon: torchtitan's own behaviour, said once."""

    def test_one_warning(self, titan: Callable[..., Any], caplog: pytest.LogCaptureFixture) -> None:
        with caplog.at_level(logging.WARNING, logger="orchestrator.torchtitan"):
            manager = titan()
            manager.save(1)
            manager.save(2)
        said = [r for r in caplog.records if r.name == "orchestrator.torchtitan"]
        assert len(said) == 1 and "saves and purges" in said[0].getMessage()
        assert manager.uses_daemon is False

    def test_save_load_restores_state(self, titan: Callable[..., Any], tmp_path: Path) -> None:
        import torch

        model = torch.nn.Linear(2, 2)
        manager = titan(model)
        before = model.weight.detach().clone()
        manager.save(1)
        with torch.no_grad():
            model.weight.zero_()
        assert manager.load(step=1) is True
        assert torch.equal(model.weight, before)
        assert (folder(tmp_path) / "step-1" / ".metadata").is_file()

    @pytest.mark.usefixtures("world1")  # torchtitan purges on rank 0
    def test_purges_to_keep_latest_k(self, titan: Callable[..., Any], tmp_path: Path) -> None:
        manager = titan(keep_latest_k=2)
        for step in (1, 2, 3):
            manager.save(step)
        manager.close()  # joins the purge thread: what it was given is gone
        assert steps_in(folder(tmp_path)) == ["step-2", "step-3"]

    def test_interval_last_step_and_first_step(
        self, titan: Callable[..., Any], tmp_path: Path
    ) -> None:
        manager = titan(interval=3)
        assert [manager.save(s) for s in (1, 2, 3, 4)] == [False, False, True, False]
        assert manager.save(4, last_step=True) is True
        first = titan(interval=10, folder="first", enable_first_step_checkpoint=True)
        assert [first.save(s) for s in (1, 2, 10)] == [True, False, True]
        assert steps_in(folder(tmp_path)) == ["step-3", "step-4"]

    def test_load_only_never_saves(self, titan: Callable[..., Any], tmp_path: Path) -> None:
        manager = titan(load_only=True)
        assert not manager.save(1) and not manager.save(5, last_step=True)
        assert steps_in(folder(tmp_path)) == []

    def test_last_step_model_only_in_export_dtype(
        self, titan: Callable[..., Any], tmp_path: Path
    ) -> None:
        import torch
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        class WithBuffer(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.weight = torch.nn.Parameter(torch.randn(2, 2))
                self.register_buffer("freqs_cis", torch.randn(3), persistent=False)

        manager = titan(WithBuffer(), last_save_model_only=True, export_dtype="bfloat16")
        manager.save(7, last_step=True)
        meta = FileSystemReader(str(folder(tmp_path) / "step-7")).read_metadata()
        assert list(meta.state_dict_metadata) == ["weight"]
        assert meta.state_dict_metadata["weight"].properties.dtype == torch.bfloat16  # type: ignore[union-attr]

    def test_load_rules(self, titan: Callable[..., Any], tmp_path: Path) -> None:
        fresh = titan(folder="empty")
        assert fresh.load(step=-1) is False
        with pytest.raises(FileNotFoundError, match="--checkpoint.load_step=5"):
            titan(folder="missing").load(step=5)
        manager = titan()
        manager.save(2)
        manager.save(5)
        os.makedirs(folder(tmp_path) / "step-9")  # no .metadata: not a checkpoint
        assert manager._find_load_step() == 5
        assert titan(initial_load_path=str(folder(tmp_path) / "step-2")).load() is True

    def test_remote_folder_discovery(self) -> None:
        import uuid

        import fsspec

        from orchestrator.torchtitan import CheckpointManager

        url = f"memory://titan-{uuid.uuid4().hex}"
        for name in ("step-10/.metadata", "step-20/.metadata", "step-30/shard"):
            with fsspec.open(f"{url}/{name}", "wb") as fh:
                fh.write(b"x")
        bare = CheckpointManager.__new__(CheckpointManager)
        assert bare._find_load_step(folder=url) == 20

    def test_disabled_manager_waits_for_nothing(self, titan: Callable[..., Any]) -> None:
        manager = titan(enable=False)
        manager.maybe_wait_for_staging()
        manager.maybe_wait_for_saving()
        assert manager.save(1) is False

    @pytest.mark.usefixtures("world1")
    def test_async_save_waits_for_the_previous_upload(self, titan: Callable[..., Any]) -> None:
        manager = titan(async_mode="async")
        manager.save(1)
        first = manager.save_future
        manager.save(2)
        assert first.done() and manager.save_future is not first
        manager.maybe_wait_for_saving()
        assert manager.save_future is None


class TestWithDaemon:
    """A daemon serving the folder: staged out of torchtitan's sight, promoted, never purged."""

    @pytest.fixture
    def served(self, tmp_path: Path, short_dir: Path) -> Iterator[tuple[DaemonProcess, Any]]:
        from orchestrator import CheckpointClient
        from orchestrator.torchtitan import root_toml

        root = folder(tmp_path)
        root.mkdir(parents=True)
        (tmp_path / "ckptd.toml").write_text(root_toml(str(root), 2))
        daemon = DaemonProcess(short_dir / "d.sock", [], "--config", str(tmp_path / "ckptd.toml"))
        daemon.start()
        client = CheckpointClient(str(daemon.socket_path))
        try:
            yield daemon, client
        finally:
            client.close(timeout=5)
            daemon.kill()
            if daemon.proc is not None and daemon.proc.stdout is not None:
                daemon.proc.stdout.close()

    @pytest.mark.usefixtures("world1")
    def test_sync_and_async_saves_promoted(
        self, titan: Callable[..., Any], served: tuple[DaemonProcess, Any], tmp_path: Path
    ) -> None:
        daemon, client = served
        manager = titan(client=client, async_mode="async", keep_latest_k=2)
        assert manager.uses_daemon and manager._should_purge() is False
        for step in (1, 2, 3):
            manager.save(step)
        manager.save(4, last_step=True)
        for step in (1, 2, 3, 4):
            daemon.wait_event("checkpoint.promoted", match=at(step))
        for step in (1, 2):
            daemon.wait_event("checkpoint.retired", match=at(step))
        assert [n for n in steps_in(folder(tmp_path)) if n.startswith("step-")] == [
            "step-3",
            "step-4",
        ]
        assert manager._find_load_step() == 4

    def test_staged_names_are_invisible_to_torchtitan(self, tmp_path: Path) -> None:
        from orchestrator.torchtitan import CheckpointManager

        staged = folder(tmp_path) / "tmp_step_7"
        staged.mkdir(parents=True)
        (staged / ".metadata").write_bytes(b"x")
        bare = CheckpointManager.__new__(CheckpointManager)
        assert bare._find_load_step(folder=str(folder(tmp_path))) == -1

    def test_a_layout_torchtitan_cannot_read_is_refused(
        self, titan: Callable[..., Any], tmp_path: Path, short_dir: Path
    ) -> None:
        from orchestrator import CheckpointClient

        root = folder(tmp_path, "plain")
        root.mkdir(parents=True)
        daemon = DaemonProcess(short_dir / "p.sock", [root])
        daemon.start()
        client = CheckpointClient(str(daemon.socket_path))
        try:
            with pytest.raises(ValueError, match='final_prefix = "step-"'):
                titan(client=client, folder="plain")
        finally:
            client.close(timeout=5)
            daemon.kill()
            if daemon.proc is not None and daemon.proc.stdout is not None:
                daemon.proc.stdout.close()

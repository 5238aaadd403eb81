"""``orchestrator.nemo_rl.CheckpointManager`` with a real daemon, and without one.

The driver's manager never renames or deletes with a daemon: a worker (here one rank of
a real ``CheckpointClient`` naming the manager's run, as ``AutomodelCheckpointManager``
does) begins and reports the step, the daemon promotes it, ``finalize_pending`` waits
for the verdict and raises as NeMo-RL does when the step failed; retention is the
daemon's policy with NeMo-RL's semantics, and the paths answer from its pointers.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator import CheckpointClient, FileEntry
from orchestrator.nemo_rl import CheckpointManager, StepFailed, retention_toml
from tests.conftest import DaemonProcess

Start = Callable[..., DaemonProcess]


def config_for(root: Path, **keys: Any) -> dict[str, Any]:
    return {
        "enabled": True,
        "checkpoint_dir": root,
        "metric_name": "val:reward",
        "higher_is_better": True,
        "save_period": 1,
        "keep_top_k": None,
        "save_optimizer": True,
        **keys,
    }


def serve(start: Start, tmp_path: Path, root: Path, config: dict[str, Any]) -> DaemonProcess:
    from orchestrator.nemo_rl import retention_table

    toml = tmp_path / "ckptd.toml"
    toml.write_text(retention_toml(str(root), retention_table(config)))
    return start([], "--config", str(toml), "--lease", "2")


@pytest.fixture
def worker(daemon: DaemonProcess) -> Iterator[Callable[..., None]]:
    """One rank's save of a step into ``tmp_step_N``, as the workers' manager does it."""
    clients: dict[str, CheckpointClient] = {}

    def save(root: Path, step: int, run: str, *, fail: bool = False) -> None:
        client = clients.setdefault(run, CheckpointClient(str(daemon.socket_path), run=run))
        handle = client.save(str(root), step, 0, 1)
        shard = Path(handle.path) / "policy" / "weights" / "model" / "shard.bin"
        shard.parent.mkdir(parents=True, exist_ok=True)
        shard.write_bytes(b"x" * 64)
        if fail:
            handle.fail("the upload failed")
            return
        handle.add_files([FileEntry("policy/weights/model/shard.bin", 64)])
        handle.seal()

    yield save
    for client in clients.values():
        client.close(timeout=5)


@pytest.fixture
def daemon(
    start: Start, tmp_path: Path, root: Path, request: pytest.FixtureRequest
) -> DaemonProcess:
    keys = getattr(request, "param", {})
    return serve(start, tmp_path, root, config_for(root, **keys))


def manager_for(daemon: DaemonProcess, root: Path, **keys: Any) -> CheckpointManager:
    client = CheckpointClient(str(daemon.socket_path))
    return CheckpointManager(config_for(root, **keys), client=client)  # type: ignore[arg-type]


class TestPromotedByTheDaemon:
    """begin_finalization returns at once; the daemon renames; finalize_pending waits."""

    def test_async_finalization(
        self, daemon: DaemonProcess, worker: Callable[..., None], root: Path
    ) -> None:
        manager = manager_for(daemon, root)
        assert manager.uses_daemon and manager.run.startswith("nemo-rl-")
        called: list[str] = []
        tmp = manager.init_tmp_checkpoint(1, {"val:reward": 0.5, "step": 1})
        worker(root, 1, manager.run)
        began = time.monotonic()
        manager.begin_finalization(tmp, wait_fn=lambda: called.append("wait"))
        assert time.monotonic() - began < 0.5
        manager.finalize_pending()
        assert called == []  # the daemon tracked the uploads: the workers never block
        assert not Path(tmp).exists() and (root / "step_1" / "training_info.json").exists()
        assert manager.get_latest_checkpoint_path() == str(root / "step_1")
        assert manager.load_training_info(root / "step_1") == {"val:reward": 0.5, "step": 1}
        manager.shutdown()

    def test_failed_step_raises_as_upstream(
        self, daemon: DaemonProcess, worker: Callable[..., None], root: Path
    ) -> None:
        manager = manager_for(daemon, root)
        tmp = manager.init_tmp_checkpoint(1, {"val:reward": 0.5})
        worker(root, 1, manager.run, fail=True)
        manager.begin_finalization(tmp)
        with pytest.raises(RuntimeError, match="Background checkpoint finalization failed") as err:
            manager.finalize_pending()
        assert isinstance(err.value.__cause__, StepFailed)
        assert "the upload failed" in str(err.value.__cause__)
        assert not (root / "step_1").exists()
        # The job restarts (a new manager, a new run) and saves the step again.
        manager = manager_for(daemon, root)
        tmp = manager.init_tmp_checkpoint(1, {"val:reward": 0.6})
        worker(root, 1, manager.run)
        manager.finalize_checkpoint(tmp)
        assert manager.load_training_info(root / "step_1") == {"val:reward": 0.6}

    def test_workers_without_the_daemon_are_renamed_here(
        self, daemon: DaemonProcess, root: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        manager = manager_for(daemon, root)
        tmp = manager.init_tmp_checkpoint(1, {"val:reward": 0.5})
        called: list[str] = []
        with caplog.at_level(logging.WARNING, "orchestrator.nemo_rl"):
            manager.begin_finalization(tmp, wait_fn=lambda: called.append("wait"))
            manager.finalize_pending()
        assert called == ["wait"] and (root / "step_1").is_dir()
        assert "no worker began step 1" in caplog.text


class TestRetention:
    """keep_top_k=2 by the metric, ft_keep_latest_k=1: the daemon prunes as NeMo-RL would."""

    @pytest.mark.parametrize("daemon", [{"keep_top_k": 2, "ft_keep_latest_k": 1}], indirect=True)
    def test_top_k_and_best(
        self, daemon: DaemonProcess, worker: Callable[..., None], root: Path
    ) -> None:
        manager = manager_for(daemon, root, keep_top_k=2, ft_keep_latest_k=1)
        rewards = {1: 0.3, 2: 0.9, 3: None, 4: 0.1, 5: 0.7, 6: 0.2}
        for step, reward in rewards.items():
            info = {} if reward is None else {"val:reward": reward}
            tmp = manager.init_tmp_checkpoint(step, info)
            worker(root, step, manager.run)
            manager.begin_finalization(tmp)
        manager.shutdown()
        manager.remove_old_checkpoints()  # a pass now: every retirement is done
        # top-2 by reward {2, 5}; the newest {6}.
        deadline = time.monotonic() + 30
        while sorted(p.name for p in root.glob("step_*")) != ["step_2", "step_5", "step_6"]:
            daemon.wait_event("checkpoint.retired", max(deadline - time.monotonic(), 0.01))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert manager.get_best_checkpoint_path() == str(root / "step_2")
        assert caught == []


class TestWithoutADaemon:
    """No daemon: NeMo-RL's own renames, with one warning saying so."""

    def test_renames_itself(
        self, root: Path, short_dir: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        with caplog.at_level(logging.WARNING, "orchestrator.nemo_rl"):
            client = CheckpointClient(str(short_dir / "nobody.sock"))
            manager = CheckpointManager(config_for(root), client=client)  # type: ignore[arg-type]
        client.close(timeout=0)
        assert not manager.uses_daemon
        said = [r for r in caplog.records if "renames and prunes" in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.WARNING
        tmp = manager.init_tmp_checkpoint(1, {"val:reward": 0.5})
        manager.finalize_checkpoint(tmp)
        assert (root / "step_1").is_dir() and not Path(tmp).exists()
        assert manager.run != CheckpointManager(config_for(root), use_daemon=False).run  # type: ignore[arg-type]

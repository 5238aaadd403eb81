"""``orchestrator.nemo_rl.CheckpointManager`` without a daemon: NeMo-RL's own behaviour.

Every behaviour NeMo-RL's unit tests of ``nemo_rl.utils.checkpoint`` check, written
again here on real directories: the step layout and its files, the rename (and the swap
over an existing ``step_N``), the retention rules (top-k by a metric or by recency, the
periodic steps, ``ft_keep_latest_k``, the newest kept), the best and latest paths and
their warnings, the resume paths of each model component and backend, and the
background finalization (its thread, its errors, shutdown, the context manager).
With a daemon: ``tests/test_nemo_rl.py``.
"""

from __future__ import annotations

import json
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal

import pytest

from orchestrator.nemo_rl import CheckpointingConfig, CheckpointManager
from orchestrator.nemo_rl._local import Checkpoint, best_of, resume_paths

Component = Literal["policy", "value"]

HINT = "val_at_end"
"""Every warning about a missing metric tells how to get one."""


def make_config(root: Path, **keys: Any) -> CheckpointingConfig:
    """NeMo-RL's ``checkpointing`` block over ``root``: keep 3 by lowest ``loss``."""
    config = CheckpointingConfig(
        enabled=True,
        checkpoint_dir=root,
        metric_name="loss",
        higher_is_better=False,
        save_period=1,
        keep_top_k=3,
        save_optimizer=True,
    )
    config.update(keys)  # type: ignore[typeddict-item]
    return config


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "ckpts"


@pytest.fixture
def managers(root: Path) -> Iterator[Callable[..., CheckpointManager]]:
    """Managers over ``root`` that never use a daemon; each is shut down at the end."""
    made: list[CheckpointManager] = []

    def make(**keys: Any) -> CheckpointManager:
        manager = CheckpointManager(make_config(root, **keys), use_daemon=False)
        made.append(manager)
        return manager

    yield make
    for manager in made:
        manager.shutdown()


def save(manager: CheckpointManager, steps: Sequence[tuple[int, dict[str, Any]]]) -> None:
    """Each step written and finalized at once, in order."""
    for step, info in steps:
        manager.finalize_checkpoint(manager.init_tmp_checkpoint(step, info))


def steps_left(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step_*") if p.name[5:].isdigit())


class RunConfig:
    """A run configuration as NeMo-RL passes it: anything with ``model_dump()``."""

    def __init__(self, **values: Any) -> None:
        self.values = values

    def model_dump(self) -> dict[str, Any]:
        return dict(self.values)


class TestTmpCheckpoint:
    """``init_tmp_checkpoint`` writes ``tmp_step_N`` with the step's info and the run's config."""

    def test_creates_tmp_step(self, managers: Callable[..., CheckpointManager], root: Path) -> None:
        path = Path(managers().init_tmp_checkpoint(7, {"loss": 0.5}))
        assert path == root / "tmp_step_7"
        assert path.is_dir() and path.is_absolute()

    def test_training_info_numbers(self, managers: Callable[..., CheckpointManager]) -> None:
        import numpy as np
        import torch

        info = {"loss": 0.5, "tensor": torch.tensor(0.25), "array": np.array(0.75), "n": 3}
        path = Path(managers().init_tmp_checkpoint(1, info))
        written = json.loads((path / "training_info.json").read_text())
        assert written == {"loss": 0.5, "tensor": 0.25, "array": 0.75, "n": 3}

    def test_config_yaml(self, managers: Callable[..., CheckpointManager]) -> None:
        import yaml

        run_config = RunConfig(policy={"model_name": "tiny"}, seed=3)
        path = Path(managers().init_tmp_checkpoint(1, {}, run_config))
        assert yaml.safe_load((path / "config.yaml").read_text()) == run_config.model_dump()

    def test_no_config_no_yaml(self, managers: Callable[..., CheckpointManager]) -> None:
        path = Path(managers().init_tmp_checkpoint(1, {"loss": 1.0}))
        assert sorted(p.name for p in path.iterdir()) == ["training_info.json"]

    def test_stale_tmp_replaced(self, managers: Callable[..., CheckpointManager]) -> None:
        manager = managers()
        first = Path(manager.init_tmp_checkpoint(2, {"loss": 1.0}))
        (first / "half_written.bin").write_bytes(b"x")
        second = Path(manager.init_tmp_checkpoint(2, {"loss": 2.0}))
        assert second == first and not (second / "half_written.bin").exists()
        assert json.loads((second / "training_info.json").read_text()) == {"loss": 2.0}


class TestFinalizeCheckpoint:
    """``finalize_checkpoint`` renames ``tmp_step_N`` to ``step_N``, replacing an old one."""

    def test_renames(self, managers: Callable[..., CheckpointManager], root: Path) -> None:
        manager = managers()
        tmp = Path(manager.init_tmp_checkpoint(4, {"loss": 0.5}))
        manager.finalize_checkpoint(tmp)
        assert not tmp.exists()
        assert (root / "step_4" / "training_info.json").is_file()

    def test_replaces_existing_step(
        self, managers: Callable[..., CheckpointManager], root: Path
    ) -> None:
        manager = managers()
        save(manager, [(1, {"loss": 0.5})])
        (root / "step_1" / "from_the_first_save").write_text("old")
        tmp = Path(manager.init_tmp_checkpoint(1, {"loss": 0.2}))
        manager.finalize_checkpoint(tmp)
        assert sorted(p.name for p in root.iterdir()) == ["step_1"]  # no old_step_1 left
        assert not (root / "step_1" / "from_the_first_save").exists()
        assert manager.load_training_info(root / "step_1") == {"loss": 0.2}


class TestTopK:
    """``keep_top_k``: the k best by the metric (missing: worst; ties: newer), and the newest."""

    def test_lowest_losses_and_newest(
        self, managers: Callable[..., CheckpointManager], root: Path
    ) -> None:
        losses = [0.5, 0.3, 0.7, 0.2, 0.4, 0.8]
        save(managers(), [(s, {"loss": x}) for s, x in enumerate(losses, 1)])
        assert steps_left(root) == [2, 4, 5, 6]  # 0.3, 0.2, 0.4 and the newest (0.8)

    def test_highest_when_higher_is_better(
        self, managers: Callable[..., CheckpointManager], root: Path
    ) -> None:
        manager = managers(metric_name="acc", higher_is_better=True, keep_top_k=2)
        save(manager, [(s, {"acc": x}) for s, x in enumerate([0.9, 0.1, 0.8, 0.2, 0.3], 1)])
        assert steps_left(root) == [1, 3, 5]

    def test_ties_keep_the_newer(
        self, managers: Callable[..., CheckpointManager], root: Path
    ) -> None:
        save(managers(), [(s, {"loss": 0.5}) for s in (1, 2, 3, 4, 10, 12)])
        assert steps_left(root) == [4, 10, 12]

    def test_missing_metric_ranks_worst(
        self, managers: Callable[..., CheckpointManager], root: Path
    ) -> None:
        infos: list[dict[str, Any]] = [
            {"loss": 0.5},
            {"loss": 0.3},
            {"other": 0.8},
            {"loss": 0.2},
            {},
            {"loss": 1.0},
            {},
        ]
        save(managers(), list(zip([1, 2, 3, 4, 10, 11, 12], infos, strict=True)))
        assert steps_left(root) == [1, 2, 4, 12]

    def test_unscored_fill_places_newest_first(
        self, managers: Callable[..., CheckpointManager], root: Path
    ) -> None:
        infos: list[dict[str, Any]] = [{"loss": 0.2}, {}, {"other": 0.8}, {}, {}, {}]
        save(managers(), list(zip([1, 2, 3, 4, 10, 12], infos, strict=True)))
        assert steps_left(root) == [1, 10, 12]

    def test_numeric_step_order(
        self, managers: Callable[..., CheckpointManager], root: Path
    ) -> None:
        save(managers(), [(s, {"loss": 0.5}) for s in (8, 9, 10, 11)])
        assert steps_left(root) == [9, 10, 11]  # step_9 is older than step_10

    def test_none_keeps_all(self, managers: Callable[..., CheckpointManager], root: Path) -> None:
        save(managers(keep_top_k=None), [(s, {"loss": 0.5}) for s in (1, 2, 3)])
        assert steps_left(root) == [1, 2, 3]

    def test_newest_unprotected(
        self, managers: Callable[..., CheckpointManager], root: Path
    ) -> None:
        save(
            managers(keep_top_k=None), [(1, {"loss": 0.1}), (2, {"loss": 0.2}), (3, {"loss": 0.9})]
        )
        managers(keep_top_k=1).remove_old_checkpoints(exclude_latest=False)
        assert steps_left(root) == [1]


# Each: the config's retention keys, each saved step's info, the steps left.
RETENTION = {
    "both_none_keep_all": ({}, [(s, {"loss": float(s)}) for s in range(1, 6)], [1, 2, 3, 4, 5]),
    "ft_1_no_periodic": (
        {"ft_keep_latest_k": 1, "save_period": 100},
        [(s, {}) for s in range(1, 6)],
        [5],
    ),
    "ft_2_no_periodic": (
        {"ft_keep_latest_k": 2, "save_period": 100},
        [(s, {}) for s in range(1, 8)],
        [6, 7],
    ),
    "top_k_by_recency": ({"keep_top_k": 2}, [(s, {}) for s in range(1, 6)], [4, 5]),
    "top_k_and_ft_overlap": (
        {"keep_top_k": 1, "ft_keep_latest_k": 1},
        [(s, {}) for s in range(1, 10)],
        [9],
    ),
    "best_and_newest_differ": (
        {"keep_top_k": 1, "ft_keep_latest_k": 1, "metric_name": "r", "higher_is_better": True},
        [(s, {"r": r}) for s, r in enumerate([0.5, 0.9, 0.3, 0.1, 0.2, 0.4], 1)],
        [2, 6],
    ),
    "union_counted_once": (
        {"keep_top_k": 2, "ft_keep_latest_k": 2, "metric_name": "r", "higher_is_better": True},
        [(s, {"r": r}) for s, r in enumerate([0.1, 0.2, 0.3, 0.9, 0.8, 0.4], 1)],
        [4, 5, 6],
    ),
    "every_periodic_without_top_k": (
        {"ft_keep_latest_k": 1, "save_period": 2},
        [(s, {}) for s in range(1, 7)],
        [2, 4, 6],
    ),
    "periodic_capped_by_top_k": (
        {"keep_top_k": 1, "ft_keep_latest_k": 1, "save_period": 2},
        [(s, {}) for s in range(1, 9)],
        [8],
    ),
    "best_periodic_only": (
        {
            "keep_top_k": 1,
            "ft_keep_latest_k": 1,
            "metric_name": "r",
            "higher_is_better": True,
            "save_period": 2,
        },
        [(s, {"r": r}) for s, r in enumerate([0.95, 0.5, 0.99, 0.9, 0.2, 0.3, 0.25, 0.4], 1)],
        [4, 8],
    ),
    "best_and_recent_disjoint": (
        {"keep_top_k": 2, "ft_keep_latest_k": 2, "metric_name": "r", "higher_is_better": True},
        [(s, {"r": r}) for s, r in enumerate([0.9, 0.8, 0.1, 0.2, 0.3, 0.4], 1)],
        [1, 2, 5, 6],
    ),
    "ft_only_with_metric": (
        {"keep_top_k": None, "ft_keep_latest_k": 3, "save_period": 5},
        [(s, {"loss": 0.1 * s}) for s in range(1, 8)],
        [5, 6, 7],
    ),
}


class TestRetentionUnion:
    """A step survives if any rule keeps it: periodic top-k, the ft newest k, the newest."""

    @pytest.mark.parametrize(("keys", "saved", "left"), RETENTION.values(), ids=RETENTION.keys())
    def test_rules(
        self,
        managers: Callable[..., CheckpointManager],
        root: Path,
        keys: dict[str, Any],
        saved: list[tuple[int, dict[str, Any]]],
        left: list[int],
    ) -> None:
        defaults = {"keep_top_k": None, "metric_name": None, "ft_keep_latest_k": None}
        save(managers(**{**defaults, **keys}), saved)
        assert steps_left(root) == left


class TestBestPath:
    """``get_best_checkpoint_path``: the best by the metric (ties: the newer), or a warning."""

    def test_lowest_loss(self, managers: Callable[..., CheckpointManager], root: Path) -> None:
        manager = managers()
        save(manager, [(1, {"loss": 0.5}), (2, {"loss": 0.3}), (3, {"loss": 0.7})])
        assert manager.get_best_checkpoint_path() == str(root / "step_2")

    def test_highest_accuracy(self, managers: Callable[..., CheckpointManager], root: Path) -> None:
        manager = managers(metric_name="acc", higher_is_better=True, keep_top_k=None)
        save(manager, [(1, {"acc": 0.7}), (2, {"acc": 0.9}), (3, {"acc": 0.8})])
        assert manager.get_best_checkpoint_path() == str(root / "step_2")

    def test_tie_goes_to_the_newer(
        self, managers: Callable[..., CheckpointManager], root: Path
    ) -> None:
        manager = managers()
        save(manager, [(1, {"loss": 0.2}), (5, {"loss": 0.5}), (10, {"loss": 0.2})])
        assert manager.get_best_checkpoint_path() == str(root / "step_10")

    @pytest.mark.parametrize("order", ["oldest_first", "newest_first"])
    def test_tie_whatever_the_listing_order(self, order: str) -> None:
        listing = [
            Checkpoint(1, "step_1", {"loss": 0.2}),
            Checkpoint(5, "step_5", {"loss": 0.5}),
            Checkpoint(10, "step_10", {"loss": 0.2}),
        ]
        if order == "newest_first":
            listing.reverse()
        assert best_of(listing, "loss", False) == "step_10"

    def test_none_without_checkpoints(self, managers: Callable[..., CheckpointManager]) -> None:
        assert managers().get_best_checkpoint_path() is None

    def test_missing_metric_ignored_with_one_warning(
        self, managers: Callable[..., CheckpointManager], root: Path
    ) -> None:
        manager = managers(keep_top_k=None)
        infos: list[dict[str, Any]] = [{"loss": 0.5}, {"other": 0.8}, {"loss": 0.3}, {}]
        save(manager, list(zip([1, 2, 3, 4], infos, strict=True)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            best = manager.get_best_checkpoint_path()
        assert best == str(root / "step_3")
        assert len(caught) == 1
        message = str(caught[0].message)
        assert "Ignoring 2 checkpoint(s)" in message
        assert HINT in message

    def test_all_missing_gives_latest_with_two_warnings(
        self, managers: Callable[..., CheckpointManager], root: Path
    ) -> None:
        manager = managers(keep_top_k=None)
        save(manager, [(1, {"other": 0.5}), (2, {}), (3, {"different": 0.3})])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            best = manager.get_best_checkpoint_path()
        assert best == str(root / "step_3")
        first, second = (str(w.message) for w in caught)
        assert "Ignoring 3 checkpoint(s)" in first
        assert "No checkpoints contain metric 'loss'" in second
        assert "Returning latest checkpoint" in second and HINT in second


class TestLatestPath:
    """``get_latest_checkpoint_path``: the highest step by number, ignoring other names."""

    def test_highest(self, managers: Callable[..., CheckpointManager], root: Path) -> None:
        manager = managers(keep_top_k=None)
        save(manager, [(s, {"loss": 0.5}) for s in (1, 2, 3)])
        assert manager.get_latest_checkpoint_path() == str(root / "step_3")

    def test_across_digits(self, managers: Callable[..., CheckpointManager], root: Path) -> None:
        manager = managers(keep_top_k=None)
        save(manager, [(s, {"loss": 0.5}) for s in (8, 9, 10, 11)])
        assert manager.get_latest_checkpoint_path() == str(root / "step_11")

    @pytest.mark.parametrize("other", ["step_1-hf", "step_9-hf", "step_x", "tmp_step_20"])
    def test_other_names_ignored(
        self, managers: Callable[..., CheckpointManager], root: Path, other: str
    ) -> None:
        manager = managers()
        save(manager, [(1, {"loss": 0.5})])
        (root / other).mkdir()
        assert manager.get_latest_checkpoint_path() == str(root / "step_1")

    def test_none_when_empty(self, managers: Callable[..., CheckpointManager]) -> None:
        assert managers().get_latest_checkpoint_path() is None


class TestTrainingInfo:
    """``load_training_info`` reads back what the step was saved with; None for no checkpoint."""

    def test_roundtrip(self, managers: Callable[..., CheckpointManager], root: Path) -> None:
        manager = managers()
        info = {"loss": 0.5, "step": 1, "val:accuracy": 0.25}
        save(manager, [(1, info)])
        assert manager.load_training_info(root / "step_1") == info

    def test_none(self, managers: Callable[..., CheckpointManager]) -> None:
        assert managers().load_training_info(None) is None


class TestConfigAttributes:
    """The config's keys are the manager's attributes, with NeMo-RL's defaults."""

    @pytest.mark.parametrize("value", [True, False])
    def test_save_optimizer_as_given(
        self, managers: Callable[..., CheckpointManager], value: bool
    ) -> None:
        assert managers(save_optimizer=value).save_optimizer is value

    def test_save_optimizer_default(self, root: Path) -> None:
        config = make_config(root)
        del config["save_optimizer"]
        assert CheckpointManager(config, use_daemon=False).save_optimizer is True

    def test_without_a_daemon_by_default(
        self, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("CKPTD_SOCKET", str(tmp_path / "nobody.sock"))
        manager = CheckpointManager(make_config(root))
        assert not manager.uses_daemon
        save(manager, [(1, {"loss": 0.1})])
        assert steps_left(root) == [1]


def megatron_step(root: Path, component: str, marker: str, state: dict[str, Any]) -> Path:
    """A step whose weights are a Megatron checkpoint: ``iter_0000000`` with its marker.

    The common state, which Megatron-Core would read, is the marker's JSON content here.
    """
    iteration = root / "step_1" / component / "weights" / "iter_0000000"
    iteration.mkdir(parents=True)
    (iteration / marker).write_text(json.dumps(state))
    return root / "step_1"


class CommonState:
    """Reads the common state :func:`megatron_step` wrote, counting the reads."""

    def __init__(self, error: Exception | None = None) -> None:
        self.read: list[Path] = []
        self.error = error

    def __call__(self, iteration: Path) -> dict[str, Any]:
        self.read.append(iteration)
        if self.error is not None:
            raise self.error
        marker = next(p for p in iteration.iterdir() if p.name in ("common.pt", "metadata.json"))
        state: dict[str, Any] = json.loads(marker.read_text())
        return state


class TestResumePaths:
    """``get_resume_paths``: weights, and an optimizer only where one was saved."""

    @pytest.mark.parametrize("component", ["policy", "value"])
    def test_separate_optimizer(self, root: Path, component: Component) -> None:
        (root / "step_1" / component / "weights").mkdir(parents=True)
        (root / "step_1" / component / "optimizer").mkdir()
        weights, optimizer = CheckpointManager.get_resume_paths(
            root / "step_1", model_component=component
        )
        assert weights == root / "step_1" / component / "weights"
        assert optimizer == root / "step_1" / component / "optimizer"

    def test_policy_by_default(self, root: Path) -> None:
        (root / "step_1" / "policy" / "optimizer").mkdir(parents=True)
        (root / "step_1" / "value" / "optimizer").mkdir(parents=True)
        weights, optimizer = CheckpointManager.get_resume_paths(root / "step_1")
        assert weights == root / "step_1" / "policy" / "weights"
        assert optimizer == root / "step_1" / "policy" / "optimizer"

    def test_nothing_to_resume(self) -> None:
        assert CheckpointManager.get_resume_paths(None) == (None, None)

    @pytest.mark.parametrize("component", ["policy", "value"])
    def test_missing_optimizer_warns(self, root: Path, component: Component) -> None:
        (root / "step_1" / component / "weights").mkdir(parents=True)
        with pytest.warns(UserWarning, match="Optimizer state not found"):
            weights, optimizer = CheckpointManager.get_resume_paths(
                root / "step_1", model_component=component
            )
        assert weights == root / "step_1" / component / "weights"
        assert optimizer is None

    @pytest.mark.parametrize("component", ["policy", "value"])
    @pytest.mark.parametrize("marker", ["common.pt", "metadata.json"])
    def test_megatron_embedded_optimizer(self, root: Path, component: str, marker: str) -> None:
        step = megatron_step(root, component, marker, {"optimizer": {}, "args": {}})
        common = CommonState()
        weights, optimizer = resume_paths(step, component, common)
        assert (weights, optimizer) == (
            step / component / "weights",
            step / component / "optimizer",
        )
        assert common.read == [step / component / "weights" / "iter_0000000"]

    def test_megatron_without_optimizer_warns(self, root: Path) -> None:
        step = megatron_step(root, "policy", "metadata.json", {"args": {}})
        with pytest.warns(UserWarning, match="Optimizer state not found"):
            weights, optimizer = resume_paths(step, "policy", CommonState())
        assert weights == step / "policy" / "weights"
        assert optimizer is None

    def test_optimizer_directory_wins_over_megatron(self, root: Path) -> None:
        step = megatron_step(root, "policy", "metadata.json", {"optimizer": {}})
        (step / "policy" / "optimizer").mkdir()
        common = CommonState()
        assert resume_paths(step, "policy", common) == (
            step / "policy" / "weights",
            step / "policy" / "optimizer",
        )
        assert common.read == []

    @pytest.mark.parametrize(
        "error", [RuntimeError("Megatron-Core is required"), OSError("checkpoint is unreadable")]
    )
    def test_megatron_read_failure_raised(self, root: Path, error: Exception) -> None:
        step = megatron_step(root, "policy", "metadata.json", {"optimizer": {}})
        with pytest.raises(type(error), match=str(error)):
            resume_paths(step, "policy", CommonState(error))

    def test_megatron_core_missing_here(self, root: Path) -> None:
        """This environment has no Megatron-Core: the manager's own reader says so."""
        step = megatron_step(root, "policy", "common.pt", {"optimizer": {}})
        with pytest.raises(RuntimeError, match="Megatron-Core is required"):
            CheckpointManager.get_resume_paths(step)


class Gate:
    """A ``wait_fn`` that blocks until opened, and records what it saw when called."""

    def __init__(self, tmp: Path | None = None, error: Exception | None = None) -> None:
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.tmp = tmp
        self.error = error
        self.saw_tmp: bool | None = None

    def open(self) -> None:
        self.opened.set()

    def __call__(self) -> None:
        self.entered.set()
        if self.tmp is not None:
            self.saw_tmp = self.tmp.exists()
        assert self.opened.wait(30), "the test never opened the gate"
        if self.error is not None:
            raise self.error


@pytest.fixture
def lazy(managers: Callable[..., CheckpointManager]) -> CheckpointManager:
    """A manager with no metric and no retention: every step is kept."""
    return managers(metric_name=None, keep_top_k=None)


class TestBeginFinalization:
    """``begin_finalization`` renames on a thread after ``wait_fn``; one at a time."""

    def test_without_wait_fn(self, lazy: CheckpointManager, root: Path) -> None:
        tmp = Path(lazy.init_tmp_checkpoint(1, {"loss": 0.1}))
        lazy.begin_finalization(tmp, wait_fn=None)
        lazy.finalize_pending()
        assert not tmp.exists() and (root / "step_1").is_dir()

    def test_renames_only_after_wait_fn(self, lazy: CheckpointManager, root: Path) -> None:
        tmp = Path(lazy.init_tmp_checkpoint(1, {"loss": 0.1}))
        gate = Gate(tmp)
        lazy.begin_finalization(tmp, wait_fn=gate)
        assert gate.entered.wait(30)
        assert tmp.exists() and not (root / "step_1").exists()
        gate.open()
        lazy.finalize_pending()
        assert gate.saw_tmp is True and (root / "step_1").is_dir()

    def test_returns_while_wait_fn_blocks(self, lazy: CheckpointManager) -> None:
        gate = Gate()
        lazy.begin_finalization(lazy.init_tmp_checkpoint(1, {}), wait_fn=gate)
        assert gate.entered.wait(30)
        assert lazy.has_pending_finalization
        gate.open()
        lazy.finalize_pending()

    def test_next_waits_for_previous(self, lazy: CheckpointManager, root: Path) -> None:
        gate = Gate()
        lazy.begin_finalization(lazy.init_tmp_checkpoint(1, {}), wait_fn=gate)
        tmp2 = lazy.init_tmp_checkpoint(2, {})
        gate.open()
        lazy.begin_finalization(tmp2, wait_fn=None)  # joins step 1's thread first
        lazy.finalize_pending()
        assert steps_left(root) == [1, 2]

    def test_synchronous_api_alongside(self, lazy: CheckpointManager, root: Path) -> None:
        tmp = Path(lazy.init_tmp_checkpoint(1, {"loss": 0.1}))
        lazy.finalize_checkpoint(tmp)
        assert not tmp.exists() and steps_left(root) == [1]


class TestFinalizePending:
    """``finalize_pending`` waits, raises the thread's error once, and is safe to repeat."""

    def test_nothing_pending(self, lazy: CheckpointManager) -> None:
        lazy.finalize_pending()
        assert not lazy.has_pending_finalization

    def test_twice(self, lazy: CheckpointManager, root: Path) -> None:
        lazy.begin_finalization(lazy.init_tmp_checkpoint(1, {}), wait_fn=None)
        lazy.finalize_pending()
        lazy.finalize_pending()
        assert steps_left(root) == [1]

    def test_wait_fn_error_raised(self, lazy: CheckpointManager, root: Path) -> None:
        gate = Gate(error=ValueError("async write failed"))
        gate.open()
        lazy.begin_finalization(lazy.init_tmp_checkpoint(1, {}), wait_fn=gate)
        with pytest.raises(RuntimeError, match="Background checkpoint finalization failed") as info:
            lazy.finalize_pending()
        assert isinstance(info.value.__cause__, ValueError)
        assert steps_left(root) == []  # never renamed

    def test_error_raised_once_then_clean(self, lazy: CheckpointManager, root: Path) -> None:
        gate = Gate(error=ValueError("boom"))
        gate.open()
        lazy.begin_finalization(lazy.init_tmp_checkpoint(1, {}), wait_fn=gate)
        with pytest.raises(RuntimeError):
            lazy.finalize_pending()
        lazy.finalize_pending()  # the error was collected
        lazy.begin_finalization(lazy.init_tmp_checkpoint(2, {}), wait_fn=None)
        lazy.finalize_pending()
        assert steps_left(root) == [2]

    def test_next_begin_raises_previous_error(self, lazy: CheckpointManager) -> None:
        gate = Gate(error=ValueError("boom"))
        gate.open()
        lazy.begin_finalization(lazy.init_tmp_checkpoint(1, {}), wait_fn=gate)
        with pytest.raises(RuntimeError, match="Background checkpoint finalization failed"):
            lazy.begin_finalization(lazy.init_tmp_checkpoint(2, {}), wait_fn=None)


class TestPendingFlag:
    """``has_pending_finalization`` is true from ``begin_finalization`` until collected."""

    def test_false_at_first(self, lazy: CheckpointManager) -> None:
        assert not lazy.has_pending_finalization

    def test_true_while_waiting(self, lazy: CheckpointManager) -> None:
        gate = Gate()
        lazy.begin_finalization(lazy.init_tmp_checkpoint(1, {}), wait_fn=gate)
        assert lazy.has_pending_finalization
        gate.open()
        lazy.finalize_pending()

    def test_false_after_collected(self, lazy: CheckpointManager) -> None:
        lazy.begin_finalization(lazy.init_tmp_checkpoint(1, {}), wait_fn=None)
        lazy.finalize_pending()
        assert not lazy.has_pending_finalization

    def test_false_after_error(self, lazy: CheckpointManager) -> None:
        gate = Gate(error=ValueError("boom"))
        gate.open()
        lazy.begin_finalization(lazy.init_tmp_checkpoint(1, {}), wait_fn=gate)
        with pytest.raises(RuntimeError):
            lazy.finalize_pending()
        assert not lazy.has_pending_finalization


class TestShutdown:
    """``shutdown`` waits for the rename and the pruning queued after it; safe to repeat."""

    def test_waits_for_pruning(
        self, managers: Callable[..., CheckpointManager], root: Path
    ) -> None:
        manager = managers(metric_name=None, keep_top_k=1)
        for step in (1, 2, 3):
            manager.begin_finalization(manager.init_tmp_checkpoint(step, {}), wait_fn=None)
        manager.shutdown()
        assert steps_left(root) == [3]

    def test_top_k_in_background(
        self, managers: Callable[..., CheckpointManager], root: Path
    ) -> None:
        manager = managers(metric_name=None, keep_top_k=2)
        for step in range(1, 6):
            manager.begin_finalization(manager.init_tmp_checkpoint(step, {}), wait_fn=None)
        manager.shutdown()
        assert steps_left(root) == [4, 5]

    def test_collected_before_next_save(
        self, managers: Callable[..., CheckpointManager], root: Path
    ) -> None:
        manager = managers(metric_name=None, keep_top_k=1)
        for step in (1, 2):
            manager.begin_finalization(manager.init_tmp_checkpoint(step, {}), wait_fn=None)
            manager.finalize_pending()
        manager.shutdown()
        assert steps_left(root) == [2]

    def test_nothing_pending(self, lazy: CheckpointManager) -> None:
        lazy.shutdown()

    def test_twice(self, lazy: CheckpointManager, root: Path) -> None:
        lazy.begin_finalization(lazy.init_tmp_checkpoint(1, {}), wait_fn=None)
        lazy.shutdown()
        lazy.shutdown()
        assert steps_left(root) == [1]

    def test_usable_after(self, lazy: CheckpointManager, root: Path) -> None:
        lazy.begin_finalization(lazy.init_tmp_checkpoint(1, {}), wait_fn=None)
        lazy.shutdown()
        lazy.begin_finalization(lazy.init_tmp_checkpoint(2, {}), wait_fn=None)
        lazy.finalize_pending()
        assert steps_left(root) == [1, 2]


class TestPruneFailure:
    """A pruning that fails is a warning; the step it followed stays finalized."""

    def test_failed_future_warns(self) -> None:
        future: Future[None] = Future()
        future.set_exception(RuntimeError("rmtree boom"))
        with pytest.warns(UserWarning, match=r"prune old checkpoints.*rmtree boom"):
            CheckpointManager._warn_on_delete_failure(future)

    def test_successful_future_silent(self) -> None:
        future: Future[None] = Future()
        future.set_result(None)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            CheckpointManager._warn_on_delete_failure(future)

    def test_step_kept_when_pruning_fails(
        self, managers: Callable[..., CheckpointManager], root: Path
    ) -> None:
        manager = managers(metric_name=None, keep_top_k=1)
        corrupt = root / "step_0"
        corrupt.mkdir(parents=True)
        (corrupt / "training_info.json").write_text("{not json")  # the pruning cannot read it
        tmp = Path(manager.init_tmp_checkpoint(1, {}))
        with pytest.warns(UserWarning, match="prune old checkpoints"):
            manager.begin_finalization(tmp, wait_fn=None)
            manager.finalize_pending()
            manager.shutdown()
        assert not tmp.exists() and steps_left(root) == [0, 1]


class TestContextManager:
    """``with manager:`` flushes the pending finalization and never masks the block's error."""

    def test_flushes_on_exit(self, lazy: CheckpointManager, root: Path) -> None:
        with lazy as manager:
            assert manager is lazy
            gate = Gate()
            manager.begin_finalization(manager.init_tmp_checkpoint(1, {}), wait_fn=gate)
            assert manager.has_pending_finalization
            gate.open()
        assert not lazy.has_pending_finalization and steps_left(root) == [1]

    def test_flushes_when_block_raises(self, lazy: CheckpointManager, root: Path) -> None:
        with pytest.raises(ValueError, match="training blew up"), lazy:
            lazy.begin_finalization(lazy.init_tmp_checkpoint(1, {}), wait_fn=None)
            raise ValueError("training blew up")
        assert steps_left(root) == [1]

    def test_failure_while_raising_is_a_warning(self, lazy: CheckpointManager) -> None:
        gate = Gate(error=ValueError("async write failed"))
        gate.open()
        with (
            pytest.warns(UserWarning, match="finalization failed"),
            pytest.raises(ValueError, match="training blew up"),
            lazy,
        ):
            lazy.begin_finalization(lazy.init_tmp_checkpoint(1, {}), wait_fn=gate)
            raise ValueError("training blew up")

    def test_failure_on_clean_exit_raised(self, lazy: CheckpointManager) -> None:
        gate = Gate(error=ValueError("async write failed"))
        gate.open()
        with pytest.raises(RuntimeError, match="Background checkpoint finalization failed"):
            with lazy:
                lazy.begin_finalization(lazy.init_tmp_checkpoint(1, {}), wait_fn=gate)

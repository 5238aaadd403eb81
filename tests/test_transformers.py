"""transformers' ``Trainer`` on ckptd, in one process: a real daemon, real saves.

The tiny model and data are ``tests/_hf_worker.py``'s (a 1-layer GPT-2 from a config).
Each behaviour transformers' own checkpoint tests check of the Trainer (saving every
``save_steps``, what a checkpoint holds, resuming from one with equal weights and
state, ``resume_from_checkpoint=True``, rotation by ``save_total_limit`` keeping the
newest and the best, ``best_model_checkpoint``, ``load_best_model_at_end``) is checked
here with the daemon promoting and retiring, and without one (transformers' own
behaviour, one warning). See docs/transformers.md.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import DaemonProcess

# transformers' real Trainer, trained in this process (importing transformers and
# accelerate: about 7 s of CPU): the slow tier, with the Trainer's multi-process loops.
pytestmark = pytest.mark.slow

Start = Callable[..., DaemonProcess]
DAEMON_FILES = {".ckptd-layout.json", ".ckptd-trash", ".ckptd-retention", "latest", "best"}


@pytest.fixture(scope="module")
def hf() -> ModuleType:
    """``orchestrator.transformers``, imported once for the module (transformers is slow)."""
    import orchestrator.transformers

    return orchestrator.transformers


@pytest.fixture(scope="module")
def worker() -> ModuleType:
    """``tests._hf_worker``: the tiny model, data and arguments."""
    from tests import _hf_worker

    return _hf_worker


def at(step: int) -> Callable[[dict[str, Any]], bool]:
    """An event matcher for ``step``."""
    return lambda event: event.get("step") == step


def last_checkpoint(out: str) -> str | None:
    """Transformers' ``get_last_checkpoint``: what ``resume_from_checkpoint=True`` takes."""
    from transformers.trainer_utils import get_last_checkpoint

    found: Any = get_last_checkpoint
    result: str | None = found(out)
    return result


class Served:
    """A daemon serving ``out`` as ``root_toml`` says, with ``out``'s staging beside it."""

    def __init__(self, daemon: DaemonProcess, out: Path, staging: Path, client: Any) -> None:
        self.daemon = daemon
        self.out = out
        self.staging = staging
        self.client = client

    def promoted(self, *steps: int) -> None:
        for step in steps:
            self.daemon.wait_event("checkpoint.promoted", match=at(step))

    def checkpoints(self) -> list[str]:
        """What transformers lists: the ``checkpoint-N`` entries of ``output_dir``."""
        names = [n for n in os.listdir(self.out) if n.startswith("checkpoint-")]
        return sorted(names, key=lambda n: int(n.split("-")[1]))


@pytest.fixture
def serve(hf: ModuleType, tmp_path: Path, start: Start) -> Iterator[Callable[..., Served]]:
    """``serve(save_total_limit=2, metric=None, greater=False, toml=None)``: a served root."""
    from orchestrator import CheckpointClient

    clients: list[Any] = []

    def make(
        limit: int | None = 2,
        metric: str | None = None,
        greater: bool = False,
        toml: str | None = None,
    ) -> Served:
        out, staging = tmp_path / "out", tmp_path / f"out{hf.STAGING_SUFFIX}"
        out.mkdir()
        staging.mkdir()
        retention = hf.Retention(limit, metric, "max" if greater else "min")
        config = tmp_path / "ckptd.toml"
        config.write_text(toml if toml is not None else hf.root_toml(str(out), retention))
        daemon = start([], "--config", str(config), "--lease", "1")
        client = CheckpointClient(str(daemon.socket_path))
        clients.append(client)
        return Served(daemon, out, staging, client)

    yield make
    for client in clients:
        client.close(timeout=5)


def stopping_at(step: int, pid: int) -> type[Any]:
    """A Trainer that SIGSTOPs process ``pid`` while saving ``step`` (its begin answered)."""
    import transformers

    class Stopping(transformers.Trainer):
        def _save_rng_state(self, output_dir: str) -> None:
            if self.state.global_step == step:
                os.kill(pid, signal.SIGSTOP)
            super()._save_rng_state(output_dir)

    return Stopping


def trainer(
    hf: ModuleType,
    worker: ModuleType,
    out: Path,
    steps: int,
    *,
    base: type | None = None,
    client: Any = None,
    best_at: int | None = None,
    **overrides: Any,
) -> Any:
    """A switched Trainer over the tiny model.

    With ``best_at``, it is evaluated every step, and scores best at that step.
    """
    import transformers

    holder: dict[str, Any] = {}
    options: dict[str, Any] = {"eval_strategy": "no", "load_best_model_at_end": False}
    options.update(metric_for_best_model=None, greater_is_better=None)
    extra: dict[str, Any] = {}
    if best_at is not None:
        options = {"metric_for_best_model": "score", "greater_is_better": True}
        extra = {
            "eval_dataset": worker.tiny_data(2, seed=2),
            "compute_metrics": lambda _: {"score": -abs(holder["t"].state.global_step - best_at)},
        }
    options.update(overrides)
    args = worker.arguments(str(out), steps, **options)
    made = hf.with_ckptd(base or transformers.Trainer)(
        model=worker.tiny_model(),
        args=args,
        train_dataset=worker.tiny_data(32),
        ckptd_client=client,
        **extra,
    )
    holder["t"] = made
    return made


def weights(worker: ModuleType, checkpoint: Path) -> str:
    """The digest of the weights saved in ``checkpoint``."""
    import safetensors.torch

    model = worker.tiny_model()
    state = safetensors.torch.load_file(str(checkpoint / "model.safetensors"))
    model.load_state_dict(state, strict=False)
    digest: str = worker.digest(model)
    return digest


class TestSwitch:
    """One line switches any Trainer subclass; the policy is transformers' rotation."""

    def test_any_subclass(self, hf: ModuleType) -> None:
        import transformers

        class Mine(transformers.Trainer):
            pass

        switched = hf.with_ckptd(Mine)
        assert issubclass(switched, Mine) and issubclass(switched, hf.CkptdMixin)
        assert hf.with_ckptd(Mine) is switched and hf.with_ckptd(switched) is switched
        assert issubclass(hf.Trainer, transformers.Trainer)
        with pytest.raises(TypeError, match="not a subclass of transformers.Trainer"):
            hf.with_ckptd(object)

    @pytest.mark.parametrize(
        ("limit", "metric", "greater", "policy"),
        [
            (None, None, None, ""),
            (0, "loss", False, ""),
            (2, None, None, "keep_last=2"),
            (2, "loss", False, "keep_last=2 keep_best=1:eval_loss:min,unscored=worst"),
            (1, "eval_acc", True, "keep_last=1 keep_best=1:eval_acc:max,unscored=worst"),
        ],
    )
    def test_retention(
        self, hf: ModuleType, worker: ModuleType, limit: Any, metric: Any, greater: Any, policy: str
    ) -> None:
        args = worker.arguments(
            "/tmp/unused",
            1,
            eval_strategy="no",
            load_best_model_at_end=False,
            save_total_limit=limit,
            metric_for_best_model=metric,
            greater_is_better=greater,
        )
        assert hf.retention_of(args).policy() == policy

    def test_files_of_rank(self, hf: ModuleType, tmp_path: Path) -> None:
        names = [
            "model.safetensors",
            "trainer_state.json",
            "rng_state_0.pth",
            "rng_state_1.pth",
            "pytorch_model_fsdp_0/.metadata",
            "pytorch_model_fsdp_0/__0_0.distcp",
            "pytorch_model_fsdp_0/__1_0.distcp",
            ".ckptd-attempt",
        ]
        for name in names:
            (tmp_path / name).parent.mkdir(exist_ok=True)
            (tmp_path / name).write_bytes(b"x" * 3)

        def of(rank: int, saves: bool) -> list[str]:
            return [f.path for f in hf.files_of_rank(str(tmp_path), rank, saves=saves)]

        assert of(0, True) == [
            "model.safetensors",
            "pytorch_model_fsdp_0/.metadata",
            "pytorch_model_fsdp_0/__0_0.distcp",
            "rng_state_0.pth",
            "trainer_state.json",
        ]
        assert of(1, False) == ["pytorch_model_fsdp_0/__1_0.distcp", "rng_state_1.pth"]


class TestWithoutDaemon:
    """No daemon: transformers' own Trainer, saving and rotating in place, one warning."""

    def test_as_upstream(
        self,
        hf: ModuleType,
        worker: ModuleType,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        monkeypatch.setenv("CKPTD_SOCKET", str(tmp_path / "no.sock"))
        with caplog.at_level(logging.WARNING, logger="orchestrator.transformers"):
            made = trainer(hf, worker, tmp_path / "out", 3, save_total_limit=2)
        warned = [r for r in caplog.records if r.name == "orchestrator.transformers"]
        assert len(warned) == 1 and "no daemon at" in warned[0].getMessage()
        assert not made.uses_daemon
        made.train()
        assert sorted(os.listdir(tmp_path / "out")) == ["checkpoint-2", "checkpoint-3"]
        assert len([r for r in caplog.records if r.name == "orchestrator.transformers"]) == 1

    def test_a_daemon_not_serving_it(
        self,
        hf: ModuleType,
        worker: ModuleType,
        serve: Callable[..., Served],
        tmp_path: Path,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        served = serve()
        other = tmp_path / "elsewhere"
        with caplog.at_level(logging.WARNING, logger="orchestrator.transformers"):
            made = trainer(hf, worker, other, 1, client=served.client)
        assert not made.uses_daemon
        assert "root_not_configured" in caplog.text


class TestWithDaemon:
    """The daemon promotes, names and retires; transformers resumes only from promoted."""

    def test_saved_rotated_best_loaded_resumed(
        self,
        hf: ModuleType,
        worker: ModuleType,
        serve: Callable[..., Served],
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        served = serve(limit=2, metric="eval_score", greater=True)
        out = served.out
        with caplog.at_level(logging.WARNING, logger="orchestrator.transformers"):
            made = trainer(
                hf, worker, out, 4, client=served.client, best_at=1, load_best_model_at_end=True
            )
        assert made.uses_daemon  # and no warning: the daemon's policy is the trainer's
        assert not [r for r in caplog.records if r.name == "orchestrator.transformers"]
        made.train()
        served.promoted(1, 2, 3, 4)
        for step in (2,):
            served.daemon.wait_event("checkpoint.retired", match=at(step))
        # save_total_limit=2 keeps the newest two; the best (step 1) is kept besides.
        assert served.checkpoints() == ["checkpoint-1", "checkpoint-3", "checkpoint-4"]
        assert (
            set(os.listdir(out)) - {"checkpoint-1", "checkpoint-3", "checkpoint-4"} <= DAEMON_FILES
        )
        assert os.listdir(served.staging) == []
        last = out / "checkpoint-4"
        assert {p.name for p in last.iterdir() if not p.name.startswith(".ckptd")} == {
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "optimizer.pt",
            "rng_state.pth",
            "scheduler.pt",
            "trainer_state.json",
            "training_args.bin",
        }
        state = json.loads((last / "trainer_state.json").read_text())
        assert state["best_model_checkpoint"] == str(out / "checkpoint-1")
        assert made.state.best_model_checkpoint == str(out / "checkpoint-1")
        assert os.readlink(out / "best") == "checkpoint-1"
        # load_best_model_at_end: the weights are checkpoint-1's.
        assert worker.digest(made.model) == weights(worker, out / "checkpoint-1")
        assert last_checkpoint(str(out)) == str(last)
        saved_4 = weights(worker, last)  # before the resumed run's retention retires it

        # resume_from_checkpoint=True: the newest promoted checkpoint, its weights and state.
        seen: dict[str, Any] = {}
        import transformers

        class Probe(transformers.TrainerCallback):
            def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                seen.update(step=state.global_step, digest=worker.digest(kw["model"]))

        again = trainer(hf, worker, out, 6, client=served.client, best_at=1)
        again.add_callback(Probe())
        again.train(resume_from_checkpoint=True)
        assert seen == {"step": 4, "digest": saved_4}
        served.promoted(5, 6)
        served.daemon.wait_event("checkpoint.retired", match=lambda e: e["step"] == 4)
        assert served.checkpoints() == ["checkpoint-1", "checkpoint-5", "checkpoint-6"]

    def test_limit_one_keeps_the_newest_and_the_best(
        self, hf: ModuleType, worker: ModuleType, serve: Callable[..., Served]
    ) -> None:
        served = serve(limit=1, metric="eval_score", greater=True)
        made = trainer(
            hf, worker, served.out, 3, client=served.client, best_at=1, save_total_limit=1
        )
        made.train()
        served.promoted(1, 2, 3)
        served.daemon.wait_event("checkpoint.retired", match=lambda e: e["step"] == 2)
        # transformers alone would leave checkpoint-1 only: the newest is never deleted.
        assert served.checkpoints() == ["checkpoint-1", "checkpoint-3"]

    def test_loop_does_not_wait_for_the_rename(
        self, hf: ModuleType, worker: ModuleType, serve: Callable[..., Served]
    ) -> None:
        served = serve(limit=None)
        assert served.daemon.proc is not None
        pid = served.daemon.proc.pid
        Stalling = stopping_at(2, pid)  # begun and acknowledged: now stop it

        made = trainer(
            hf, worker, served.out, 2, client=served.client, base=Stalling, save_total_limit=None
        )
        try:
            made.train()  # returns with step 2 staged, not promoted
            assert last_checkpoint(str(served.out)) == str(served.out / "checkpoint-1")
            assert os.listdir(served.staging) == ["tmp_step_2"]
        finally:
            os.kill(pid, signal.SIGCONT)
        served.promoted(2)
        assert last_checkpoint(str(served.out)) == str(served.out / "checkpoint-2")
        assert os.listdir(served.staging) == []

    def test_the_best_model_with_the_daemon_gone(
        self,
        hf: ModuleType,
        worker: ModuleType,
        serve: Callable[..., Served],
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """load_best_model_at_end does not hang on a daemon that stopped answering."""
        served = serve(limit=None)
        assert served.daemon.proc is not None
        pid = served.daemon.proc.pid
        Stalling = stopping_at(2, pid)  # the best checkpoint, never promoted

        made = trainer(
            hf,
            worker,
            served.out,
            2,
            client=served.client,
            base=Stalling,
            best_at=2,
            save_total_limit=None,
            load_best_model_at_end=True,
        )
        try:
            with caplog.at_level(logging.WARNING, logger="orchestrator.transformers"):
                made.train()
        finally:
            os.kill(pid, signal.SIGCONT)
        assert "cannot learn whether checkpoint 2" in caplog.text
        served.promoted(2)

    def test_a_failed_save_is_never_promoted(
        self, hf: ModuleType, worker: ModuleType, serve: Callable[..., Served]
    ) -> None:
        served = serve(limit=None)
        import transformers

        class Failing(transformers.Trainer):
            def _save_rng_state(self, output_dir: str) -> None:
                if self.state.global_step == 2:
                    raise OSError(28, "No space left on device")
                super()._save_rng_state(output_dir)

        made = trainer(
            hf, worker, served.out, 2, client=served.client, base=Failing, save_total_limit=None
        )
        with pytest.raises(OSError, match="No space left"):
            made.train()
        failed = served.daemon.wait_event("checkpoint.failed", match=lambda e: e["step"] == 2)
        assert "No space left" in failed["reason"]
        assert served.checkpoints() == ["checkpoint-1"]
        assert last_checkpoint(str(served.out)) == str(served.out / "checkpoint-1")
        assert os.listdir(served.staging) == []  # set aside in the root's trash

    @pytest.mark.parametrize("torn", [False, True])
    def test_a_dcp_directory_is_verified_as_dcp(
        self, hf: ModuleType, worker: ModuleType, serve: Callable[..., Served], torn: bool
    ) -> None:
        """Accelerate's FSDP sharded state dict is verified as DCP.

        accelerate writes it with ``dcp.save`` into ``pytorch_model_fsdp_0/``; a shard
        shorter than its ``.metadata`` says is never promoted.
        """
        import transformers
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        served = serve(limit=None)

        class Sharded(transformers.Trainer):
            def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
                super()._save_optimizer_and_scheduler(output_dir)
                where = os.path.join(output_dir, "pytorch_model_fsdp_0")
                model: Any = self.model
                dcp_save({"model": model.state_dict()}, checkpoint_id=where, no_dist=True)
                if torn:  # the shard loses its tail after DCP wrote its metadata
                    (shard,) = Path(where).glob("*.distcp")
                    os.truncate(shard, shard.stat().st_size // 2)

        made = trainer(
            hf, worker, served.out, 1, client=served.client, base=Sharded, save_total_limit=None
        )
        made.train()
        if torn:
            failed = served.daemon.wait_event("checkpoint.failed", match=at(1))
            assert "pytorch_model_fsdp_0/__0_0.distcp" in failed["reason"], failed
            assert served.checkpoints() == []
            return
        served.promoted(1)
        manifest = json.loads((served.out / "checkpoint-1" / ".ckptd-manifest.json").read_text())
        assert {"pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__0_0.distcp"} <= set(
            manifest["files"]
        )

    def test_jit_checkpoint_on_sigterm(
        self, hf: ModuleType, worker: ModuleType, serve: Callable[..., Served]
    ) -> None:
        """``enable_jit_checkpoint``: SIGTERM saves the current step, staged, then promoted.

        No partial ``checkpoint-N`` (transformers' sentinel directory) appears in output_dir.
        """
        import threading

        import transformers

        served = serve(limit=None)
        seen: dict[str, Any] = {}

        class Watched(transformers.Trainer):
            def _save_rng_state(self, output_dir: str) -> None:
                step = self.state.global_step
                seen.update(step=step, in_output_dir=(served.out / f"checkpoint-{step}").exists())
                super()._save_rng_state(output_dir)

        class Terminate(transformers.TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                if state.global_step == 2:
                    os.kill(os.getpid(), signal.SIGTERM)  # the grace period's timer starts
                    for timer in threading.enumerate():
                        if isinstance(timer, threading.Timer):
                            timer.join(30)

        made = trainer(
            hf,
            worker,
            served.out,
            8,
            client=served.client,
            base=Watched,
            save_total_limit=None,
            save_steps=100,
            enable_jit_checkpoint=True,
        )
        made.add_callback(Terminate())
        made.train()
        assert made.state.global_step < 8  # the loop stopped after the JIT checkpoint
        step = seen["step"]
        assert step in (2, 3) and seen["in_output_dir"] is False
        served.promoted(step)
        assert served.checkpoints() == [f"checkpoint-{step}"]
        assert not (served.out / f"checkpoint-{step}" / "checkpoint-is-incomplete.txt").exists()

    def test_a_promoted_checkpoint_is_never_overwritten(
        self,
        hf: ModuleType,
        worker: ModuleType,
        serve: Callable[..., Served],
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """A promoted number saved again (a run resumed from an earlier one) is refused.

        The promoted checkpoint stands, and training goes on.
        """
        served = serve(limit=None)
        first = trainer(hf, worker, served.out, 2, client=served.client, save_total_limit=None)
        first.train()
        served.promoted(1, 2)
        before = weights(worker, served.out / "checkpoint-2")
        again = trainer(
            hf,
            worker,
            served.out,
            2,
            client=served.client,
            save_total_limit=None,
            learning_rate=1.0,
        )
        with caplog.at_level(logging.WARNING, logger="orchestrator.transformers"):
            again.train(resume_from_checkpoint=str(served.out / "checkpoint-1"))
        assert "refused checkpoint 2" in caplog.text and "already_promoted" in caplog.text
        assert weights(worker, served.out / "checkpoint-2") == before
        assert os.listdir(served.staging) == []

    def test_resume_true_without_a_checkpoint(
        self, hf: ModuleType, worker: ModuleType, serve: Callable[..., Served]
    ) -> None:
        served = serve(limit=None)
        made = trainer(hf, worker, served.out, 1, client=served.client, save_total_limit=None)
        with pytest.raises(ValueError, match="No valid checkpoint found"):
            made.train(resume_from_checkpoint=True)
        with pytest.raises(ValueError, match="Can't find a valid checkpoint at"):
            made.train(resume_from_checkpoint=str(served.out / "checkpoint-1-bogus"))

    @pytest.mark.parametrize(
        ("table", "message"),
        [
            ('final_prefix = "checkpoint-"', "stages the checkpoints of .* inside it"),
            ('staging = "{staging}"', "promotes the checkpoints of .* to step_N"),
        ],
    )
    def test_a_layout_transformers_cannot_use_is_refused(
        self,
        hf: ModuleType,
        worker: ModuleType,
        serve: Callable[..., Served],
        tmp_path: Path,
        table: str,
        message: str,
    ) -> None:
        out, staging = tmp_path / "out", tmp_path / f"out{hf.STAGING_SUFFIX}"
        body = f'[[roots]]\npath = "{out}"\n' + table.format(staging=staging) + "\n"
        served = serve(toml=body)
        with pytest.raises(ValueError, match=message) as raised:
            trainer(hf, worker, served.out, 1, client=served.client)
        assert 'final_prefix = "checkpoint-"' in str(raised.value)  # the table to use

    def test_another_policy_is_the_daemons_with_a_warning(
        self,
        hf: ModuleType,
        worker: ModuleType,
        serve: Callable[..., Served],
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        served = serve(limit=5)
        with caplog.at_level(logging.WARNING, logger="orchestrator.transformers"):
            made = trainer(hf, worker, served.out, 1, client=served.client, save_total_limit=2)
        assert made.uses_daemon
        assert "'keep_last=5', not the trainer's 'keep_last=2'" in caplog.text
        assert "keep_last = 2" in caplog.text

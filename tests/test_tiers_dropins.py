"""The drop-ins on a root with a fast tier: they resume from the step the daemons decided.

One node, a real daemon, real DCP saves in this process (a world of one): each drop-in
saves into the fast tier (the ``begin`` reply names it), the daemon drains the selected
steps to the durable root, and a restarted job (a new run) resumes from the newest step
in the fast tier, newer than the durable root's; once the fast tier is wiped, from the
durable step. Each restart is a new run (``torchelastic:...:N``): a run's decision is
made once.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DaemonProcess
from tests.test_tiers import at


def wipe(fast: Path) -> None:
    """Empty a fast tier, as a replaced node's or a rebooted tmpfs's.

    The daemon may be evicting an older step meanwhile (its local retention runs after
    each drain): what it removed first is gone either way.
    """

    def gone(_function: object, _path: str, error: Any) -> None:
        if not isinstance(error[1], FileNotFoundError):
            raise error[1]

    for entry in fast.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, onerror=gone)
        else:
            entry.unlink(missing_ok=True)
    assert not any(fast.glob("*[0-9]")), list(fast.iterdir())


def of_run(run: str) -> Callable[[dict[str, Any]], bool]:
    """An event matcher: of run ``torchelastic:...run``."""
    return lambda e: str(e["run"]).endswith(run)


def with_fast(table: str, fast: Path, **settings: Any) -> str:
    """A drop-in's ``[[roots]]`` table with a ``[roots.fast]`` table added."""
    lines = [table, "[roots.fast]", f'path = "{fast}"']
    lines += [f"{k} = {v}" for k, v in settings.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture
def world1() -> Iterator[None]:
    """A one-rank gloo group in this process."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import HashStore

    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # torchtitan's manager and real DCP saves, in this process
@pytest.mark.usefixtures("world1")
def test_torchtitan_resumes_from_the_fast_tier_then_the_durable_root(
    tmp_path: Path, short_dir: Path, start: Callable[..., DaemonProcess]
) -> None:
    """The torchtitan drop-in's ``load()`` takes the daemons' decision over its search."""
    import torch

    from orchestrator import CheckpointClient
    from orchestrator.torchtitan import CheckpointManager, root_toml
    from tests.test_torchtitan import Optim, Stateless

    folder, fast = tmp_path / "dump" / "checkpoint", tmp_path / "fast"
    folder.mkdir(parents=True)
    fast.mkdir()
    config = short_dir / "titan.toml"
    config.write_text(with_fast(root_toml(str(folder), 0), fast, drain_every_steps=2))
    daemon = start([], "--config", str(config))

    def manager(run: str) -> tuple[Any, torch.nn.Linear, Optim, CheckpointClient]:
        model, optim = torch.nn.Linear(2, 2), Optim()
        client = CheckpointClient(str(daemon.socket_path), run=run)
        built = CheckpointManager.Config(enable=True, interval=1, keep_latest_k=0).build(
            dataloader=Stateless(), model_parts=[model], optimizers=optim,
            lr_schedulers=Stateless(), states={}, sd_adapter=None,
            base_folder=str(tmp_path / "dump"), client=client,
        )  # fmt: skip
        return built, model, optim, client

    saver, model, optim, client = manager("torchelastic:t:0")
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.fill_(step)
        optim.value = float(step)
        saver.save(step)
        daemon.wait_event("tier.promoted", match=at(step))
    saver.close()
    client.close(timeout=5)
    daemon.wait_event("tier.drained", match=at(2), timeout=30)
    assert sorted(p.name for p in fast.glob("step-*")) == ["step-2", "step-3"]  # keep 2
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-2"]

    for run, want, where in (("torchelastic:t:1", 3, fast), ("torchelastic:t:2", 2, folder)):
        if where == folder:
            wipe(fast)
        loader, model, optim, client = manager(run)
        assert loader._find_load_step() == 2  # torchtitan's own search: the durable root
        assert loader.load() is True
        assert optim.value == float(want) and float(model.weight.detach()[0, 0]) == float(want)
        event = daemon.wait_event("tier.restore", match=of_run(run))
        assert (event["step"], event["source"]) == (want, "fast" if where == fast else "durable")
        loader.close()
        client.close(timeout=5)


@pytest.mark.slow  # transformers' Trainer trained and resumed three times, in this process
def test_transformers_resumes_from_the_fast_tier_then_the_durable_root(
    tmp_path: Path, short_dir: Path, start: Callable[..., DaemonProcess]
) -> None:
    """``resume_from_checkpoint=True`` and ``get_last_checkpoint`` take the daemons' decision.

    The fast tier's ``checkpoint-N`` (the root's ``final_prefix``) beside the durable
    root's staging directory, where drains are staged.
    """
    import transformers

    import orchestrator.transformers as hf
    from orchestrator import CheckpointClient
    from tests import _hf_worker as worker

    out, fast = tmp_path / "out", tmp_path / "fast"
    for made in (out, fast, tmp_path / f"out{hf.STAGING_SUFFIX}"):
        made.mkdir()
    config = short_dir / "hf.toml"
    table = hf.root_toml(str(out), hf.Retention(None, None))
    config.write_text(with_fast(table, fast, keep=3, drain_every_steps=2))
    daemon = start([], "--config", str(config))
    seen: list[int] = []

    class Probe(transformers.TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            seen.append(state.global_step)

    def run(name: str, steps: int, resume: bool) -> None:
        client = CheckpointClient(str(daemon.socket_path), run=name)
        args = worker.arguments(
            str(out), steps, eval_strategy="no", load_best_model_at_end=False,
            metric_for_best_model=None, greater_is_better=None, save_total_limit=None,
        )  # fmt: skip
        made = hf.Trainer(
            model=worker.tiny_model(), args=args, train_dataset=worker.tiny_data(32),
            ckptd_client=client, callbacks=[Probe()],
        )  # fmt: skip
        assert made.uses_daemon
        made.train(resume_from_checkpoint=True if resume else None)
        client.close(timeout=5)

    run("torchelastic:h:0", 3, False)
    for step in (1, 2, 3):
        daemon.wait_event("tier.promoted", match=at(step))
    daemon.wait_event("tier.drained", match=at(2), timeout=30)
    names = sorted(p.name for p in fast.glob("checkpoint-*"))
    assert names == [f"checkpoint-{s}" for s in (1, 2, 3)]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    # transformers' own search finds only the durable one.
    upstream: Any = transformers.trainer_utils.get_last_checkpoint  # untyped
    assert upstream(str(out)) == str(out / "checkpoint-2")
    with CheckpointClient(str(daemon.socket_path), run="torchelastic:h:1") as client:
        assert hf.get_last_checkpoint(str(out), client=client) == str(fast / "checkpoint-3")

    run("torchelastic:h:1", 5, True)  # the decision of run h:1: the fast tier's step 3
    daemon.wait_event("tier.promoted", match=at(5))
    daemon.wait_event("tier.drained", match=at(4), timeout=30)
    wipe(fast)  # step 5 was only there
    run("torchelastic:h:2", 5, True)  # nothing in the fast tier: the durable step 4
    assert seen == [0, 3, 4]
    sources = [daemon.wait_event("tier.restore", match=of_run(r)) for r in ("h:1", "h:2")]
    assert [(e["step"], e["source"]) for e in sources] == [(3, "fast"), (4, "durable")]


def test_nemo_rl_saves_into_the_fast_tier_and_resumes_from_the_daemons_decision(
    tmp_path: Path, short_dir: Path, start: Callable[..., DaemonProcess]
) -> None:
    """NeMo-RL's driver writes into ``FAST/tmp_step_N`` and resumes where the daemons say.

    The driver's ``training_info.json`` and ``config.yaml``, written before its worker's
    ``begin`` (here two ranks of a real client naming the driver's run, as
    ``AutomodelCheckpointManager`` does; the driver knows no world size), are kept,
    sealed into the node's part and drained with the step. A new run's
    ``get_latest_checkpoint_path`` is the fast tier's newest step; once the fast tier is
    wiped, the durable root's; a run resumed from an older step saves a step again.
    """
    import msgspec

    from orchestrator import CheckpointClient, FileEntry
    from orchestrator.nemo_rl import CheckpointManager, retention_toml
    from tests.test_nemo_rl import config_for

    root, fast = tmp_path / "results", tmp_path / "fast"
    root.mkdir()
    fast.mkdir()
    config = short_dir / "nemo.toml"
    config.write_text(with_fast(retention_toml(str(root), None), fast, drain_every_steps=2))
    daemon = start([], "--config", str(config))
    socket = str(daemon.socket_path)

    class RunConfig:
        def model_dump(self) -> dict[str, Any]:
            return {"grpo": {"max_num_steps": 3}}

    def driver(run: str) -> tuple[CheckpointManager, CheckpointClient]:
        client = CheckpointClient(socket)
        made = CheckpointManager(config_for(root), client=client, run=run)  # type: ignore[arg-type]
        assert made.uses_daemon
        return made, client

    manager, client = driver("nemo-rl-a")
    with CheckpointClient(socket, run=manager.run) as worker:
        for step in (1, 2, 3):
            path = manager.init_tmp_checkpoint(step, {"step": step}, RunConfig())
            assert str(path) == str(fast / f"tmp_step_{step}")
            for rank in (0, 1):  # the workers' begins, each one's shard, done
                handle = worker.save(str(root), step, rank, 2, local_world_size=2)
                assert handle.path == str(path)  # AutomodelCheckpointManager's check
                name = f"policy/weights/shard{rank}.bin"
                shard = Path(handle.path) / name
                shard.parent.mkdir(parents=True, exist_ok=True)
                shard.write_bytes(bytes([step]) * 64)
                handle.add_files([FileEntry(name, 64)])
                handle.seal()
            manager.finalize_checkpoint(path)  # the daemon's verdict: promoted locally
            assert (fast / f"step_{step}" / "training_info.json").is_file()
        # Another run's leftover is still removed at the first begin.
        stale, marker = fast / "tmp_step_9", ".ckptd-tier/run"  # protocol.TIER_RUN_FILE
        (stale / marker).parent.mkdir(parents=True)
        (stale / marker).write_text("nemo-rl-other")
        (stale / "training_info.json").write_text("{}")
        worker.save(str(root), 9, 0, 2, local_world_size=2).fail("not this test's step")
        assert not (stale / "training_info.json").exists()
    daemon.wait_event("tier.drained", match=at(2), timeout=30)
    part = msgspec.json.decode((fast / "step_3" / ".ckptd-tier" / "part.json").read_bytes())
    assert sorted(f["path"] for f in part["unreported"]) == ["config.yaml", "training_info.json"]
    durable = root / "step_2"
    assert json_of(durable / "training_info.json") == {"step": 2}
    assert (durable / "config.yaml").read_text() == (fast / "step_2" / "config.yaml").read_text()
    assert sorted(p.name for p in root.glob("step_*")) == ["step_2"]

    for run, want in (("nemo-rl-b", fast / "step_3"), ("nemo-rl-c", durable)):
        if want == durable:
            wipe(fast)
        client.close(timeout=5)
        manager, client = driver(run)
        found = manager.get_latest_checkpoint_path()
        assert found == str(want)
        assert manager.load_training_info(found) == {"step": int(want.name.split("_")[1])}
        event = daemon.wait_event("tier.restore", match=of_run(run))
        assert event["source"] == ("fast" if want.parent == fast else "durable")
    # Run c resumed from step 2 and saves step 3 again: the fast tier's is replaced.
    with CheckpointClient(socket, run=manager.run) as worker:
        path = manager.init_tmp_checkpoint(3, {"step": 33})
        for rank in (0, 1):
            handle = worker.save(str(root), 3, rank, 2, local_world_size=2)
            assert handle.path == str(path)
            (Path(handle.path) / f"shard{rank}.bin").write_bytes(b"c" * 8)
            handle.add_files([FileEntry(f"shard{rank}.bin", 8)])
            handle.seal()
        manager.finalize_checkpoint(path)
    client.close(timeout=5)
    assert json_of(fast / "step_3" / "training_info.json") == {"step": 33}


def json_of(path: Path) -> Any:
    """A JSON file's value."""
    import json

    return json.loads(path.read_text())

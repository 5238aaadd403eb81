"""Real multi-process ``dcp.async_save`` jobs (gloo, CPU) checkpointing through a real daemon."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from daemon.cli import main
from orchestrator.protocol import LAYOUT_FILE
from tests._dcp_worker import state_for
from tests._files import snapshot
from tests._ranks import free_port, pump_lines, start_rank
from tests.conftest import REPO, DaemonProcess, LineClient

pytestmark = pytest.mark.slow

WORKER = REPO / "tests" / "_dcp_worker.py"


class Job:
    """``world`` real rank processes running ``tests/_dcp_worker.py``."""

    def __init__(self, daemon: DaemonProcess, root: Path, world: int, *args: str) -> None:
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pumps: list[threading.Thread] = []
        for rank in range(world):
            cmd = [str(WORKER), "--root", str(root), *args]
            proc = start_rank(cmd, rank, world, port, daemon.socket_path)
            self.procs.append(proc)
            self.pumps.append(pump_lines(proc, rank, self.lines.put))

    def wait_line(self, event: str, timeout: float = 60.0, **match: Any) -> dict[str, Any]:
        """The next line from any rank with ``event`` and the given fields."""
        deadline = time.monotonic() + timeout
        for line in self.seen:
            if line["event"] == event and all(line.get(k) == v for k, v in match.items()):
                self.seen.remove(line)
                return line
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                raise AssertionError(f"no {event} {match} within {timeout}s: {self.seen}") from None
            if line["event"] == event and all(line.get(k) == v for k, v in match.items()):
                return line
            self.seen.append(line)

    def wait(self, timeout: float = 60.0) -> list[int]:
        """Exit codes of every rank."""
        return [p.wait(timeout) for p in self.procs]

    def kill(self) -> None:
        """Kill every rank still running."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for pump in self.pumps:
            pump.join(30)


@pytest.fixture
def jobs() -> Iterator[Callable[..., Job]]:
    started: list[Job] = []

    def make(daemon: DaemonProcess, root: Path, world: int, *args: str) -> Job:
        job = Job(daemon, root, world, *args)
        started.append(job)
        return job

    yield make
    for job in started:
        job.kill()


def _release(gate: Path) -> None:
    with open(gate, "wb") as fh:
        fh.write(b"x")


def _assert_loads(
    step_dir: Path, world: int, step: int, parts: tuple[str, ...] = ("",), numel: int = 4096
) -> None:
    """``dcp.load`` from the promoted directory gives back exactly what each rank saved."""
    for part in parts:
        for rank in range(world):
            expected = state_for(rank, step, numel, part)
            loaded = {k: torch.empty_like(v) for k, v in expected.items()}
            dcp_load(loaded, checkpoint_id=str(step_dir / part), no_dist=True)
            for key, value in expected.items():
                assert torch.equal(loaded[key], value), key


def _state(daemon: DaemonProcess, root: Path, step: int) -> str | None:
    client = LineClient(daemon.socket_path)
    try:
        reply = client.request("status", root=str(root))
    finally:
        client.close()
    states = [s["state"] for s in reply["saves"] if s["step"] == step]
    return states[0] if states else None


class TestPromotionWaitsForEveryRank:
    """A step is promoted only after every rank's upload landed, and then loads intact."""

    @pytest.mark.parametrize("hold_at", ["write", "finish", "extra"])
    def test_held_upload_blocks_promotion(
        self,
        daemon_factory: Callable[..., DaemonProcess],
        jobs: Callable[..., Job],
        root: Path,
        short_dir: Path,
        hold_at: str,
    ) -> None:
        # Each rank saves "model" then "optim" as two async_saves of one step: the shape
        # of NeMo-RL's bug. The model uploads land; the optimizer upload is held, either
        # before rank 1 writes its shards ("write") or before the coordinator writes the
        # optimizer's .metadata ("finish"), or rank 1's plain per-rank file is held
        # after both DCP uploads landed ("extra"). Renaming now would lose data.
        held = 0 if hold_at == "finish" else 1
        gate = short_dir / "gate"
        os.mkfifo(gate)
        daemon = daemon_factory([root])
        job = jobs(
            daemon,
            root,
            2,
            "--parts",
            "model,optim",
            "--hold-rank",
            str(held),
            "--hold-at",
            hold_at,
            "--gate",
            str(gate),
            "--extra",
        )
        job.wait_line("held", rank=held)
        for rank in (0, 1):
            # Training went on, and each rank's model upload has fully landed.
            job.wait_line("save_returned", rank=rank, part="optim")
            assert job.wait_line("upload_done", rank=rank, part="model")["ok"]
        assert (root / "tmp_step_1" / "model" / ".metadata").is_file()
        if hold_at == "extra":
            # Both DCP uploads landed; rank 0 is done; rank 1 still writes its own file.
            for rank in (0, 1):
                assert job.wait_line("upload_done", rank=rank, part="optim")["ok"]
            daemon.wait_event("save.rank_done", match=lambda e: e["rank"] == 0)
        else:
            assert not (root / "tmp_step_1" / "optim" / ".metadata").exists()
        assert _state(daemon, root, 1) == "open"
        assert not (root / "step_1").exists()
        _release(gate)
        promoted = daemon.wait_event("checkpoint.promoted", timeout=60)
        assert promoted["step"] == 1
        assert promoted["path"] == str(root / "step_1")
        assert job.wait() == [0, 0]
        # Both ranks' done (sent only after their optim upload) preceded the promotion.
        events = [e["event"] for e in daemon.drain()]
        assert events.count("save.rank_done") == 2
        last_done = max(i for i, name in enumerate(events) if name == "save.rank_done")
        assert events.index("checkpoint.promoting") > last_done
        assert not (root / "tmp_step_1").exists()
        for part in ("model", "optim"):
            assert (root / "step_1" / part / ".metadata").is_file()
            assert sorted(p.name for p in (root / "step_1" / part).glob("*.distcp")) == [
                "__0_0.distcp",
                "__1_0.distcp",
            ]
        assert os.readlink(root / "latest") == "step_1"
        _assert_loads(root / "step_1", 2, 1, ("model", "optim"))
        assert (root / "step_1" / "extra" / "rank1.bin").stat().st_size == 256 * 64

    def test_several_steps_with_async_stager(
        self,
        daemon_factory: Callable[..., DaemonProcess],
        jobs: Callable[..., Job],
        root: Path,
        capsys: pytest.CaptureFixture[str],
    ) -> None:
        daemon = daemon_factory([root])
        job = jobs(daemon, root, 2, "--steps", "1,2,3", "--stager")
        assert job.wait(120) == [0, 0]
        promoted = sorted(daemon.wait_event("checkpoint.promoted")["step"] for _ in range(3))
        assert promoted == [1, 2, 3]
        for step in (1, 2, 3):
            _assert_loads(root / f"step_{step}", 2, step)
        assert os.readlink(root / "latest") == "step_3"
        capsys.readouterr()
        assert main(["verify", str(root / "step_3")]) == 0
        said = capsys.readouterr().out  # what was checked, and that contents were not
        assert "  checked: DCP metadata: 1 directories, each with metadata naming shards" in said
        assert "  not checked: contents: " in said


class TestBeginBeforeWrites:
    """``orchestrator.async_save`` returns without the daemon; its writes wait for it."""

    def test_no_write_before_the_daemon_answers(
        self,
        daemon_factory: Callable[..., DaemonProcess],
        root: Path,
        jobs: Callable[..., Job],
        short_dir: Path,
    ) -> None:
        daemon = daemon_factory([root])
        assert daemon.proc is not None
        gate = short_dir / "gate"
        os.mkfifo(gate)
        job = jobs(daemon, root, 2, "--plain", "--steps", "1,2", "--gate", str(gate))
        daemon.wait_event("checkpoint.promoted", timeout=120, match=lambda e: e["step"] == 1)
        for rank in range(2):
            job.wait_line("held", rank=rank, at="step2")
        # The client knows where step 2 goes (learned from step 1), so nothing waits for
        # the daemon before DCP starts; the daemon now answers nothing.
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            _release(gate)
            # The training thread does not wait for the daemon (a wait would last the
            # client's begin_timeout, 10 s, with the daemon stopped).
            for rank in range(2):
                job.wait_line("save_returned", timeout=5.0, rank=rank, step=2)
            # DCP's upload thread sets its writer up within milliseconds unless it waits
            # for the begin's acknowledgement.
            with pytest.raises(AssertionError, match="no writer_setup"):
                job.wait_line("writer_setup", timeout=3.0, step=2)
            # The directory exists (the save call returned), and nothing is in it.
            assert list((root / "tmp_step_2").iterdir()) == []
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        for rank in range(2):
            job.wait_line("writer_setup", rank=rank, step=2)
        assert job.wait() == [0, 0]
        promoted = daemon.wait_event("checkpoint.promoted", match=lambda e: e["step"] == 2)
        _assert_loads(Path(promoted["path"]), 2, 2)


class TestRankDeath:
    """A rank killed mid-save: never promoted, the event says why, the next step promotes."""

    def test_sigkill_mid_upload(
        self,
        daemon_factory: Callable[..., DaemonProcess],
        jobs: Callable[..., Job],
        root: Path,
        short_dir: Path,
    ) -> None:
        gate = short_dir / "gate"
        os.mkfifo(gate)
        daemon = daemon_factory([root], "--lease", "1")
        job = jobs(daemon, root, 2, "--hold-rank", "1", "--hold-at", "write", "--gate", str(gate))
        job.wait_line("held", rank=1)
        job.procs[1].send_signal(signal.SIGKILL)
        job.procs[1].wait(30)
        failed = daemon.wait_event("checkpoint.failed", timeout=60)
        assert failed["step"] == 1
        # Either the lease of the dead rank expired or the survivor's upload failed
        # because its peer vanished; both are reasons, never a promotion.
        assert "lease" in failed["reason"] or "rank 0 failed" in failed["reason"]
        job.wait(60)
        assert not (root / "step_1").exists()
        assert list((root / ".ckptd-trash").glob("tmp_step_1.attempt-*"))  # kept, set aside
        assert not (root / "latest").exists()

        job2 = jobs(daemon, root, 2, "--steps", "2")
        assert job2.wait(120) == [0, 0]
        daemon.wait_event("checkpoint.promoted", match=lambda e: e["step"] == 2)
        assert os.readlink(root / "latest") == "step_2"
        _assert_loads(root / "step_2", 2, 2)
        assert not (root / "step_1").exists()


class TestRefusedBeginWritesNothing:
    """A begin the daemon refuses fails the DCP save on every rank before any write."""

    @pytest.mark.parametrize("mode", ["plain", "handle", "track"])
    def test_step_already_promoted(
        self,
        daemon_factory: Callable[..., DaemonProcess],
        jobs: Callable[..., Job],
        root: Path,
        short_dir: Path,
        mode: str,
    ) -> None:
        # Step 1 is saved and promoted; then the job saves step 1 again (a job resumed
        # from an older checkpoint, say): every rank's begin is refused.
        gate = short_dir / "gate"
        os.mkfifo(gate)
        daemon = daemon_factory([root])
        job = jobs(
            daemon, root, 2, "--mode", mode, "--steps", "1,1", "--wait-promoted",
            "--gate", str(gate),
        )  # fmt: skip
        for rank in range(2):
            first = job.wait_line("save_returned", rank=rank, step=1)
            assert first["exists"], first  # the directory exists when the save returns
        assert job.wait_line("settled", step=1)["state"] == "promoted"
        for rank in range(2):
            job.wait_line("held", rank=rank, at="save1")
        before = snapshot(root / "step_1")
        assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(before)
        _release(gate)
        for rank in range(2):
            outcome = job.wait_line("upload_done", rank=rank, save=1)
            assert not outcome["ok"]  # the save failed on this rank...
            assert "SaveRefused" in outcome["error"] and "already_promoted" in outcome["error"]
            if mode != "plain":
                assert outcome["refusal"] == "already_promoted"  # ...and its handle says why
        assert job.wait() == [0, 0]
        # Nothing of the refused save was written, in the checkpoint or beside it.
        assert snapshot(root / "step_1") == before
        assert not [p for p in root.glob("tmp_step_1/**/*") if p.is_file()]
        _assert_loads(root / "step_1", 2, 1)
        assert main(["verify", str(root / "step_1")]) == 0
        events = daemon.drain()
        assert not [e for e in events if e["event"] == "checkpoint.failed"]
        assert [e["step"] for e in events if e["event"] == "save.rank_done"] == [1, 1]

    def test_other_saves_shards_are_not_truncated(
        self,
        daemon_factory: Callable[..., DaemonProcess],
        jobs: Callable[..., Job],
        root: Path,
    ) -> None:
        # Another run of the job (3 ranks) is writing step 2; this one (2 ranks) must not
        # touch its files: the daemon refuses its begins with world_size_mismatch.
        daemon = daemon_factory([root])
        shard = root / "tmp_step_2" / "__0_0.distcp"
        with LineClient(daemon.socket_path) as other:
            reply = other.request("begin", root=str(root), step=2, rank=0, world_size=3)
            assert reply["ok"], reply
            shard.parent.mkdir(exist_ok=True)
            shard.write_bytes(b"another run's shard" * 1000)
            before = snapshot(shard.parent)
            job = jobs(daemon, root, 2, "--mode", "handle", "--steps", "2")
            for rank in range(2):
                outcome = job.wait_line("upload_done", rank=rank, save=0)
                assert not outcome["ok"] and outcome["refusal"] == "world_size_mismatch"
            assert job.wait() == [0, 0]
            assert snapshot(shard.parent) == before
            status = other.request("status", root=str(root))
        (save,) = [s for s in status["saves"] if s["step"] == 2]
        assert save["state"] == "open" and save["world_size"] == 3  # the other run's, intact


class TestPathOnReturn:
    """The step's directory exists when ``orchestrator.async_save`` returns."""

    def test_daemon_up(
        self, daemon_factory: Callable[..., DaemonProcess], jobs: Callable[..., Job], root: Path
    ) -> None:
        daemon = daemon_factory([root])
        steps = ",".join(str(s) for s in range(1, 21))
        job = jobs(daemon, root, 2, "--plain", "--steps", steps, "--numel", "256")
        assert job.wait(180) == [0, 0]
        returned = [
            job.wait_line("save_returned", rank=r, step=s) for r in (0, 1) for s in range(1, 21)
        ]
        assert [line["exists"] for line in returned] == [True] * 40

    def test_daemon_down_with_a_layout_file(
        self, jobs: Callable[..., Job], root: Path, short_dir: Path
    ) -> None:
        info = {
            "path": str(root),
            "tmp_prefix": "incoming-",
            "final_prefix": "step_",
            "pointer": "latest",
        }
        (root / LAYOUT_FILE).write_text(json.dumps(info))
        nobody = DaemonProcess(short_dir / "nobody.sock", [root])  # never started
        steps = ",".join(str(s) for s in range(1, 21))
        job = jobs(nobody, root, 2, "--plain", "--steps", steps, "--numel", "256")
        assert job.wait(180) == [0, 0]
        returned = [
            job.wait_line("save_returned", rank=r, step=s) for r in (0, 1) for s in range(1, 21)
        ]
        assert [line["exists"] for line in returned] == [True] * 40
        assert {line["path"] for line in returned} == {
            str(root / f"incoming-{s}") for s in range(1, 21)
        }
        assert not list(root.glob("tmp_step_*"))
        _assert_loads(root / "incoming-20", 2, 20, numel=256)

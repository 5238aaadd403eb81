"""Every save form of torch's DCP, gated and verified: a real 2-rank job through a real daemon.

One job (``tests/_forms_worker.py``) saves a step in each form, each gated the way the
README says, and each form again with one file damaged or removed after it landed and
before the ranks reported it. The tests read how each step ended: the intact ones are
promoted, with every file each rank wrote listed in the manifest, and load back exactly;
the damaged ones are not promoted, and the reason names the file.
"""

from __future__ import annotations

import json
import queue
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from daemon.cli import main
from tests._forms_worker import DAMAGED, FORMS, UNKNOWN_STEP
from tests._ranks import free_port, pump_lines, start_rank
from tests.conftest import REPO, DaemonProcess

pytestmark = pytest.mark.slow

WORKER = REPO / "tests" / "_forms_worker.py"
DEADLINE = 240.0


@dataclass
class Job:
    """What the job left: its root, and each step's outcome and loads, by step."""

    root: Path
    settled: dict[int, dict[str, Any]] = field(default_factory=dict)
    loaded: dict[int, list[bool]] = field(default_factory=dict)
    damaged: list[dict[str, Any]] = field(default_factory=list)

    def promoted(self, form: str) -> Path:
        """The promoted directory of ``form``'s intact step, checked loaded on both ranks."""
        step = FORMS.index(form) + 1
        assert self.settled[step]["state"] == "promoted", self.settled[step]
        assert self.loaded[step] == [True, True]
        return self.root / f"step_{step}"

    def refused(self, form: str) -> str:
        """The reason ``form``'s damaged step failed; it was never promoted."""
        step = DAMAGED[form][0]
        assert self.settled[step]["state"] == "failed", self.settled[step]
        assert not (self.root / f"step_{step}").exists()
        reason: str = self.settled[step]["reason"]
        return reason


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    """Run the job once for the module; every test reads what it left."""
    root = tmp_path_factory.mktemp("forms") / "run"
    root.mkdir()
    short = Path(tempfile.mkdtemp(prefix="ck-", dir="/tmp"))
    daemon = DaemonProcess(short / "d.sock", [root])
    lines: queue.Queue[dict[str, Any]] = queue.Queue()
    procs = []
    try:
        daemon.start()
        port = free_port()
        for rank in range(2):
            proc = start_rank([str(WORKER), "--root", str(root)], rank, 2, port, daemon.socket_path)
            procs.append(proc)
            pump_lines(proc, rank, lines.put)
        result, finished = Job(root), 0
        seen: list[dict[str, Any]] = []
        deadline = time.monotonic() + DEADLINE
        while finished < 2:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                raise AssertionError(f"the job did not finish in {DEADLINE}s: {seen}") from None
            seen.append(line)
            if line["event"] == "settled":
                result.settled[line["step"]] = line
            elif line["event"] == "loaded":
                result.loaded.setdefault(line["step"], []).append(line["ok"])
            elif line["event"] == "damaged":
                result.damaged.append(line)
            finished += line["event"] == "finished"
        assert [p.wait(30) for p in procs] == [0, 0], seen
        yield result
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        daemon.kill()
        if daemon.proc is not None and daemon.proc.stdout is not None:
            daemon.proc.stdout.close()
        shutil.rmtree(short, ignore_errors=True)


def _manifest(step_dir: Path) -> dict[str, Any]:
    manifest: dict[str, Any] = json.loads((step_dir / ".ckptd-manifest.json").read_text())
    return manifest


class TestPerRankMetadata:
    """``use_collectives=False``: each rank's shards are checked against its ``__R.metadata``."""

    def test_promoted_and_loaded(self, job: Job) -> None:
        step_dir = job.promoted("per_rank")
        assert not (step_dir / ".metadata").exists()
        ranks = _manifest(step_dir)["ranks"]
        assert ranks == {
            "0": ["__0.metadata", "__0_0.distcp"],
            "1": ["__1.metadata", "__1_0.distcp"],
        }
        assert main(["verify", str(step_dir)]) == 0

    def test_a_ranks_missing_metadata_is_refused(self, job: Job) -> None:
        # Rank 1's shard is there, its own metadata is not: nothing vouches for it.
        assert "__1_0.distcp: no __1.metadata" in job.refused("per_rank")


class TestProcessWriter:
    """The README's gate works with DCP's upload process and a stager's response."""

    def test_promoted_and_loaded(self, job: Job) -> None:
        step_dir = job.promoted("process")
        ranks = _manifest(step_dir)["ranks"]
        assert ranks == {"0": [".metadata", "__0_0.distcp"], "1": ["__1_0.distcp"]}

    def test_a_truncated_shard_is_refused(self, job: Job) -> None:
        assert "__0_0.distcp: " in job.refused("process")


class TestHuggingFace:
    """``HuggingFaceStorageWriter``: every rank's safetensors reported, headers checked."""

    def test_consolidated_promoted_and_loaded(self, job: Job) -> None:
        step_dir = job.promoted("hf_consolidated")
        ranks = _manifest(step_dir)["ranks"]
        assert ranks == {
            "0": [
                "model-00001-of-00001.safetensors",
                "model.safetensors.index.json",
                "sharded/shard-00001-model-00001-of-00001.safetensors",
            ],
            "1": ["sharded/shard-00002-model-00001-of-00001.safetensors"],
        }
        assert main(["verify", str(step_dir)]) == 0

    def test_sharded_promoted_and_loaded(self, job: Job) -> None:
        ranks = _manifest(job.promoted("hf_sharded"))["ranks"]
        assert ranks == {
            "0": ["shard-00001-model-00001-of-00001.safetensors"],
            "1": ["shard-00002-model-00001-of-00001.safetensors"],
        }

    def test_a_missing_consolidated_file_is_refused(self, job: Job) -> None:
        reason = job.refused("hf_consolidated")
        assert "model-00001-of-00001.safetensors: reported by rank 0 but missing" in reason
        assert "model.safetensors.index.json: weight_map names" in reason

    def test_a_truncated_shard_is_refused(self, job: Job) -> None:
        # Rank 1 reported it at its truncated size: only its header says the data is short.
        reason = job.refused("hf_sharded")
        assert "shard-00002-model-00001-of-00001.safetensors: tensor " in reason
        assert "is past the data" in reason


class TestSynchronousSave:
    """A synchronous ``dcp.save`` is gated and reported like the async forms."""

    def test_orchestrator_save_promoted_and_loaded(self, job: Job) -> None:
        ranks = _manifest(job.promoted("sync"))["ranks"]
        assert ranks == {"0": [".metadata", "__0_0.distcp"], "1": ["__1_0.distcp"]}

    def test_raw_dcp_save_tracked_promoted_and_loaded(self, job: Job) -> None:
        ranks = _manifest(job.promoted("sync_raw"))["ranks"]
        assert ranks == {"0": [".metadata", "__0_0.distcp"], "1": ["__1_0.distcp"]}

    def test_a_truncated_shard_is_refused(self, job: Job) -> None:
        assert "__1_0.distcp: " in job.refused("sync")


class TestUnknownForm:
    """A step with nothing any rank reported or any metadata covers is never promoted."""

    def test_refused_naming_the_form(self, job: Job) -> None:
        settled = job.settled[UNKNOWN_STEP]
        assert settled["state"] == "failed"
        assert "unknown save form" in settled["reason"]
        assert "model.pt" in settled["reason"]
        assert not (job.root / f"step_{UNKNOWN_STEP}").exists()

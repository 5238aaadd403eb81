"""Real training processes across two simulated nodes checkpointing through their daemons.

Each node (``tests/_nodes.py``) is a mount namespace with the shared root on a 1 s
caching bindfs mount and its own ``ckptd serve --node nI``. The ranks run inside their
node, talk gloo to each other over loopback and the client to their own node's daemon,
with ``LOCAL_WORLD_SIZE`` set as torchrun sets it: a real ``dcp.async_save`` job
tracked by the client, loaded back with ``dcp.load``, and the demo's training loop
(``examples/train.py`` under one ``torchrun`` per node).
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from tests._dcp_worker import state_for
from tests._nodes import Cluster, SimNode, make_cluster
from tests._ranks import TORCHRUN, free_port, pump_lines
from tests.conftest import REPO
from tests.test_demo import JOB_TIMEOUT, TRACEBACK

__all__ = ["make_cluster"]  # the fixture, imported for pytest

pytestmark = pytest.mark.slow

MakeCluster = Callable[..., Cluster]
WORKER = REPO / "tests" / "_dcp_worker.py"
TRAIN = REPO / "examples" / "train.py"


def settled(nodes: Cluster, step: int, timeout: float = 60.0) -> None:
    """Every node's daemon answers ``promoted`` for the step and printed the event."""
    for node in nodes:
        answer = node.wait(nodes.root, step, timeout)
        assert answer["state"] == "promoted", (node.name, answer)
        assert answer["path"] == str(nodes.root / f"step_{step}"), answer
        assert node.daemon is not None
        node.daemon.wait_event(
            "checkpoint.promoted", timeout, match=lambda e: e.get("step") == step
        )


class Ranks:
    """The rank processes of one job, each inside its node, their JSON lines in one queue."""

    def __init__(self) -> None:
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, node: SimNode, rank: int, cmd: list[str], env: dict[str, str]) -> None:
        """Start one rank inside ``node``."""
        proc = node.popen(
            cmd,
            env={"CKPTD_SOCKET": str(node.socket), "OMP_NUM_THREADS": "1", **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        pump_lines(proc, rank, self.lines.put)

    def finish(self, timeout: float) -> list[dict[str, Any]]:
        """Wait for every rank to exit 0; every line they printed."""
        deadline = time.monotonic() + timeout
        codes = [p.wait(max(deadline - time.monotonic(), 1.0)) for p in self.procs]
        lines = []
        while not self.lines.empty():
            lines.append(self.lines.get_nowait())
        assert codes == [0] * len(codes), (codes, lines)
        return lines


class TestDcpAcrossNodes:
    """A real async DCP save spanning two nodes is promoted once and loads intact."""

    @pytest.mark.parametrize("per_node", [1, 2])
    def test_tracked_async_save(self, make_cluster: MakeCluster, per_node: int) -> None:
        nodes = make_cluster(2)
        nodes.start_daemons(settings={"node_timeout": 120.0})
        world, port = 2 * per_node, free_port()
        ranks = Ranks()
        for i, node in enumerate(nodes):
            for local in range(per_node):
                rank = i * per_node + local
                env = {
                    "RANK": str(rank),
                    "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(local),
                    "LOCAL_WORLD_SIZE": str(per_node),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                }
                cmd = [sys.executable, str(WORKER), "--root", str(nodes.root)]
                ranks.start(node, rank, [*cmd, "--mode", "track", "--steps", "1,2"], env)
        lines = ranks.finish(240.0)
        uploads = [ln for ln in lines if ln.get("event") == "upload_done"]
        assert len(uploads) == 2 * world and all(ln["ok"] for ln in uploads), lines
        for step in (1, 2):
            settled(nodes, step)
        step_dir = nodes.backing_root / "step_2"
        assert os.readlink(nodes.backing_root / "latest") == "step_2"
        assert (step_dir / ".metadata").is_file()
        assert sorted(p.name for p in step_dir.glob("*.distcp")) == [
            f"__{r}_0.distcp" for r in range(world)
        ]
        for rank in range(world):
            expected = state_for(rank, 2, 4096)
            loaded = {k: torch.empty_like(v) for k, v in expected.items()}
            dcp_load(loaded, checkpoint_id=str(step_dir), no_dist=True)
            for key, value in expected.items():
                assert torch.equal(loaded[key], value), key


class TestDemoAcrossNodes:
    """The demo's training loop, one torchrun per node, checkpoints and resumes across nodes."""

    def train(self, nodes: Cluster, steps: int, every: int) -> list[str]:
        port = free_port()
        procs = []
        for i, node in enumerate(nodes):
            cmd = [sys.executable, *TORCHRUN, "--nnodes", str(len(nodes)), "--node-rank", str(i)]
            cmd += ["--nproc-per-node", "1", "--master-addr", "127.0.0.1"]
            cmd += ["--master-port", str(port), str(TRAIN), str(nodes.root)]
            cmd += ["--steps", str(steps), "--every", str(every)]
            env = {"CKPTD_SOCKET": str(node.socket), "OMP_NUM_THREADS": "1"}
            procs.append(node.popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outputs = []
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=JOB_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
                pytest.fail(f"a node's torchrun did not finish:\n{out.decode(errors='replace')}")
            text = out.decode(errors="replace")
            assert TRACEBACK not in text, text
            assert proc.returncode == 0, text
            outputs.append(text)
        return outputs

    def test_train_and_resume(self, make_cluster: MakeCluster) -> None:
        nodes = make_cluster(2)
        nodes.start_daemons(settings={"node_timeout": 120.0})
        first = self.train(nodes, steps=10, every=5)
        assert f"step 10: promoted {nodes.root / 'step_10'}" in first[0], first[0]
        for step in (5, 10):
            settled(nodes, step)
        back: Path = nodes.backing_root
        for part in ("model", "optim"):
            assert (back / "step_10" / part / ".metadata").is_file()
        second = self.train(nodes, steps=5, every=5)
        assert f"resumed from {nodes.root / 'step_10'}" in second[0], second[0]
        settled(nodes, 15)
        assert os.readlink(back / "latest") == "step_15"

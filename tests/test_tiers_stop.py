"""SIGTERM across nodes: every node drains the same step, so a durable step commits.

The rule (which step) is checked alone; then on two simulated nodes (``tests/_nodes.py``:
a caching bindfs mount of the durable root each, and a private fast tier at one path)
whose newest local steps differ, a stop of both daemons commits the newest step both
hold.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from tests._nodes import cluster
from tests.test_tiers import at, save, with_fast_tiers


def test_the_step_a_stop_drains() -> None:
    """The newest step every answering node holds; what the choice lacked, said."""
    from daemon.server._stopdrain import StopFacts, choose

    def node(name: str, ranks: list[int], held: list[int]) -> StopFacts:
        return StopFacts(node=name, nonce=name, ranks=ranks, held=held)

    a, b = node("a", [0, 1], [3, 4, 5]), node("b", [2, 3], [2, 3, 4])
    assert choose([a, b], 4) == (4, "")
    assert choose([a], 4) == (5, "the nodes of 2 of 4 ranks answered")
    assert choose([a, node("b", [2, 3], [1, 2])], 4) == (
        None,
        "no local step is held on every answering node",
    )
    assert choose([], 4) == (None, "no node answered")


@pytest.mark.slow
def test_a_stop_of_every_node_commits_the_newest_step_all_hold() -> None:
    """Node 0's newest local step is 3, node 1's is 2: both drain step 2, which commits.

    Each node drained its own newest before: two different steps, and neither committed.
    An older stop's fact left in the coordination directory is not counted.
    """
    with cluster(2) as nodes:
        _, private = with_fast_tiers(nodes, keep=3, node_timeout=10, stop_grace=40)
        daemons = [node.daemon for node in nodes]
        # An older stop's fact of the run, which would cover rank 1 holding only step 1.
        stop_dir = nodes.backing_root / ".ckptd-tiers" / "stop" / "torchelastic:job:0"
        stop_dir.mkdir(parents=True)
        stale = {"node": "n9", "nonce": "old", "ranks": [1], "held": [1], "at": 1.0}
        (stop_dir / "n9.json").write_text(json.dumps(stale))
        for step in (1, 2, 3):
            for rank, node in enumerate(nodes):
                with node.connect() as client:
                    save(
                        client, nodes.root, step, {f"m/r{rank}.bin": os.urandom(20_000)},
                        rank=rank, world=2, local=1,
                        write=lambda path, own=private[rank]: own / Path(path).name,  # type: ignore[misc]
                    )  # fmt: skip
            for daemon in daemons:
                assert daemon is not None
                daemon.wait_event("tier.promoted", match=at(step))
        # Step 3 is lost on node 1 (its newest is now 2); nothing was drained yet.
        shutil.rmtree(private[1] / "step_3")
        assert not list(nodes.backing_root.glob("step_*"))
        for daemon in daemons:
            assert daemon is not None and daemon.proc is not None
            daemon.proc.send_signal(signal.SIGTERM)
        n0, n1 = daemons
        assert n0 is not None and n1 is not None
        agreed = n0.wait_event("tier.stop_agreed", timeout=30)
        assert (agreed["step"], agreed["newest"]) == (2, 3), agreed
        for daemon in (n0, n1):
            drained = daemon.wait_event("tier.stop_drained", timeout=60)
            assert drained["step"] == 2, drained
            assert daemon.proc is not None and daemon.proc.wait(60) == 0
            daemon.stop()  # reaped: its output read to the end
        assert sorted(p.name for p in nodes.backing_root.glob("step_*")) == ["step_2"]
        # The facts counted are removed; the decision names their nonces.
        assert sorted(p.name for p in stop_dir.iterdir()) == ["decision.json", "n9.json"]
        decision = json.loads((stop_dir / "decision.json").read_text())
        assert (decision["step"], decision["by"], len(decision["nonces"])) == (2, "n0", 2)
        for rank in (0, 1):
            rel = Path("step_2") / "m" / f"r{rank}.bin"
            assert (nodes.backing_root / rel).read_bytes() == (private[rank] / rel).read_bytes()

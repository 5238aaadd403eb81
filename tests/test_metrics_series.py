"""Every configured root has its promotion counters from the start, at zero."""

from __future__ import annotations

from pathlib import Path

from tests.test_metrics import Start, metrics_port, scrape


class TestSeriesFromTheStart:
    """``ckptd_promotions_total`` exists at 0 for a root that has promoted nothing yet.

    Without it, ``increase(ckptd_promotions_total[1h]) == 0`` has no series to compare,
    and ``CkptdSavesStuck`` could never fire for a root whose saves never once finished.
    """

    def test_before_any_promotion(self, start: Start, root: Path, tmp_path: Path) -> None:
        other = tmp_path / "other"
        other.mkdir()
        daemon = start([root, other], "--metrics-listen", "127.0.0.1:0")
        _, samples = scrape(metrics_port(daemon))
        for path in (root, other):
            labels = (("root", str(path)),)
            assert samples.get(("ckptd_promotions_total", labels)) == 0.0, sorted(samples)[:20]
            assert samples.get(("ckptd_promoted_bytes_total", labels)) == 0.0

"""CI sample of the kill campaign: a real 2-rank DCP job, the daemon killed under it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.kill import run_kill_campaign


@pytest.mark.slow
@pytest.mark.timeout(300)
class TestKillSample:
    """SIGKILLs and crash points under a streaming job lose nothing and promote once."""

    def test_trials_without_violations(self, short_dir: Path) -> None:
        result = run_kill_campaign(short_dir, 8, seed=20261129, max_delay=0.8)
        assert result.violations == []
        assert result.trials == 8
        figures = result.figures
        assert figures["steps promoted"] == figures["steps completed by both ranks"] > 0
        assert figures["steps failed"] == 0

    def test_stateless_trials_without_violations(self, short_dir: Path) -> None:
        # Every daemon run starts on an empty state directory (a requeue's prolog).
        result = run_kill_campaign(short_dir, 6, seed=20261201, max_delay=0.8, stateless=True)
        assert result.violations == []
        assert result.trials == 6
        figures = result.figures
        assert figures["steps promoted"] == figures["steps completed by both ranks"] > 0
        assert figures["steps failed"] == 0

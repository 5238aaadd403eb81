"""CI sample of the disk faults: real full tmpfs under the checkpoints or the journal."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.disk import SCENARIOS
from tests.faults.harness import MountRefused


@pytest.mark.slow
@pytest.mark.timeout(240)
class TestDiskFaults:
    """A full disk fails the save with the reason and never stops the daemon."""

    @pytest.mark.parametrize("name", sorted(SCENARIOS))
    def test_scenario(self, short_dir: Path, name: str) -> None:
        try:
            outcome = SCENARIOS[name](short_dir)
        except MountRefused as exc:
            pytest.skip(f"needs a real tmpfs: {exc.strerror}")
        assert outcome.violations == [], outcome.observed

    def test_promotion_failure_reason_has_the_documented_form(self, short_dir: Path) -> None:
        try:
            outcome = SCENARIOS["enospc_during_promotion"](short_dir)
        except MountRefused as exc:
            pytest.skip(f"needs a real tmpfs: {exc.strerror}")
        # docs/events.md: `promotion failed: <stage> failed for <dir>: <error>`
        assert outcome.evidence["reason"].startswith("promotion failed: write node marker failed")

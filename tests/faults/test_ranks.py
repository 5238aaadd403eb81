"""CI sample of the rank faults: real ranks stopped, failing, or replaced mid-save.

A rank SIGKILLed mid-upload is ``tests/test_dcp.py::TestRankDeath``; its twin in
``tests.faults.ranks`` runs only in the long run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.ranks import SCENARIOS

SAMPLE = sorted(set(SCENARIOS) - {"sigkill_mid_upload"})


@pytest.mark.slow
@pytest.mark.timeout(240)
class TestRankFaults:
    """Each rank fault ends as docs/guarantees.md says."""

    @pytest.mark.parametrize("name", SAMPLE)
    def test_scenario(self, short_dir: Path, name: str) -> None:
        outcome = SCENARIOS[name](short_dir)
        assert outcome.violations == [], outcome.observed

"""An acknowledged ``score`` is never replaced by metrics the step's files or ranks gave.

A score sent right after ``wait`` says promoted can come before the background pass
adopts the step's own metrics (its ranks' ``done.metrics``, its ``training_info.json``).
The score is the evaluation job's word on the promoted step: adopting must not undo it.
"""

from __future__ import annotations

import json
from pathlib import Path

from daemon.ledger._saves import SaveKey
from daemon.retention.state import RetentionState
from tests.conftest import LineClient
from tests.test_retention import Start, configure, promote, settle, start_with
from tests.test_server import TIMEOUT, ok

KEY = SaveKey("/r", 7)


class TestAdoptionAfterAScore:
    """A score between a promotion and its adoption stands, in memory and after replay."""

    def test_over_the_ranks_metrics(self) -> None:
        state = RetentionState()
        state.reported(KEY, "a1", {"val_loss": 1.0, "step_time": 3.0})
        state.score(KEY, {"val_loss": 0.1})
        state.adopt(KEY, "a1", {})
        assert state.metrics(KEY) == {"val_loss": 0.1, "step_time": 3.0}

    def test_over_training_info(self) -> None:
        state = RetentionState()
        state.score(KEY, {"reward": 0.9})
        state.adopt(KEY, "a1", {"reward": 0.2, "epoch": 4.0})
        assert state.metrics(KEY) == {"reward": 0.9, "epoch": 4.0}

    def test_after_a_replay(self) -> None:
        state = RetentionState()
        state.reported(KEY, "a1", {"val_loss": 1.0})
        state.score(KEY, {"val_loss": 0.1})
        state.adopt(KEY, "a1", {"val_loss": 2.0})
        replayed = RetentionState()
        for record in state.drain_records():
            assert replayed.replay(record)
        assert replayed.metrics(KEY) == {"val_loss": 0.1}

    def test_through_a_daemon(self, start: Start, root: Path, tmp_path: Path) -> None:
        policy = 'keep_last = 1\nkeep_best = { k = 1, metric = "val_loss", mode = "min" }'
        daemon = start_with(start, configure(tmp_path, root, policy))
        info = {"val_loss": 5.0}
        promote(daemon, root, 1, metrics={"val_loss": 4.0}, info=info)
        with LineClient(daemon.socket_path, timeout=TIMEOUT) as client:
            ok(client.request("score", root=str(root), step=1, metrics={"val_loss": 0.5}))
        report = settle(daemon, root)
        (step,) = report["steps"]
        assert step["metrics"]["val_loss"] == 0.5, report
        assert json.loads((root / "step_1" / "training_info.json").read_text()) == info

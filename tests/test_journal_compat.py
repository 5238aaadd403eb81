"""A journal written by the daemon before its modules moved into layers replays the same.

``tests/data/journal-flat-layout.bin`` was written by a real ``ckptd serve`` of the flat
layout (commit c31f024): two promoted steps with metrics, a score, a pin and a hold, a
step whose rank failed (set aside) and a step in flight when the daemon was SIGKILLed.
``journal-flat-layout.json`` is what that daemon's own code rebuilt from it (its ledger
and retention state after replay, as :func:`summary` prints them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from daemon.ledger._ledger import Ledger
from daemon.ledger._records import HEADER, JBegin, frame, parse
from daemon.retention.state import RetentionState

DATA = Path(__file__).resolve().parent / "data"
JOURNAL = DATA / "journal-flat-layout.bin"


def summary(data: bytes) -> dict[str, Any]:
    """The ledger and retention state a daemon rebuilds from journal bytes ``data``."""
    replay = parse(data)
    ledger = Ledger(lease=30.0, save_timeout=None)
    state = RetentionState()
    for record in replay.records:
        if not state.replay(record):  # as recovery does: retention's records first
            ledger.replay(record, 0.0)
    out: dict[str, Any] = {
        "records": [type(r).__name__ for r in replay.records],
        "saves": [],
        "retention": {},
    }
    for save in sorted(ledger, key=lambda s: s.key.step):
        ranks = sorted(save.ranks.items())
        out["saves"].append(
            {
                "step": save.key.step,
                "state": str(save.state),
                "attempt": save.attempt,
                "world_size": save.world_size,
                "reason": save.reason,
                "ranks": {str(k): str(v.state) for k, v in ranks},
                "files": {str(k): [[f.path, f.size] for f in v.files] for k, v in ranks},
            }
        )
        out["retention"][str(save.key.step)] = {
            "metrics": state.metrics(save.key),
            "pinned": state.pinned(save.key),
            "held": state.held_until(save.key, 0.0) is not None,
        }
    return out


class TestJournalFromTheFlatLayout:
    """Records written before the move decode, survive a rewrite and replay unchanged."""

    def test_every_record_is_read(self) -> None:
        replay = parse(JOURNAL.read_bytes())
        assert replay.dropped_bytes == 0 and replay.problem is None
        assert len(replay.records) == 28

    def test_records_survive_a_rewrite(self) -> None:
        # A compaction rewrites old records in today's encoding (a begin now names its
        # run, "" for these): what it writes reads back as the same records.
        records = parse(JOURNAL.read_bytes()).records
        rewritten = parse(HEADER + b"".join(frame(r) for r in records))
        assert rewritten.records == records and rewritten.dropped_bytes == 0
        assert {r.run for r in records if isinstance(r, JBegin)} == {""}

    def test_replay_rebuilds_what_the_old_daemon_did(self) -> None:
        expected = json.loads((DATA / "journal-flat-layout.json").read_text())
        assert summary(JOURNAL.read_bytes()) == expected
        states = {s["step"]: s["state"] for s in expected["saves"]}
        assert states == {1: "promoted", 2: "promoted", 3: "failed", 4: "open"}

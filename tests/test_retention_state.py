"""Retention's state (pure) and its file reading: journaled records rebuild it exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from daemon.base._errors import RequestError
from daemon.ledger._records import JournalRecord
from daemon.ledger._saves import SaveKey
from daemon.retention.state import MAX_METRICS, RetentionState
from daemon.store._journal import Journal
from daemon.store._steps import training_info_metrics

KEY = SaveKey("/r", 7)


def rebuilt(records: list[JournalRecord]) -> RetentionState:
    state = RetentionState()
    for record in records:
        assert state.replay(record)
    return state


def same(a: RetentionState, b: RetentionState, keys: list[SaveKey], now: float) -> None:
    for key in keys:
        assert a.metrics(key) == b.metrics(key)
        assert a.pending(key) == b.pending(key)
        assert a.pinned(key) == b.pinned(key)
        assert a.held_until(key, now) == b.held_until(key, now)


class TestJournal:
    """Every change's records, replayed or snapshotted, rebuild the same state."""

    def test_replay_and_snapshot(self, tmp_path: Path) -> None:
        state = RetentionState()
        other = SaveKey("/r", 8)
        state.reported(other, "a1", {"val_loss": 2.0})
        state.reported(KEY, "a1", {"val_loss": 1.0})
        state.adopt(KEY, "a1", {"step": 7.0, "val_loss": 9.0})  # done's value wins
        state.score(KEY, {"val_acc": 0.5})
        state.pin(KEY, True)
        state.hold(KEY, 200.0, 100.0)
        state.hold(other, 50.0, 100.0)  # already over: a release
        records = state.drain_records()
        assert state.metrics(KEY) == {"step": 7.0, "val_loss": 1.0, "val_acc": 0.5}
        # Through a real journal file, as a restart reads it.
        journal = Journal(str(tmp_path / "journal"))
        journal.open()
        journal.compact(records)
        journal.close()
        read = Journal(str(tmp_path / "journal")).open().records
        same(rebuilt(read), state, [KEY, other], 100.0)
        live = [(other, "a1")]
        same(rebuilt(state.snapshot(live, 100.0)), state, [KEY, other], 100.0)
        # A pending metric of an attempt no longer in flight is left out of a snapshot.
        assert rebuilt(state.snapshot([], 100.0)).pending(other) is None

    def test_retired_forgets(self) -> None:
        state = RetentionState()
        state.score(KEY, {"x": 1.0})
        state.hold(KEY, 10.0, 0.0)
        state.retired(KEY, "step_7.retired-abc", "keep_last=1")
        assert state.metrics(KEY) == {} and state.held_until(KEY, 0.0) is None
        assert rebuilt(state.drain_records()).metrics(KEY) == {}

    def test_another_attempts_metrics_are_not_adopted(self) -> None:
        state = RetentionState()
        state.reported(KEY, "old", {"val_loss": 0.1})
        state.adopt(KEY, "new", {})
        assert state.metrics(KEY) == {}


class TestBadValues:
    """Non-finite values are refused before anything changes; counts are bounded."""

    @pytest.mark.parametrize("value", [float("nan"), float("inf"), True])
    def test_refused(self, value: float) -> None:
        state = RetentionState()
        with pytest.raises(RequestError):
            state.score(KEY, {"x": value})
        with pytest.raises(RequestError):
            state.reported(KEY, "a", {"x": value})
        assert state.drain_records() == []

    def test_bounded(self) -> None:
        state = RetentionState()
        state.reported(KEY, "a", {f"m{i}": 1.0 for i in range(MAX_METRICS + 5)})
        pending = state.pending(KEY)
        assert pending is not None and len(pending[1]) == MAX_METRICS
        with pytest.raises(RequestError):
            state.score(KEY, {f"m{i}": 1.0 for i in range(MAX_METRICS + 1)})


class TestTrainingInfo:
    """NeMo-RL's training_info.json: its numeric top-level keys, nothing else."""

    def test_numeric_keys(self, tmp_path: Path) -> None:
        info = {
            "step": 400,
            "val_reward": 0.71,
            "val:accuracy": 0.64,
            "flag": True,
            "name": "run",
            "nested": {"loss": 1.0},
            "list": [1, 2],
            "bad name": 1.0,
            "huge": 10**400,
        }
        (tmp_path / "training_info.json").write_text(json.dumps(info))
        assert training_info_metrics(str(tmp_path)) == {
            "step": 400.0,
            "val_reward": 0.71,
            "val:accuracy": 0.64,
        }

    @pytest.mark.parametrize("text", ["", "[1, 2]", "{not json", "[" * 100_000, "NaN"])
    def test_unreadable_gives_none(self, tmp_path: Path, text: str) -> None:
        (tmp_path / "training_info.json").write_text(text)
        assert training_info_metrics(str(tmp_path)) == {}

    def test_missing_or_too_large(self, tmp_path: Path) -> None:
        assert training_info_metrics(str(tmp_path)) == {}
        (tmp_path / "training_info.json").write_text(json.dumps({"x": 1, "pad": "y" * 2**20}))
        assert training_info_metrics(str(tmp_path)) == {}


class TestScan:
    """Complete checkpoints are found from their manifest's head, large ones too."""

    def test_large_manifest(self, tmp_path: Path) -> None:
        import msgspec

        from daemon.config._config import RootConfig
        from daemon.store._steps import ManifestCache, scan
        from daemon.store._verify import MANIFEST_NAME, Manifest
        from orchestrator.protocol import ATTEMPT_MARKER, AttemptMarker

        root = RootConfig(path=str(tmp_path), real=str(tmp_path))
        files = {f"model/shard_{i:06d}.distcp": 1000 + i for i in range(5000)}
        for step, attempt in ((4, "a4"), (5, "a5")):
            final = tmp_path / f"step_{step}"
            final.mkdir()
            manifest = Manifest(
                root=str(tmp_path),
                step=step,
                world_size=2,
                created="2026-12-01T10:00:00Z",
                bytes=sum(files.values()),
                files=files if step == 5 else {},
                dirs=["."],
                dcp_dirs=["model"],
                attempt=attempt,
            )
            (final / MANIFEST_NAME).write_bytes(msgspec.json.encode(manifest))
            marker = AttemptMarker(
                attempt=attempt, root=str(tmp_path), step=step, world_size=2, created=""
            )
            (final / ATTEMPT_MARKER).write_bytes(msgspec.json.encode(marker))
        assert (tmp_path / "step_5" / MANIFEST_NAME).stat().st_size > 64 * 1024
        cache: ManifestCache = {}
        found = scan(root, cache)
        assert [(f.step, f.complete, f.attempt) for f in found] == [
            (4, True, "a4"),
            (5, True, "a5"),
        ]
        assert found[1].promoted_at == 1796119200.0
        assert scan(root, cache) == found  # from the cache: stat only

    @pytest.mark.parametrize("files", [0, 5000], ids=["small", "large"])
    def test_a_copy_is_not_the_checkpoint(self, tmp_path: Path, files: int) -> None:
        import shutil
        import subprocess

        import msgspec

        from daemon.config._config import RootConfig
        from daemon.store._origin import origin
        from daemon.store._steps import ManifestCache, scan
        from daemon.store._verify import MANIFEST_NAME, Manifest

        root_dir, backup = tmp_path / "run", tmp_path / "backup"
        root_dir.mkdir()
        backup.mkdir()
        root = RootConfig(path=str(root_dir), real=str(root_dir))
        for step, recorded in ((1, True), (2, True), (3, False)):
            final = root_dir / f"step_{step}"
            final.mkdir()
            manifest = Manifest(
                root=str(root_dir),
                step=step,
                world_size=1,
                created="2026-12-01T10:00:00Z",
                bytes=0,
                origin=origin(str(final)) if recorded else None,
                files={f"model/shard_{i:06d}.distcp": i for i in range(files)},
                dirs=["."],
                dcp_dirs=[],
            )
            data = msgspec.json.encode(manifest)
            if not recorded:  # as written before manifests had the field at all
                data = data.replace(b'"origin":null,', b"")
                assert b"origin" not in data
            (final / MANIFEST_NAME).write_bytes(data)
        cache: ManifestCache = {}
        assert [f.complete for f in scan(root, cache)] == [True, True, True]
        for step in (1, 3):  # backed up, deleted, restored where it was
            final = root_dir / f"step_{step}"
            subprocess.run(["cp", "-a", str(final), str(backup)], check=True)
            shutil.rmtree(final)
            subprocess.run(["cp", "-a", str(backup / final.name), str(final)], check=True)
        # Step 1 is a copy now, even with its original's inode number (ext4 gives it
        # back) and mtimes (cp -a keeps them). Step 3's manifest records no origin
        # (promoted before manifests did): taken as the daemon's, as it always was.
        assert [(f.step, f.complete) for f in scan(root, cache)] == [
            (1, False),
            (2, True),
            (3, True),
        ]
        assert [f.complete for f in scan(root, {})] == [False, True, True]  # uncached too

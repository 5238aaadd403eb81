"""Attempts: a retried, raced or orphaned step never loses or mixes files (invariant 4a).

Real daemons, real sockets, real directories; a caching FUSE mount holds a promotion
still where a test needs a step to stay in ``verifying``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from daemon.cli import main
from daemon.config._root import RootConfig
from daemon.store._attempts import prepare, stage_marker
from orchestrator.protocol import ATTEMPT_MARKER
from tests._fuse import bindfs_mount
from tests.conftest import DaemonProcess, LineClient

Factory = Callable[..., DaemonProcess]
TIMEOUT = 30.0


def _of(step: int) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e.get("step") == step


def _begin(client: LineClient, root: Path, step: int, rank: int = 0, world: int = 1) -> Any:
    return client.request("begin", root=str(root), step=step, rank=rank, world_size=world)


def _entry(tmp: Path, rel: str, data: bytes) -> dict[str, Any]:
    """Write ``rel`` under ``tmp`` and return it as ``done`` lists it."""
    path = tmp / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {"path": rel, "size": len(data)}


def _files(checkpoint: Path) -> list[str]:
    # The node's marker (its ranks' done, written before the step was judged) is named
    # after the host: listed by its prefix.
    return sorted(
        ".ckptd-node-*"
        if f.startswith(".ckptd-node-")
        else os.path.relpath(os.path.join(d, f), checkpoint)
        for d, _dirs, files in os.walk(checkpoint)
        for f in files
    )


def _manifest(checkpoint: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((checkpoint / ".ckptd-manifest.json").read_bytes())
    return data


class TestAttemptIds:
    """Every attempt has an id: in the begin reply, the tmp dir's marker, status and manifest."""

    def test_one_id_per_attempt_everywhere(self, daemon_factory: Factory, root: Path) -> None:
        daemon = daemon_factory([root])
        with LineClient(daemon.socket_path) as r0, LineClient(daemon.socket_path) as r1:
            first, second = _begin(r0, root, 3, 0, 2), _begin(r1, root, 3, 1, 2)
            assert first["ok"] and second["ok"]
            attempt = first["attempt"]
            assert attempt and second["attempt"] == attempt
            tmp = root / "tmp_step_3"
            # The directory exists, marked, when the reply arrives.
            marker = json.loads((tmp / ATTEMPT_MARKER).read_bytes())
            assert (marker["attempt"], marker["step"], marker["world_size"]) == (attempt, 3, 2)
            status = r0.request("status")["saves"]
            assert [(s["step"], s["attempt"]) for s in status] == [(3, attempt)]
            for rank, client in enumerate((r0, r1)):
                files = [_entry(tmp, f"r{rank}.bin", b"x" * 10)]
                done = client.request(
                    "done", root=str(root), step=3, rank=rank, files=files, attempt=attempt
                )
                assert done["ok"]
            reply = r0.request("wait", root=str(root), step=3, timeout=TIMEOUT)
            assert (reply["state"], reply["attempt"]) == ("promoted", attempt)
        assert daemon.wait_event("checkpoint.promoted")["attempt"] == attempt
        assert _manifest(root / "step_3")["attempt"] == attempt
        assert ATTEMPT_MARKER not in _manifest(root / "step_3")["files"]  # the daemon's own
        assert main(["verify", str(root / "step_3")]) == 0

    def test_a_stale_attempt_changes_nothing(self, daemon_factory: Factory, root: Path) -> None:
        daemon = daemon_factory([root])
        with LineClient(daemon.socket_path) as old:
            stale = _begin(old, root, 4)["attempt"]
            failed = old.request("fail", root=str(root), step=4, rank=0, reason="crash")
            assert failed["ok"]
        with LineClient(daemon.socket_path) as new, LineClient(daemon.socket_path) as late:
            current = _begin(new, root, 4)["attempt"]
            assert current != stale
            # The failed attempt's ranks, woken late, can neither fail nor finish the new one.
            for op, extra in (("fail", {"reason": "late"}), ("done", {"files": []})):
                reply = late.request(op, root=str(root), step=4, rank=0, attempt=stale, **extra)
                assert reply["error"]["code"] == "stale_attempt", reply
            resent = late.request(
                "begin", root=str(root), step=4, rank=0, world_size=1, resent=True, attempt=stale
            )
            assert resent["error"]["code"] == "stale_attempt"
            status = new.request("status")["saves"]
            assert [(s["state"], s["attempt"]) for s in status] == [("open", current)]


class TestRetriedStep:
    """A failed attempt is set aside when it fails, so a retry keeps its own early files."""

    def test_files_written_before_the_retry_begins_are_kept(
        self, daemon_factory: Factory, root: Path
    ) -> None:
        daemon = daemon_factory([root], "--lease", "0.3")
        tmp = root / "tmp_step_7"
        with LineClient(daemon.socket_path) as dead:
            _begin(dead, root, 7)
            _entry(tmp, "old_shard", b"old" * 10)
        # The rank died: its lease runs out, the step fails, and by the time anyone hears
        # of the failure its directory is out of the way.
        with LineClient(daemon.socket_path) as watcher:
            reply = watcher.request("wait", root=str(root), step=7, timeout=TIMEOUT)
            assert reply["state"] == "failed" and "lease" in reply["reason"]
            assert not tmp.exists()
        kept = Path(daemon.wait_event("save.set_aside", TIMEOUT, _of(7))["path"])
        assert (kept / "old_shard").read_bytes() == b"old" * 10
        # The job restarts and, as NeMo-RL's init_tmp_checkpoint does, writes its files
        # into tmp_step_7 before it begins step 7 again.
        info = _entry(tmp, "training_info.json", b'{"step": 7}')
        with LineClient(daemon.socket_path) as rank:
            assert _begin(rank, root, 7)["ok"]
            shard = _entry(tmp, "new_shard", b"new")
            done = rank.request("done", root=str(root), step=7, rank=0, files=[shard, info])
            assert done["ok"]
            reply = rank.request("wait", root=str(root), step=7, timeout=TIMEOUT)
            assert reply["state"] == "promoted"
        assert _files(root / "step_7") == [
            ".ckptd-attempt",
            ".ckptd-manifest.json",
            ".ckptd-node-*",
            "new_shard",
            "training_info.json",
        ]
        assert os.readlink(root / "latest") == "step_7"

    def test_two_ranks_start_the_new_attempt_together(
        self, daemon_factory: Factory, root: Path
    ) -> None:
        daemon = daemon_factory([root])
        with LineClient(daemon.socket_path) as old:
            _begin(old, root, 8, 0, 2)
            old.request("fail", root=str(root), step=8, rank=0, reason="crash")
        daemon.wait_event("save.set_aside", TIMEOUT, _of(8))
        # Both ranks of the resumed job begin at once; rank 0 writes the moment it is told.
        r0, r1 = LineClient(daemon.socket_path), LineClient(daemon.socket_path)
        try:
            for rank, client in enumerate((r0, r1)):
                line = {"op": "begin", "id": 1, "root": str(root), "step": 8, "rank": rank}
                client.send_raw(json.dumps({**line, "world_size": 2}).encode() + b"\n")
            first = r0.recv()
            shard = _entry(root / "tmp_step_8", "r0.bin", b"zero")
            second = r1.recv()
            assert first["ok"] and second["ok"]
            assert first["attempt"] == second["attempt"]
            assert (root / "tmp_step_8" / "r0.bin").read_bytes() == b"zero"
            r0.request("done", root=str(root), step=8, rank=0, files=[shard])
            r1.request("done", root=str(root), step=8, rank=1, files=[])
            assert r0.request("wait", root=str(root), step=8, timeout=TIMEOUT)["state"] == (
                "promoted"
            )
        finally:
            r0.close()
            r1.close()
        assert [e["event"] for e in daemon.drain()].count("save.retried") == 1
        assert (root / "step_8" / "r0.bin").read_bytes() == b"zero"


class TestLostJournal:
    """A tmp dir of an attempt the daemon does not know is set aside before a new one begins."""

    def test_dead_attempt_files_never_mix_in(self, daemon_factory: Factory, root: Path) -> None:
        daemon = daemon_factory([root])
        tmp = root / "tmp_step_9"
        with LineClient(daemon.socket_path) as dead:
            dead_attempt = _begin(dead, root, 9)["attempt"]
            _entry(tmp, "stale.bin", b"stale")
        daemon.kill()
        # The requeued job's daemon starts on an empty state directory.
        fresh = daemon_factory([root], "--state-dir", str(daemon.state_dir) + ".new")
        assert fresh.wait_event("save.orphaned")["step"] == 9
        with LineClient(fresh.socket_path) as rank:
            reply = _begin(rank, root, 9)
            assert reply["ok"] and reply["attempt"] != dead_attempt
            moved = fresh.wait_event("save.set_aside", TIMEOUT, _of(9))
            assert moved["attempt"] == dead_attempt
            assert (Path(moved["path"]) / "stale.bin").read_bytes() == b"stale"
            shard = _entry(tmp, "new_shard", b"new")
            rank.request("done", root=str(root), step=9, rank=0, files=[shard])
            assert rank.request("wait", root=str(root), step=9, timeout=TIMEOUT)["state"] == (
                "promoted"
            )
        assert _files(root / "step_9") == [
            ".ckptd-attempt",
            ".ckptd-manifest.json",
            ".ckptd-node-*",
            "new_shard",
        ]

    def test_unmarked_files_are_the_new_attempts(self, daemon_factory: Factory, root: Path) -> None:
        daemon = daemon_factory([root])
        info = _entry(root / "tmp_step_2", "config.yaml", b"lr: 1")  # written before begin
        with LineClient(daemon.socket_path) as rank:
            assert _begin(rank, root, 2)["ok"]
            rank.request("done", root=str(root), step=2, rank=0, files=[info])
            assert rank.request("wait", root=str(root), step=2, timeout=TIMEOUT)["state"] == (
                "promoted"
            )
        assert (root / "step_2" / "config.yaml").read_bytes() == b"lr: 1"
        assert "save.set_aside" not in [e["event"] for e in daemon.drain()]


class TestNoWriterPastOpen:
    """Once every rank is done, no begin joins the step: it is refused, never acknowledged."""

    def test_begin_refused_while_verifying_and_once_promoted(
        self, daemon_factory: Factory, tmp_path: Path
    ) -> None:
        backing = tmp_path / "backing"
        backing.mkdir()
        with bindfs_mount(backing, tmp_path / "mnt") as mount:
            root = mount.mount
            daemon = daemon_factory([root])
            with LineClient(daemon.socket_path) as rank, LineClient(daemon.socket_path) as late:
                attempt = _begin(rank, root, 5)["attempt"]
                shard = _entry(root / "tmp_step_5", "shard", b"verified")
                mount.stop()  # verification will hang on the filesystem: the step stays put
                assert rank.request("done", root=str(root), step=5, rank=0, files=[shard])["ok"]
                status = rank.request("status")["saves"]
                assert [s["state"] for s in status] == ["verifying"]
                refused = _begin(late, root, 5)
                assert refused["ok"] is False and refused["error"]["code"] == "step_closed"
                # The rank that is done may still reattach after a reconnect.
                resent = late.request(
                    "begin",
                    root=str(root),
                    step=5,
                    rank=0,
                    world_size=1,
                    resent=True,
                    attempt=attempt,
                )
                assert resent["ok"] and resent["state"] in ("verifying", "promoting")
                mount.cont()
                reply = rank.request("wait", root=str(root), step=5, timeout=TIMEOUT)
                assert reply["state"] == "promoted"
                again = _begin(late, root, 5)
                assert again["error"]["code"] == "already_promoted"
            assert (root / "step_5" / "shard").read_bytes() == b"verified"
            daemon.stop()


class TestDeletedCheckpoint:
    """A promoted step deleted by hand may be saved afresh; one still on disk never."""

    def test_saved_again_once_its_directory_is_gone(
        self, daemon_factory: Factory, root: Path
    ) -> None:
        daemon = daemon_factory([root])
        for expected in ("promoted", "promoted"):
            with LineClient(daemon.socket_path) as rank:
                reply = _begin(rank, root, 3)
                assert reply["ok"], reply
                shard = _entry(root / "tmp_step_3", "shard", b"x")
                rank.request("done", root=str(root), step=3, rank=0, files=[shard])
                state = rank.request("wait", root=str(root), step=3, timeout=TIMEOUT)["state"]
                assert state == expected
                # Still on disk: refused, whoever asks.
                assert _begin(rank, root, 3)["error"]["code"] == "already_promoted"
            shutil.rmtree(root / "step_3")  # an operator deletes the checkpoint
        gone = daemon.wait_event("checkpoint.gone")
        assert (gone["step"], gone["path"]) == (3, str(root / "step_3"))


class TestStagedMarker:
    """A new attempt's marker is flushed before the root's lock; under it, only named."""

    def test_the_staged_marker_is_the_one_placed(self, root: Path) -> None:
        config = RootConfig(path=str(root), real=str(root))
        (root / "tmp_step_2").mkdir()
        (root / "tmp_step_2" / "training_info.json").write_text("{}")  # written before begin
        staged = stage_marker(config, 2, "a" * 16, 4, run="job:1")
        assert staged.file is not None
        try:
            done = prepare(config, 2, "a" * 16, 4, "job:1", sync=False, staged=staged)
        finally:
            staged.close()
        assert (root / "tmp_step_2" / ATTEMPT_MARKER).read_bytes() == staged.data
        marker = json.loads(staged.data)
        assert (marker["attempt"], marker["world_size"], marker["run"]) == ("a" * 16, 4, "job:1")
        assert sorted(os.listdir(root / "tmp_step_2")) == [ATTEMPT_MARKER, "training_info.json"]
        assert done.unsynced == (str(root / "tmp_step_2"),)

    def test_another_attempts_directory_is_still_set_aside(self, root: Path) -> None:
        config = RootConfig(path=str(root), real=str(root))
        prepare(config, 3, "b" * 16, 1)
        (root / "tmp_step_3" / "old.bin").write_bytes(b"old")
        staged = stage_marker(config, 3, "c" * 16, 1)
        try:
            done = prepare(config, 3, "c" * 16, 1, staged=staged)
        finally:
            staged.close()
        assert done.foreign == "b" * 16 and done.moved is not None
        assert os.listdir(root / "tmp_step_3") == [ATTEMPT_MARKER]
        placed = json.loads((root / "tmp_step_3" / ATTEMPT_MARKER).read_bytes())
        assert placed["attempt"] == "c" * 16

    def test_without_an_unnamed_file_the_bytes_are_written(self, tmp_path: Path) -> None:
        backing, mount = tmp_path / "backing", tmp_path / "mnt"
        backing.mkdir()
        with bindfs_mount(backing, mount):
            config = RootConfig(path=str(mount), real=str(mount))
            staged = stage_marker(config, 1, "d" * 16, 1)
            assert staged.file is None
            prepare(config, 1, "d" * 16, 1, staged=staged)
            assert (backing / "tmp_step_1" / ATTEMPT_MARKER).read_bytes() == staged.data

"""A daemon killed at any point and restarted loses nothing acknowledged and promotes once."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from daemon import verify_checkpoint
from daemon.base._faults import POINTS
from daemon.ledger._records import JBegin, JDone, JIntent, JournalRecord, JPromoted
from daemon.store._journal import Journal
from orchestrator.protocol import FileEntry
from tests._files import snapshot
from tests.conftest import DaemonProcess, LineClient

Factory = Callable[..., DaemonProcess]


def _begin_both(daemon: DaemonProcess, root: Path, step: int) -> tuple[LineClient, LineClient]:
    ranks = LineClient(daemon.socket_path), LineClient(daemon.socket_path)
    for rank, client in enumerate(ranks):
        reply = client.request("begin", root=str(root), step=step, rank=rank, world_size=2)
        assert reply["ok"], reply
    tmp = root / f"tmp_step_{step}"
    for rank in (0, 1):
        (tmp / "model").mkdir(parents=True, exist_ok=True)
        (tmp / "model" / f"shard{rank}.bin").write_bytes(bytes([rank]) * 1000)
    return ranks


def _files(rank: int) -> list[dict[str, object]]:
    return [{"path": f"model/shard{rank}.bin", "size": 1000}]


def _rank0_done_then_killed(daemon: DaemonProcess, root: Path, step: int) -> None:
    """Both ranks begin ``step``, rank 0 is done, then the daemon is SIGKILLed."""
    rank0, rank1 = _begin_both(daemon, root, step)
    assert rank0.request("done", root=str(root), step=step, rank=0, files=_files(0))["ok"]
    daemon.kill()
    rank0.close()
    rank1.close()


def _assert_promoted_once(root: Path, step: int) -> None:
    assert (root / f"step_{step}").is_dir()
    assert not (root / f"tmp_step_{step}").exists()
    assert verify_checkpoint(str(root / f"step_{step}")) == []
    assert os.readlink(root / "latest") == f"step_{step}"
    assert sorted(p.name for p in root.iterdir()) == [
        ".ckptd-layout.json",
        "latest",
        f"step_{step}",
    ]


class TestCrashDuringPromotion:
    """Killed at each narrow window of promotion, the restart finishes it exactly once."""

    @pytest.mark.parametrize("point", POINTS)
    def test_crash_point(self, daemon_factory: Factory, root: Path, point: str) -> None:
        daemon = daemon_factory([root], env={"CKPTD_CRASH_AT": point})
        rank0, rank1 = _begin_both(daemon, root, 1)
        assert rank0.request("done", root=str(root), step=1, rank=0, files=_files(0))["ok"]
        rank1.send_raw(
            b'{"op":"done","id":99,"root":"%s","step":1,"rank":1,'
            b'"files":[{"path":"model/shard1.bin","size":1000}]}\n' % str(root).encode()
        )
        assert daemon.proc is not None
        assert daemon.proc.wait(30) == 137  # died at the crash point
        daemon.stop()
        rank0.close()
        rank1.close()

        restarted = daemon_factory([root])
        recovered = restarted.drain()
        if point != "after_promoted":
            # After the journaled intent the restart resumes the promotion; before it
            # (files being flushed, nothing written) it verifies and promotes anew.
            promoted = restarted.wait_event("checkpoint.promoted", match=lambda e: e["step"] == 1)
            assert promoted.get("resumed") is (None if point == "before_intent" else True)
            assert promoted["bytes"] == 2000 and promoted["files"] == 2
        else:
            assert "checkpoint.promoted" not in [e["event"] for e in recovered]
        _assert_promoted_once(root, 1)
        with LineClient(restarted.socket_path) as client:
            reply = client.request("wait", root=str(root), step=1, timeout=10)
            assert (reply["state"], reply["path"]) == ("promoted", str(root / "step_1"))
            status = client.request("status")["saves"]
            assert [(s["step"], s["state"]) for s in status] == [(1, "promoted")]
            # Promoted exactly once: a repeated begin is refused, nothing is renamed again.
            again = client.request("begin", root=str(root), step=1, rank=0, world_size=2)
            assert again["error"]["code"] == "already_promoted"
        assert restarted.stop() == 0
        events = [e["event"] for e in restarted.drain()]
        assert events.count("checkpoint.promoted") == (0 if point == "after_promoted" else 1)


class TestCrashWhileSaving:
    """Saves in flight survive a SIGKILL: acknowledged dones are kept, leases re-armed."""

    def test_acknowledged_done_survives(self, daemon_factory: Factory, root: Path) -> None:
        daemon = daemon_factory([root])
        _rank0_done_then_killed(daemon, root, 3)

        restarted = daemon_factory([root])
        recovered = restarted.wait_event("daemon.recovered")
        assert (recovered["in_flight"], recovered["saves"]) == (1, 1)
        disconnected = restarted.wait_event("save.rank_disconnected")
        assert disconnected["rank"] == 1  # rank 0 is done: no lease for it
        with LineClient(restarted.socket_path) as again:
            assert again.request("begin", root=str(root), step=3, rank=1, world_size=2)["ok"]
            assert again.request("done", root=str(root), step=3, rank=1, files=_files(1))["ok"]
            assert again.request("wait", root=str(root), step=3, timeout=30)["state"] == "promoted"
        _assert_promoted_once(root, 3)

    def test_lease_rearmed_and_expires(self, daemon_factory: Factory, root: Path) -> None:
        daemon = daemon_factory([root], "--lease", "0.5")
        rank0, rank1 = _begin_both(daemon, root, 4)
        daemon.kill()
        rank0.close()
        rank1.close()
        restarted = daemon_factory([root], "--lease", "0.5")
        failed = restarted.wait_event("checkpoint.failed")
        assert failed["step"] == 4 and "lease" in failed["reason"]
        assert not (root / "step_4").exists()
        kept = restarted.wait_event("save.set_aside")
        assert kept["step"] == 4 and Path(kept["path"]).is_dir()  # kept for inspection

    def test_failed_step_stays_failed(self, daemon_factory: Factory, root: Path) -> None:
        daemon = daemon_factory([root])
        rank0, rank1 = _begin_both(daemon, root, 5)
        assert rank0.request("fail", root=str(root), step=5, rank=0, reason="disk full")["ok"]
        daemon.kill()
        rank0.close()
        rank1.close()
        restarted = daemon_factory([root])
        with LineClient(restarted.socket_path) as client:
            done = client.request("done", root=str(root), step=5, rank=1, files=_files(1))
            assert done["error"]["code"] == "step_failed"
            reply = client.request("wait", root=str(root), step=5, timeout=5)
        assert (reply["state"], reply["reason"]) == ("failed", "rank 0 failed: disk full")


class TestRecoveryEvidence:
    """Restarts report orphans and torn journal tails, and replay nothing false."""

    def test_orphan_reported_never_touched(self, daemon_factory: Factory, root: Path) -> None:
        (root / "tmp_step_9").mkdir()
        (root / "tmp_step_9" / "x").write_bytes(b"x")
        daemon = daemon_factory([root])
        orphan = daemon.wait_event("save.orphaned")
        assert (orphan["step"], orphan["path"]) == (9, str(root / "tmp_step_9"))
        assert daemon.wait_event("daemon.recovered")["orphans"] == 1
        assert daemon.stop() == 0
        assert (root / "tmp_step_9" / "x").read_bytes() == b"x"
        assert not (root / "step_9").exists()

    def test_torn_journal_tail_dropped(self, daemon_factory: Factory, root: Path) -> None:
        daemon = daemon_factory([root])
        rank0, rank1 = _begin_both(daemon, root, 6)
        assert rank0.request("done", root=str(root), step=6, rank=0, files=_files(0))["ok"]
        daemon.kill()
        rank0.close()
        rank1.close()
        journal = daemon.state_dir / "journal"
        with open(journal, "ab") as fh:
            fh.write(b"\x40\x00\x00\x00garbage-of-a-torn-write")
        restarted = daemon_factory([root])
        recovered = restarted.wait_event("daemon.recovered")
        assert recovered["dropped_bytes"] > 0 and recovered["problem"] == "torn record"
        assert recovered["in_flight"] == 1
        with LineClient(restarted.socket_path) as client:
            ranks = client.request("status")["saves"][0]["ranks"]
        assert [(r["rank"], r["state"]) for r in ranks] == [(0, "done"), (1, "writing")]

    def test_second_daemon_on_same_state_dir_refused(
        self, daemon_factory: Factory, root: Path, short_dir: Path
    ) -> None:
        first = daemon_factory([root])
        second = DaemonProcess(short_dir / "other.sock", [root], state_dir=first.state_dir)
        with pytest.raises(AssertionError, match="daemon exited"):
            second.start(timeout=30)
        assert second.proc is not None and second.proc.wait(30) == 2
        lines = " ".join(str(e.get("line", "")) for e in second.drain())
        assert "another ckptd is using this state directory" in lines
        second.stop()


class TestClockSteps:
    """Replay rebuilds what happened: wall-clock times in the journal never re-decide it."""

    def test_promoted_step_stays_promoted_across_a_clock_jump(
        self, daemon_factory: Factory, root: Path, tmp_path: Path
    ) -> None:
        # The wall clock stepped two hours forward between the begin and the done (NTP
        # after a VM pause): the live daemon, on its monotonic clock, saw one second and
        # promoted the step. Replaying those times must not fail it after the fact.
        t = time.time() - 2.5 * 3600
        path, attempt = str(root), "a1b2c3d4e5f60718"
        files = [FileEntry("model/r0.bin", 10)]
        records: list[JournalRecord] = [
            JBegin(path, 5, 0, 1, t, attempt),
            JDone(path, 5, 0, files, t + 7200),
            JIntent(path, 5),
            JPromoted(path, 5, str(root / "step_5"), t + 7201),
            JBegin(path, 6, 0, 2, t + 7000, attempt),
            JDone(path, 6, 0, files, t + 7100),
        ]
        state = tmp_path / "state"
        journal = Journal(str(state / "journal"))
        journal.open()
        journal.compact(records)
        journal.close()
        (root / "step_5").mkdir()
        daemon = daemon_factory([root], "--state-dir", str(state))
        assert daemon.wait_event("daemon.recovered")["skipped"] == 0
        with LineClient(daemon.socket_path) as client:
            saves = {s["step"]: s for s in client.request("status")["saves"]}
            reply = client.request("wait", root=path, step=5, timeout=5)
        assert (saves[5]["state"], reply["state"]) == ("promoted", "promoted")
        # Step 6 was open (one rank done of two), well within its hour: still open.
        assert saves[6]["state"] == "open"
        assert [(r["rank"], r["state"]) for r in saves[6]["ranks"]] == [(0, "done")]
        assert "checkpoint.failed" not in [e["event"] for e in daemon.drain()]


class TestLostStateDirectory:
    """A daemon on an empty state directory finishes what its ranks' word on the root proves."""

    def test_all_ranks_done_promoted_from_the_root(
        self, daemon_factory: Factory, root: Path
    ) -> None:
        daemon = daemon_factory([root], env={"CKPTD_CRASH_AT": "before_intent"})
        rank0, rank1 = _begin_both(daemon, root, 1)
        assert rank0.request("done", root=str(root), step=1, rank=0, files=_files(0))["ok"]
        assert rank1.request("done", root=str(root), step=1, rank=1, files=_files(1))["ok"]
        assert daemon.proc is not None
        assert daemon.proc.wait(30) == 137  # died judging it, its ranks long gone
        daemon.stop()
        rank0.close()
        rank1.close()

        # Another socket, another (empty) state directory: a requeued job's node.
        restarted = daemon_factory([root], socket_name="e.sock")
        assert restarted.wait_event("save.orphaned")["step"] == 1
        assert restarted.wait_event("save.adopted")["step"] == 1
        promoted = restarted.wait_event("checkpoint.promoted", match=lambda e: e["step"] == 1)
        assert promoted["files"] == 2
        # Promoted as ``ckptd promote`` would, under a claim, with the verdict it leaves.
        assert (root / ".ckptd-verdicts").is_dir()
        shutil.rmtree(root / ".ckptd-verdicts")
        _assert_promoted_once(root, 1)

    def test_a_marker_cut_short_by_the_crash_is_no_sign_of_other_nodes(
        self, daemon_factory: Factory, root: Path
    ) -> None:
        # Both ranks were done, and the daemon died writing their node marker: only its
        # temporary file is left, half written. The ranks re-send begin and done to a
        # daemon on an empty state directory, which takes the attempt over and promotes.
        daemon = daemon_factory([root])
        ranks = LineClient(daemon.socket_path), LineClient(daemon.socket_path)
        attempts = set()
        for rank, client in enumerate(ranks):
            reply = client.request(
                "begin", root=str(root), step=4, rank=rank, world_size=2, run="job-1"
            )
            attempts.add(reply["attempt"])
        (attempt,) = attempts
        tmp = root / "tmp_step_4"
        for rank in (0, 1):
            (tmp / "model").mkdir(exist_ok=True)
            (tmp / "model" / f"shard{rank}.bin").write_bytes(bytes([rank]) * 1000)
        daemon.kill()
        for client in ranks:
            client.close()
        (tmp / ".ckptd-node-n0.json.5f1e2d3c.tmp").write_bytes(b'{"node":"n0","attempt":"')

        restarted = daemon_factory([root], socket_name="e.sock")
        again = LineClient(restarted.socket_path), LineClient(restarted.socket_path)
        for rank, client in enumerate(again):
            reply = client.request(
                "begin",
                root=str(root),
                step=4,
                rank=rank,
                world_size=2,
                run="job-1",
                resent=True,
                attempt=attempt,
            )
            assert reply["ok"] and reply["attempt"] == attempt, reply
        for rank, client in enumerate(again):
            done = {"root": str(root), "step": 4, "rank": rank, "attempt": attempt}
            assert client.request("done", **done, files=_files(rank))["ok"]
        promoted = restarted.wait_event("checkpoint.promoted", match=lambda e: e["step"] == 4)
        assert promoted["attempt"] == attempt
        for client in again:
            client.close()
        assert verify_checkpoint(str(root / "step_4")) == []

    def test_a_rank_not_done_stays_an_orphan(self, daemon_factory: Factory, root: Path) -> None:
        daemon = daemon_factory([root])
        _rank0_done_then_killed(daemon, root, 2)
        before = snapshot(root / "tmp_step_2")

        restarted = daemon_factory([root], socket_name="e.sock")
        assert restarted.wait_event("daemon.recovered")["orphans"] == 1
        assert restarted.stop() == 0
        events = [e["event"] for e in restarted.drain()]
        assert "save.adopted" not in events and "checkpoint.promoted" not in events
        assert snapshot(root / "tmp_step_2") == before and not (root / "step_2").exists()

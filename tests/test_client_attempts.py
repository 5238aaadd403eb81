"""Attempt ids and refused begins, as the client keeps and sends them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from orchestrator import CheckpointClient, FileEntry
from orchestrator import protocol as p
from tests._peer import ScriptedDaemon
from tests.conftest import DaemonProcess, LineClient


@pytest.fixture
def peer(short_dir: Path, root: Path) -> Iterator[ScriptedDaemon]:
    """A scripted daemon that gives the attempt ``att-1``."""
    scripted = ScriptedDaemon(short_dir / "peer.sock", root)
    yield scripted
    scripted.close()


def _client(peer: ScriptedDaemon, short_dir: Path) -> CheckpointClient:
    return CheckpointClient(str(short_dir / "peer.sock"), begin_timeout=30.0, reconnect_max=0.1)


class TestAttemptSent:
    """done, fail and re-sent begins name the attempt their begin joined."""

    def test_done_and_fail_name_the_attempt(
        self, peer: ScriptedDaemon, short_dir: Path, root: Path
    ) -> None:
        with _client(peer, short_dir) as client:
            first = client.save(str(root), 1, 0, 1)
            assert first.attempt == "att-1" and first.begun.attempt == "att-1"
            first.add_files([FileEntry("w.bin", 1)])
            first.seal()
            second = client.save(str(root), 2, 0, 1)
            failed: Future[None] = Future()
            second.add(failed)
            second.seal()
            failed.set_exception(OSError("disk gone"))
            assert client.flush(30.0)
        assert peer.next_request("begin", step=1).get("attempt") is None  # a first begin
        assert peer.next_request("done", step=1)["attempt"] == "att-1"
        fail = peer.next_request("fail", step=2)
        assert fail["attempt"] == "att-1" and "disk gone" in fail["reason"]

    def test_done_waits_for_the_begin_answer(
        self, peer: ScriptedDaemon, short_dir: Path, root: Path
    ) -> None:
        with _client(peer, short_dir) as client:
            peer.hold_begins()
            landed: Future[None] = Future()
            landed.set_result(None)
            handle = client.track(str(root), 3, 0, 1, landed)  # done is due at once
            peer.next_request("begin", step=3)
            assert client.ping(30.0)  # queued after the done: the done was not sent
            assert "done" not in peer.drain()
            peer.answer_begins()
            assert handle.wait_local(30.0)
            assert client.flush(30.0)
        assert peer.next_request("done", step=3)["attempt"] == "att-1"

    def test_begin_resent_after_a_reconnect_names_it(
        self, peer: ScriptedDaemon, short_dir: Path, root: Path
    ) -> None:
        with _client(peer, short_dir) as client:
            handle = client.save(str(root), 4, 0, 2)
            assert handle.attempt == "att-1"
            peer.hang_up()  # as a daemon that restarts does
            again = peer.next_request("begin", step=4, resent=True)
            assert again["attempt"] == "att-1"
            handle.seal()
            assert client.flush(30.0)
        assert peer.next_request("done", step=4)["attempt"] == "att-1"

    def test_no_attempt_from_an_older_daemon(
        self, peer: ScriptedDaemon, short_dir: Path, root: Path
    ) -> None:
        peer.attempt = ""  # a daemon that predates attempts
        with _client(peer, short_dir) as client:
            handle = client.save(str(root), 5, 0, 1)
            assert handle.attempt is None
            peer.hang_up()
            assert peer.next_request("begin", step=5, resent=True).get("attempt") is None
            handle.seal()
            assert client.flush(30.0)
        assert peer.next_request("done", step=5).get("attempt") is None

    def test_attempt_matches_the_daemons(
        self, daemon_factory: Callable[..., DaemonProcess], root: Path
    ) -> None:
        daemon = daemon_factory([root])
        with CheckpointClient(str(daemon.socket_path), begin_timeout=10.0) as client:
            handle = client.save(str(root), 6, 0, 2)
            status = client.call(p.Status(id=0, root=str(root)))
            handle.seal()
        (save,) = [s for s in status["saves"] if s["step"] == 6]
        # None from a daemon that gives no attempts, the same id from one that does.
        assert handle.attempt == (save.get("attempt") or None)


class TestStaleReports:
    """Against the real daemon: a report of a replaced attempt never counts for its successor."""

    def test_a_late_done_of_a_failed_attempt_is_refused(
        self, daemon_factory: Callable[..., DaemonProcess], root: Path
    ) -> None:
        daemon = daemon_factory([root])
        sock = str(daemon.socket_path)
        with CheckpointClient(sock, begin_timeout=10.0) as old:
            late = old.save(str(root), 7, 0, 2)
            with LineClient(daemon.socket_path) as rank1:  # the old job's other rank fails
                assert rank1.request("begin", root=str(root), step=7, rank=1, world_size=2)["ok"]
                reply = rank1.request("fail", root=str(root), step=7, rank=1, reason="x")
                assert reply["ok"]
            daemon.wait_event("checkpoint.failed")
            with CheckpointClient(sock, begin_timeout=10.0) as new:  # the resumed job
                current = new.save(str(root), 7, 0, 2)
                assert current.attempt and current.attempt != late.attempt
                # The old job's rank 0, woken late, reports its upload done.
                late.add_files([FileEntry("w.bin", 1)])
                late.seal()
                assert old.flush(30.0)
                status = new.call(p.Status(id=0, root=str(root)))
                (save,) = [s for s in status["saves"] if s["step"] == 7]
                assert save["attempt"] == current.attempt
                assert [(r["rank"], r["state"]) for r in save["ranks"]] == [(0, "writing")]
                current.seal()
        stale = daemon.wait_event("request.rejected", match=lambda e: e["code"] == "stale_attempt")
        assert late.attempt in stale["message"]


class TestRefusedBegin:
    """A refused save is exposed on its handle and reports neither done nor fail."""

    def test_refusal_exposed_and_nothing_reported(
        self,
        peer: ScriptedDaemon,
        short_dir: Path,
        root: Path,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        caplog.set_level(logging.WARNING, logger="orchestrator")
        peer.refusal = ("step_closed", "step 7 is being verified")
        with _client(peer, short_dir) as client:
            handle = client.save(str(root), 7, 0, 1)
            assert handle.refusal == p.ErrorInfo("step_closed", "step 7 is being verified")
            assert not handle.begun.acknowledged and handle.attempt is None
            assert handle.wait_local(0)  # settled: it will never report anything
            assert client.wait_saves(0)
            upload: Future[None] = Future()
            handle.add(upload)
            handle.seal()
            upload.set_exception(OSError("the planner refused"))
            assert handle.wait_local(30.0)
            client.done(str(root), 7, 0)  # a bare done of the refused save: not sent either
            assert client.ping(30.0)  # queued after both: had they gone, they came first
        assert peer.drain() == ["begin", "ping"]
        assert not Path(handle.path).exists()  # save() waited: nothing of it was created
        refusals = [r.getMessage() for r in caplog.records if "refused begin" in r.getMessage()]
        assert len(refusals) == 1 and "step_closed" in refusals[0]
        assert not [r for r in caplog.records if "sealed" in r.getMessage()]

    def test_fail_of_a_refused_save_never_lands_on_the_other_save(
        self, daemon_factory: Callable[..., DaemonProcess], root: Path
    ) -> None:
        daemon = daemon_factory([root])
        with LineClient(daemon.socket_path) as other:
            # Another job's save of step 8 (3 ranks) is open and writing.
            assert other.request("begin", root=str(root), step=8, rank=0, world_size=3)["ok"]
            with CheckpointClient(str(daemon.socket_path), begin_timeout=10.0) as client:
                handle = client.save(str(root), 8, 0, 2)
                assert handle.refusal is not None
                assert handle.refusal.code == "world_size_mismatch"
                upload: Future[None] = Future()
                handle.add(upload)
                handle.seal()
                upload.set_exception(OSError("the planner refused"))
                assert handle.wait_local(30.0)
                assert client.ping(10.0)
            status = other.request("status", root=str(root))
        (save,) = [s for s in status["saves"] if s["step"] == 8]
        # Rank 0's fail would have failed the other job's save: it was never sent.
        assert save["state"] == "open"
        assert [r["state"] for r in save["ranks"]] == ["writing"]

"""``local_world_size``: every client path tells the daemon how many ranks are on its node.

The client reads it from an explicit argument, else torchrun's ``LOCAL_WORLD_SIZE``,
else Slurm's ``SLURM_NTASKS_PER_NODE`` (or an unambiguous ``SLURM_TASKS_PER_NODE``).
The scripted daemon of ``tests/_peer.py`` records the frames exactly as the client
wrote them; a real ``ckptd serve`` shows a single-node save still promotes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from orchestrator import CheckpointClient, FileEntry
from orchestrator._nodes import local_world_size, read_environment
from tests._peer import ScriptedDaemon
from tests._ranks import free_port, pump_lines, start_rank
from tests.conftest import REPO, DaemonProcess

WORKER = REPO / "tests" / "_nodes_worker.py"


@pytest.fixture
def peer(short_dir: Path, root: Path) -> Iterator[ScriptedDaemon]:
    """A scripted daemon recording every request."""
    scripted = ScriptedDaemon(short_dir / "peer.sock", root)
    yield scripted
    scripted.close()


def _client(short_dir: Path) -> CheckpointClient:
    return CheckpointClient(str(short_dir / "peer.sock"), begin_timeout=30.0, reconnect_max=0.1)


class TestResolution:
    """Which value wins, and which values are refused (the pure rule)."""

    @pytest.mark.parametrize(
        ("env", "explicit", "expected"),
        [
            ({}, None, None),
            ({"LOCAL_WORLD_SIZE": "4"}, None, 4),
            ({"SLURM_NTASKS_PER_NODE": "2"}, None, 2),
            ({"SLURM_TASKS_PER_NODE": "4(x2)"}, None, 4),
            ({"SLURM_TASKS_PER_NODE": "2,2,2(x3)"}, None, 2),
            ({"SLURM_TASKS_PER_NODE": "8"}, None, 8),
            ({"LOCAL_WORLD_SIZE": "4", "SLURM_NTASKS_PER_NODE": "2"}, None, 4),
            ({"SLURM_NTASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "4(x2)"}, None, 2),
            ({"LOCAL_WORLD_SIZE": "4", "SLURM_NTASKS_PER_NODE": "2"}, 1, 1),
            ({"LOCAL_WORLD_SIZE": "9"}, 8, 8),  # explicit wins, even over a misfit
            ({"LOCAL_WORLD_SIZE": " 4 "}, None, 4),
            ({"LOCAL_WORLD_SIZE": ""}, None, None),  # set but empty: unset
            ({"LOCAL_WORLD_SIZE": "8"}, None, 8),  # equal: one node
            # Slurm values that are not a plain count (or not one for every node): unset.
            ({"SLURM_NTASKS_PER_NODE": "4(x2)"}, None, None),
            ({"SLURM_NTASKS_PER_NODE": "abc", "SLURM_TASKS_PER_NODE": "2(x4)"}, None, 2),
            ({"SLURM_NTASKS_PER_NODE": "0"}, None, None),
            ({"SLURM_NTASKS_PER_NODE": "-2"}, None, None),
            ({"SLURM_TASKS_PER_NODE": "4(x2),2"}, None, None),
            ({"SLURM_TASKS_PER_NODE": "4(x"}, None, None),
            ({"SLURM_TASKS_PER_NODE": "4(x0)"}, None, None),
            ({"SLURM_TASKS_PER_NODE": ",,"}, None, None),
        ],
    )
    def test_value(self, env: dict[str, str], explicit: int | None, expected: int | None) -> None:
        assert local_world_size(8, explicit, read_environment(env)) == expected

    @pytest.mark.parametrize("bad", [0, -1, 9, True, False, 2.0, "2"])
    def test_bad_argument(self, bad: object) -> None:
        with pytest.raises(ValueError, match="local_world_size"):
            local_world_size(8, bad)  # type: ignore[arg-type]

    @pytest.mark.parametrize(
        ("name", "raw"),
        [
            ("LOCAL_WORLD_SIZE", "9"),
            ("LOCAL_WORLD_SIZE", "0"),
            ("LOCAL_WORLD_SIZE", "four"),
            ("LOCAL_WORLD_SIZE", "4.0"),
            ("LOCAL_WORLD_SIZE", "-1"),
            ("SLURM_NTASKS_PER_NODE", "9"),
            ("SLURM_TASKS_PER_NODE", "16(x2)"),
        ],
    )
    def test_misfit_environment_names_the_variable(self, name: str, raw: str) -> None:
        with pytest.raises(ValueError, match=name):
            local_world_size(8, None, read_environment({name: raw}))


class TestSent:
    """What the client puts in every begin, on a real socket."""

    @pytest.mark.parametrize(
        ("name", "raw"),
        [
            ("LOCAL_WORLD_SIZE", "2"),
            ("SLURM_NTASKS_PER_NODE", "2"),
            ("SLURM_TASKS_PER_NODE", "2(x4)"),
        ],
    )
    def test_from_each_variable(
        self,
        peer: ScriptedDaemon,
        short_dir: Path,
        root: Path,
        monkeypatch: pytest.MonkeyPatch,
        name: str,
        raw: str,
    ) -> None:
        monkeypatch.setenv(name, raw)
        with _client(short_dir) as client:
            handle = client.save(str(root), 1, 5, 8)
            handle.seal()
            assert client.flush(30.0)
        assert peer.next_request("begin", step=1)["local_world_size"] == 2

    def test_nothing_said_sends_none(
        self, peer: ScriptedDaemon, short_dir: Path, root: Path
    ) -> None:
        with _client(short_dir) as client:
            assert client.begin(str(root), 1, 0, 4).acknowledged
        assert peer.next_request("begin", step=1)["local_world_size"] is None

    def test_precedence(
        self, peer: ScriptedDaemon, short_dir: Path, root: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
        monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
        monkeypatch.setenv("SLURM_TASKS_PER_NODE", "1(x8)")
        for step, unset in ((1, None), (2, "LOCAL_WORLD_SIZE"), (3, "SLURM_NTASKS_PER_NODE")):
            if unset is not None:
                monkeypatch.delenv(unset)
            with _client(short_dir) as client:
                client.begin(str(root), step, 0, 8)
        sent = [peer.next_request("begin", step=s)["local_world_size"] for s in (1, 2, 3)]
        assert sent == [4, 2, 1]

    def test_read_once_when_the_client_is_created(
        self, peer: ScriptedDaemon, short_dir: Path, root: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
        with _client(short_dir) as client:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
            client.begin(str(root), 1, 0, 8)
            assert client.resolve_local_world_size(8) == 4
            assert client.resolve_local_world_size(8, 3) == 3
        assert peer.next_request("begin", step=1)["local_world_size"] == 4

    def test_explicit_argument_wins_on_every_path(
        self, peer: ScriptedDaemon, short_dir: Path, root: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
        monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
        landed: Future[None] = Future()
        landed.set_result(None)
        with _client(short_dir) as client:
            client.begin(str(root), 1, 0, 8, local_world_size=1)
            client.begin_nowait(str(root), 2, 0, 8, local_world_size=2).result()
            client.save(str(root), 3, 0, 8, local_world_size=3).seal()
            client.save(str(root), 4, 0, 8, wait=False, local_world_size=5).seal()
            client.track(str(root), 6, 0, 8, landed, local_world_size=6)
            assert client.flush(30.0)
        sent = [peer.next_request("begin", step=s)["local_world_size"] for s in (1, 2, 3, 4, 6)]
        assert sent == [1, 2, 3, 5, 6]

    def test_track_with_a_handle_keeps_its_begin(
        self, peer: ScriptedDaemon, short_dir: Path, root: Path
    ) -> None:
        landed: Future[None] = Future()
        landed.set_result(None)
        with _client(short_dir) as client:
            handle = client.save(str(root), 1, 0, 8, wait=False, local_world_size=2)
            assert handle.local_world_size == 2
            with pytest.raises(ValueError, match="local_world_size=2"):
                client.track(str(root), 1, 0, 8, landed, handle=handle, local_world_size=4)
            client.track(str(root), 1, 0, 8, landed, handle=handle, local_world_size=2)
            assert handle.wait_local(30.0)
            assert client.flush(30.0)
        assert peer.next_request("begin", step=1)["local_world_size"] == 2
        assert peer.next_request("done", step=1)
        assert [r["op"] for r in peer.seen].count("begin") == 1


class TestRefusedBeforeSending:
    """A count that cannot be right raises ValueError, and nothing reaches the daemon."""

    @pytest.mark.parametrize("bad", [0, 5, True, 2.5])
    def test_bad_argument(
        self, peer: ScriptedDaemon, short_dir: Path, root: Path, bad: object
    ) -> None:
        landed: Future[None] = Future()
        landed.set_result(None)
        with _client(short_dir) as client:
            calls: list[Callable[[], object]] = [
                lambda: client.begin(str(root), 1, 0, 4, local_world_size=bad),  # type: ignore[arg-type]
                lambda: client.begin_nowait(str(root), 1, 0, 4, local_world_size=bad),  # type: ignore[arg-type]
                lambda: client.save(str(root), 1, 0, 4, local_world_size=bad),  # type: ignore[arg-type]
                lambda: client.track(str(root), 1, 0, 4, landed, local_world_size=bad),  # type: ignore[arg-type]
            ]
            for call in calls:
                with pytest.raises(ValueError, match="local_world_size"):
                    call()
            assert client.ping(30.0)  # everything before it was read by the peer
            assert client.flush(30.0)
        assert peer.drain() == ["ping"]
        assert not (root / "tmp_step_1").exists()

    def test_misfit_environment(
        self, peer: ScriptedDaemon, short_dir: Path, root: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        for raw in ("8", "eight"):
            monkeypatch.setenv("LOCAL_WORLD_SIZE", raw)
            with _client(short_dir) as client:
                with pytest.raises(ValueError, match=f"LOCAL_WORLD_SIZE='{raw}'"):
                    client.save(str(root), 1, 0, 4)
                assert client.begin(str(root), 2, 0, 4, local_world_size=2).acknowledged
                assert client.ping(30.0)
        assert [r for r in peer.drain() if r != "ping"] == ["begin", "begin"]
        assert {r["step"] for r in peer.seen if r["op"] == "begin"} == {2}
        assert not (root / "tmp_step_1").exists()


class TestResent:
    """A begin re-sent after a reconnect carries the value it was first sent with."""

    def test_resent_after_a_reconnect(
        self, peer: ScriptedDaemon, short_dir: Path, root: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        with _client(short_dir) as client:
            explicit = client.save(str(root), 1, 3, 8, local_world_size=4)
            from_env = client.save(str(root), 2, 3, 8)
            assert explicit.attempt == from_env.attempt == "att-1"
            peer.hang_up()  # as a daemon that restarts does
            again = {
                s: peer.next_request("begin", step=s, resent=True)["local_world_size"]
                for s in (1, 2)
            }
            assert again == {1: 4, 2: 2}
            explicit.seal()
            from_env.seal()
            assert client.flush(30.0)

    def test_queued_while_the_daemon_is_down(
        self, short_dir: Path, root: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
        scripted = None
        try:
            with _client(short_dir) as client:
                pending = client.begin_nowait(str(root), 1, 0, 8)
                assert not pending.result().acknowledged  # nobody listens yet
                scripted = ScriptedDaemon(short_dir / "peer.sock", root)
                assert client.flush(30.0)
            assert scripted.next_request("begin", step=1)["local_world_size"] == 2
        finally:
            if scripted is not None:
                scripted.close()


class TestRealDaemon:
    """``ckptd serve`` takes the field: a single-node step still promotes."""

    def test_single_node_from_env_promotes(
        self,
        start: Callable[..., DaemonProcess],
        root: Path,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # both ranks on this node
        daemon = start([root])
        with CheckpointClient(str(daemon.socket_path), begin_timeout=30.0) as client:
            handles = [client.save(str(root), 1, rank, 2) for rank in (0, 1)]
            assert all(h.begun.acknowledged for h in handles)
            for rank, handle in enumerate(handles):
                (Path(handle.path) / f"r{rank}.bin").write_bytes(b"r" * 10)
                handle.add_files([FileEntry(f"r{rank}.bin", 10)])
                handle.seal()
            assert client.wait(str(root), 1, 30.0).state == "promoted"
        assert (root / "step_1").is_dir()


class TestAsyncSave:
    """``orchestrator.async_save`` in a real 2-rank gloo job passes the value on."""

    def test_env_explicit_and_refused(
        self, peer: ScriptedDaemon, short_dir: Path, root: Path
    ) -> None:
        port = free_port()
        saves = ["1:-", "2:2", "3:3", "4:-", "5:2@1", "6:1@1"]
        cmd = [str(WORKER), "--root", str(root), *saves]
        lines: list[dict[str, object]] = []
        procs = [
            start_rank(cmd, rank, 2, port, short_dir / "peer.sock", {"LOCAL_WORLD_SIZE": "1"})
            for rank in (0, 1)
        ]
        pumps = [pump_lines(proc, rank, lines.append) for rank, proc in enumerate(procs)]
        try:
            codes = [proc.wait(120) for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        for pump in pumps:
            pump.join(30)
        assert codes == [0, 0], json.dumps(lines)[-4000:]
        events = {(line["event"], line.get("rank"), line.get("step")) for line in lines}
        for rank in (0, 1):
            assert {("saved", rank, s) for s in (1, 2, 4, 6)} <= events
            assert {("refused", rank, 3), ("refused", rank, 5)} <= events
        errors = {
            (line["rank"], line["step"]): str(line["error"])
            for line in lines
            if line["event"] == "refused"
        }
        assert all("local_world_size=3" in errors[(rank, 3)] for rank in (0, 1))
        assert all("begun with local_world_size=1" in errors[(rank, 5)] for rank in (0, 1))
        sent = {}
        for _ in range(10):
            begin = peer.next_request("begin")
            sent[(begin["step"], begin["rank"])] = begin["local_world_size"]
        # Step 1 waits for the answer before DCP's call (the root's layout is unknown);
        # steps 2 and 4 send it after (known from step 1's answer); 5 and 6 are begun by
        # the caller's handle.
        assert sent == {
            (s, r): n for s, n in ((1, 1), (2, 2), (4, 1), (5, 1), (6, 1)) for r in (0, 1)
        }
        assert 3 not in {r["step"] for r in peer.seen if r["op"] == "begin"}
        assert not (root / "tmp_step_3").exists()
        assert (root / "tmp_step_4" / ".metadata").is_file()
        assert not (root / "tmp_step_5" / ".metadata").exists()  # refused: nothing written
        assert (root / "tmp_step_6" / ".metadata").is_file()

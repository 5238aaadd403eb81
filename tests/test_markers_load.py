"""What one look at a spanning save's shared directory costs (docs/multinode.md, "The load")."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from daemon.config._config import RootConfig, load_config
from daemon.nodes._waker import stretched
from daemon.store._attempts import encode_marker
from daemon.store._markers import (
    REREADS_PER_S,
    WRITING_REREAD,
    NodeMarker,
    NodeState,
    marker_name,
    read_markers,
    read_outcome,
    write_marker,
    write_verdict,
)
from orchestrator.protocol import ATTEMPT_MARKER
from tests._syscalls import traced


def _root(tmp_path: Path) -> RootConfig:
    root = RootConfig(path=str(tmp_path))
    tmp = Path(root.tmp_dir(1))
    tmp.mkdir()
    (tmp / ATTEMPT_MARKER).write_text(json.dumps({"attempt": "a1"}))
    return root


def _marker(state: NodeState, node: str = "n1") -> NodeMarker:
    return NodeMarker(
        node=node, attempt="a1", step=1, world_size=2, local_world_size=1, state=state
    )


class TestLeadersLook:
    """The leader's look lists the directory and reads only the markers that were replaced."""

    def test_the_same_file_is_not_measured_or_read_again(self, tmp_path: Path) -> None:
        root = _root(tmp_path)
        write_marker(root, 1, _marker("done"))
        seen: dict[str, tuple[int, int, int, float]] = {}
        assert [m.node for m in read_markers(root, 1, seen)] == ["n1"]
        # Its attributes change in place, its inode (which the listing gives) does not:
        # a marker is only ever replaced by a rename, so this is the file already read.
        path = Path(root.tmp_dir(1)) / marker_name("n1")
        os.utime(path, ns=(1, 1))
        assert read_markers(root, 1, seen) == []

    def test_a_replaced_marker_is_read_again(self, tmp_path: Path) -> None:
        root = _root(tmp_path)
        write_marker(root, 1, _marker("writing"))
        seen: dict[str, tuple[int, int, int, float]] = {}
        assert [m.state for m in read_markers(root, 1, seen)] == ["writing"]
        write_marker(root, 1, _marker("done"))
        write_marker(root, 1, _marker("done", node="n2"))
        found = sorted((m.node, m.state) for m in read_markers(root, 1, seen))
        assert found == [("n1", "done"), ("n2", "done")]
        assert read_markers(root, 1, seen) == []

    def test_markers_read_together_are_read_again_no_faster_than_the_bound(
        self, tmp_path: Path
    ) -> None:
        root = _root(tmp_path)
        seen: dict[str, tuple[int, int, int, float]] = {}
        before = time.monotonic()
        # A whole job's markers in the first look, then more in the next.
        for batch in (range(100), range(100, 150)):
            for i in batch:
                write_marker(root, 1, _marker("writing", node=f"n{i}"), durable=False)
            assert len(read_markers(root, 1, seen)) == len(batch)
        due = sorted(last[3] for last in seen.values())
        assert due[0] >= before + WRITING_REREAD
        # Each due 1 / REREADS_PER_S after the one before: never more than REREADS_PER_S
        # of them in any second. (The slots are sums of floats: a second of them can come
        # out a rounding error short, hence the tolerance.)
        gap = 1.0 / REREADS_PER_S
        assert all(b - a >= gap - 1e-9 for a, b in zip(due, due[1:], strict=False))
        for i, t in enumerate(due):
            assert sum(1 for u in due[i:] if u < t + 1.0 - 1e-6) <= REREADS_PER_S


class TestWaitingNodesLook:
    """A waiting node's ordinary look reads the leader's verdict and nothing else."""

    def test_a_rename_without_a_verdict_is_seen_by_a_full_look_only(self, tmp_path: Path) -> None:
        root = _root(tmp_path)
        os.rename(root.tmp_dir(1), root.final_dir(1))
        manifest = Path(root.final_dir(1)) / ".ckptd-manifest.json"
        manifest.write_bytes(msgspec.json.encode({"attempt": "a1"}))
        full = read_outcome(root, 1, "a1")
        assert full is not None and full.state == "renamed"
        assert read_outcome(root, 1, "a1", full=False) is None

    def test_the_verdict_is_seen_by_every_look(self, tmp_path: Path) -> None:
        root = _root(tmp_path)
        assert read_outcome(root, 1, "a1", full=False) is None
        write_verdict(root, 1, "a1", "n0", "", promoted=True)
        light = read_outcome(root, 1, "a1", full=False)
        assert light is not None and light.state == "promoted"
        write_verdict(root, 1, "a1", "n0", "a rank failed")
        light = read_outcome(root, 1, "a1", full=False)
        assert light is not None and (light.state, light.detail) == ("failed", "a rank failed")


class TestPollBudget:
    """A job's nodes together look about poll_budget times a second, however many they are."""

    @pytest.mark.parametrize(("nodes", "seconds"), [(2, 2 / 1500), (4096, 4096 / 1500)])
    def test_each_nodes_interval_is_stretched(self, nodes: int, seconds: float) -> None:
        assert stretched(RootConfig(path="/ckpt"), nodes) == pytest.approx(seconds)

    def test_the_budget_is_configured_per_root(self, tmp_path: Path) -> None:
        file = tmp_path / "c.toml"
        file.write_text(f'[[roots]]\npath = "{tmp_path}"\npoll_budget = 400\n')
        root = load_config(config_file=str(file), env={}).roots[0]
        assert root.poll_budget == 400
        assert stretched(root, 4096) == pytest.approx(4096 / 400)


class TestWhatALookCosts:
    """Counted by strace: the calls by path (each a lookup on the server) a look makes."""

    def test_a_replaced_marker_is_opened_and_measured_through_the_open_file(
        self, tmp_path: Path
    ) -> None:
        root = _root(tmp_path)
        for node in ("n1", "n2", "n3"):
            write_marker(root, 1, _marker("done", node=node))
        code = (
            "from daemon.config._config import RootConfig\n"
            "from daemon.store._markers import read_markers\n"
            f"found = read_markers(RootConfig(path={str(tmp_path)!r}), 1, {{}})\n"
            "assert sorted(m.node for m in found) == ['n1', 'n2', 'n3'], found\n"
        )
        calls = traced(code, tmp_path)
        for node in ("n1", "n2", "n3"):
            name = f"tmp_step_1/{marker_name(node)}"
            assert calls[("open", name)] == 1
            assert calls[("stat", name)] == 0  # one lookup a marker, not two
            assert calls[("fstat", name)] == 1


class TestWhatAScanCosts:
    """The leader's verification measures the checkpoint's files, not the node markers."""

    def test_node_markers_are_not_measured(self, tmp_path: Path) -> None:
        root = _root(tmp_path)
        tmp = Path(root.tmp_dir(1))
        for node in ("n1", "n2", "n3"):
            write_marker(root, 1, _marker("done", node=node))
        (tmp / "shards").mkdir()
        (tmp / "shards" / "a.bin").write_bytes(b"a" * 10)
        (tmp / "b.bin").write_bytes(b"b" * 20)
        code = (
            "from daemon.config._config import RootConfig\n"
            "from daemon.store._verify import scan_save\n"
            "from orchestrator.protocol import FileEntry\n"
            f"root = RootConfig(path={str(tmp_path)!r})\n"
            "m = scan_save(root, 1, 2, {0: (FileEntry('b.bin', 20),)})\n"
            "assert m.files == {'b.bin': 20, 'shards/a.bin': 10}, m.files\n"
        )
        calls = traced(code, tmp_path)
        assert calls[("stat", "tmp_step_1/b.bin")] == 1
        assert calls[("stat", "tmp_step_1/shards/a.bin")] == 1
        for node in ("n1", "n2", "n3"):
            assert calls[("stat", f"tmp_step_1/{marker_name(node)}")] == 0


_FOLLOWER = """
import anyio, json, os, sys
from daemon.config._config import Config, RootConfig
from daemon.server._server import Daemon
from orchestrator import protocol as p

ROOT, HOME, WORLD = sys.argv[1], sys.argv[2], int(sys.argv[3])
root = RootConfig(path=ROOT, watch="poll")
config = Config(socket=os.path.join(HOME, "n1.sock"), roots=(root,), state_dir=HOME,
                node="n1", node_timeout=3600.0, root_threads=1, lease=3600.0)
marker = os.path.join(root.tmp_dir(1), ".ckptd-node-n1.json")

def written(state):
    try:
        with open(marker) as fh:
            return json.load(fh)["state"] == state
    except (OSError, ValueError):
        return False

async def until(state):
    with anyio.fail_after(60):
        while not written(state):
            await anyio.sleep(0.01)  # the file is the event: no daemon to ask

async def main():
    daemon = Daemon(config)
    async with anyio.create_task_group() as group:
        daemon.nodes.group = daemon.attempt_dirs.group = daemon.promoter.group = group
        await daemon.dispatch(1, p.Begin(id=1, root=ROOT, step=1, rank=1,
                                         world_size=WORLD, local_world_size=1))
        await until("writing")
        files = [p.FileEntry("rank1.bin", 4096)]
        await daemon.dispatch(1, p.Done(id=2, root=ROOT, step=1, rank=1, files=files))
        await until("done")
        daemon.nodes.close()
        group.cancel_scope.cancel()

anyio.run(main)
"""


class TestWhatADoneCosts:
    """A node whose ranks are done reads the leader's verdict, and nothing more, first."""

    def test_a_done_node_looks_only_for_the_verdict_before_its_marker(self, tmp_path: Path) -> None:
        root = tmp_path / "run"
        home = tmp_path / "home"
        root.mkdir()
        home.mkdir()
        config = RootConfig(path=str(root))
        tmp = Path(config.tmp_dir(1))
        tmp.mkdir()
        world = 4096  # one rank a node: a node looks for the verdict every 2.7 s
        (tmp / ATTEMPT_MARKER).write_bytes(encode_marker(config, 1, "a1", world, ""))
        (tmp / "rank1.bin").write_bytes(b"\0" * 4096)
        script = tmp_path / "follower.py"
        script.write_text(_FOLLOWER)
        code = f"import sys; sys.argv = ['f', {str(root)!r}, {str(home)!r}, '{world}']\n"
        code += f"exec(open({str(script)!r}).read())\n"
        calls = traced(code, root)
        # The watch's first look, from the first begin, is a full one (step_N's
        # manifest, the attempt's marker); the look before the marker reads the verdict.
        assert calls[("open", "step_1/.ckptd-manifest.json")] == 1
        verdicts = [n for (kind, n), k in calls.items() if kind == "open" and "verdicts" in n]
        assert verdicts, calls


_LEADER = """
import anyio, json, os, sys
from daemon.config._config import Config, RootConfig
from daemon.server._server import Daemon
from daemon.store._markers import NodeMarker, write_marker
from orchestrator import protocol as p

ROOT, HOME, FLUSHED = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
root = RootConfig(path=ROOT, watch="poll")
config = Config(socket=os.path.join(HOME, "n0.sock"), roots=(root,), state_dir=HOME,
                node="n0", node_timeout=3600.0, root_threads=1, lease=3600.0)

async def main():
    daemon = Daemon(config)
    async with anyio.create_task_group() as group:
        daemon.nodes.group = daemon.attempt_dirs.group = daemon.promoter.group = group
        begin = p.Begin(id=1, root=ROOT, step=1, rank=0, world_size=2, local_world_size=1)
        await daemon.dispatch(1, begin)
        tmp = root.tmp_dir(1)
        with open(os.path.join(tmp, ".ckptd-attempt")) as fh:
            attempt = json.load(fh)["attempt"]
        os.chdir(tmp)  # the ranks' writes, by relative paths: not counted as the daemon's
        for rank in (0, 1):
            with open(f"rank{rank}.bin", "wb") as fh:
                fh.write(bytes(4096))
        # Node n1's word, in the format and by the function its daemon writes it with.
        files = {"1": [p.FileEntry("rank1.bin", 4096)]}
        marker = NodeMarker(node="n1", attempt=attempt, step=1, world_size=2,
                            local_world_size=1, state="done", files=files, flushed=FLUSHED)
        write_marker(root, 1, marker)
        done = p.Done(id=2, root=ROOT, step=1, rank=0, files=[p.FileEntry("rank0.bin", 4096)])
        await daemon.dispatch(1, done)
        reply = await daemon.settled(p.Wait(id=3, root=ROOT, step=1, timeout=60.0), root)
        assert reply.state == "promoted", reply
        daemon.nodes.close()
        group.cancel_scope.cancel()

anyio.run(main)
"""


class TestWhatAPromotionCosts:
    """The leader flushes what its own ranks wrote; another node flushed its own."""

    def _promote(self, tmp_path: Path, *, flushed: bool) -> Counter[tuple[str, str]]:
        root = tmp_path / "run"
        home = tmp_path / "home"
        root.mkdir()
        home.mkdir()
        script = tmp_path / "leader.py"
        script.write_text(_LEADER)
        argv = ["l", str(root), str(home), "1" if flushed else "0"]
        code = f"import sys; sys.argv = {argv!r}\nexec(open({str(script)!r}).read())\n"
        return traced(code, root)

    def test_a_node_flushes_the_files_it_checks(self, tmp_path: Path) -> None:
        root = _root(tmp_path)
        (Path(root.tmp_dir(1)) / "w.bin").write_bytes(b"w" * 10)
        code = (
            "from daemon.config._config import RootConfig\n"
            "from daemon.store._markers import check_files\n"
            "from orchestrator.protocol import FileEntry\n"
            f"root = RootConfig(path={str(tmp_path)!r})\n"
            "assert check_files(root, 1, {1: [FileEntry('w.bin', 10)]}) == []\n"
        )
        calls = traced(code, tmp_path)
        assert calls[("fsync", "tmp_step_1/w.bin")] == 1
        assert calls[("open", "tmp_step_1/w.bin")] == 1

    def test_files_their_node_flushed_are_not_flushed_again(self, tmp_path: Path) -> None:
        calls = self._promote(tmp_path, flushed=True)
        assert calls[("fsync", "step_1/rank0.bin")] + calls[("fsync", "tmp_step_1/rank0.bin")] == 1
        assert calls[("open", "tmp_step_1/rank1.bin")] == 0
        assert calls[("fsync", "tmp_step_1/rank1.bin")] == 0

    def test_a_marker_that_does_not_say_flushed_is_flushed_by_the_leader(
        self, tmp_path: Path
    ) -> None:
        calls = self._promote(tmp_path, flushed=False)  # a node of an older daemon
        assert calls[("fsync", "tmp_step_1/rank1.bin")] == 1

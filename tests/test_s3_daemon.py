"""Real daemons and real multi-rank DCP jobs on an ``s3://`` root served by SeaweedFS.

Each rank uploads straight to the store; the daemon verifies by LIST and ``.metadata``
and commits with one create-only write. Killed at every step of that commit (SIGKILL,
by crash point) and restarted, it commits exactly once; two daemons racing for one step
leave one commit; a rank that dies mid-upload leaves nothing committed, and the step is
saved again at once; a denied credential fails only its own root.
"""

from __future__ import annotations

import json
import queue
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from daemon.base._faults import S3_POINTS
from daemon.cli import main
from orchestrator import CheckpointClient
from tests._ranks import free_port, pump_lines, start_rank
from tests._s3 import LyingProxy, S3Server, serve, start_seaweedfs
from tests.conftest import REPO, DaemonProcess

pytestmark = pytest.mark.slow

WORKER = REPO / "tests" / "_s3_worker.py"


@pytest.fixture(scope="module")
def seaweed() -> Iterator[S3Server]:
    yield from serve("seaweedfs")


class Job:
    """``world`` real rank processes of ``tests/_s3_worker.py``."""

    def __init__(
        self, socket: Path | list[Path], env: dict[str, str], root: str, world: int, *args: str
    ) -> None:
        sockets = socket if isinstance(socket, list) else [socket] * world
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pumps: list[threading.Thread] = []
        for rank in range(world):
            proc = start_rank([str(WORKER), root, *args], rank, world, port, sockets[rank], env)
            self.procs.append(proc)
            self.pumps.append(pump_lines(proc, rank, self.lines.put))

    def wait_line(self, event: str, timeout: float = 90.0, **match: Any) -> dict[str, Any]:
        """The next line ``event`` whose fields match, failing after ``timeout``."""
        for line in self.seen:
            if line.get("event") == event and all(line.get(k) == v for k, v in match.items()):
                self.seen.remove(line)
                return line
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                raise AssertionError(f"no {event} {match} in {timeout}s: {self.seen}") from None
            if line.get("event") == event and all(line.get(k) == v for k, v in match.items()):
                return line
            self.seen.append(line)

    def wait(self, timeout: float = 90.0) -> list[int]:
        codes = [p.wait(timeout) for p in self.procs]
        for pump in self.pumps:
            pump.join(timeout)
        return codes

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
        for pump in self.pumps:
            pump.join(30)


@pytest.fixture
def jobs() -> Iterator[Callable[..., Job]]:
    started: list[Job] = []

    def make(*args: Any) -> Job:
        job = Job(*args)
        started.append(job)
        return job

    yield make
    for job in started:
        job.kill()


@pytest.fixture
def daemons(short_dir: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """Real ``ckptd serve`` processes whose roots are given as flags (URLs are no Paths)."""
    started: list[DaemonProcess] = []

    def make(roots: list[str], env: dict[str, str], name: str = "d", *extra: str) -> DaemonProcess:
        flags = [arg for r in roots for arg in ("--root", r)]
        daemon = DaemonProcess(
            short_dir / f"{name}.sock",
            [],
            *flags,
            *extra,
            "--lease",
            "2",
            state_dir=short_dir / f"{name}.state",
            env=env,
        )
        started.append(daemon)
        return daemon.start()

    yield make
    for daemon in started:
        daemon.kill()
        if daemon.proc is not None and daemon.proc.stdout is not None:
            daemon.proc.stdout.close()


def commit_of(server: S3Server, root: str, step: int) -> dict[str, Any] | None:
    keys = server.keys(root)
    name = f"step_{step}/.ckptd-commit.json"
    if name not in keys:
        return None
    body = server.client().get_object(Bucket=server.bucket, Key=f"{root.split('/', 3)[3]}/{name}")[
        "Body"
    ]
    with body:
        found: dict[str, Any] = msgspec.json.decode(body.read())
    return found


class TestSaveAndLoad:
    """A real 2-rank DCP save lands in the store, is committed, and loads back."""

    def test_promoted_and_loaded(
        self,
        seaweed: S3Server,
        daemons: Callable[..., DaemonProcess],
        jobs: Callable[..., Job],
        capsys: pytest.CaptureFixture[str],
    ) -> None:
        root = seaweed.root()
        daemon = daemons([root], seaweed.env())
        job = jobs(daemon.socket_path, seaweed.env(), root, 2, "--step", "3", "--load")
        promoted = daemon.wait_event("checkpoint.promoted", timeout=90)
        attempt = promoted["attempt"]
        assert promoted["path"] == f"{root}/step_3/{attempt}"
        for rank in (0, 1):
            assert job.wait_line("loaded", rank=rank)["same"] is True
        assert job.wait() == [0, 0]
        commit = commit_of(seaweed, root, 3)
        assert commit is not None and commit["attempt"] == attempt
        keys = seaweed.keys(root)
        # Every object of the attempt is in the commit, with its size; none other is.
        mine = {
            k.split("/", 2)[2]: size
            for k, size in keys.items()
            if k.startswith(f"step_3/{attempt}/") and not k.rsplit("/", 1)[-1].startswith(".ckptd-")
        }
        assert {k: v[0] for k, v in commit["objects"].items()} == mine
        assert ".metadata" in commit["metadata"]
        # The operator's view of the root.
        env = seaweed.env()
        with pytest.MonkeyPatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            patch.setenv("CKPTD_SOCKET", str(daemon.socket_path))
            capsys.readouterr()
            assert main(["latest", root]) == 0
            assert capsys.readouterr().out.strip() == f"{root}/step_3/{attempt}"
            assert main(["verify", f"{root}/step_3"]) == 0
            verified = capsys.readouterr().out
            assert "size and ETag recorded at the commit" in verified
            assert "  not checked: contents: no object is read" in verified
            # A committed step is not promoted again.
            assert main(["promote", root, "3", "--socket", str(daemon.socket_path)]) == 1
            assert "already promoted" in capsys.readouterr().err
            assert main(["ls", root]) == 0
            listing = capsys.readouterr().out
            assert "3 *   promoted" in listing and f"{root}/step_3/{attempt}" in listing


class TestCrash:
    """A daemon SIGKILLed at each step of the commit, restarted, commits exactly once."""

    @pytest.mark.parametrize("point", S3_POINTS)
    def test_killed_and_restarted(
        self,
        seaweed: S3Server,
        daemons: Callable[..., DaemonProcess],
        jobs: Callable[..., Job],
        point: str,
    ) -> None:
        root = seaweed.root()
        env = {**seaweed.env(), "CKPTD_CRASH_AT": point}
        daemon = daemons([root], env)
        job = jobs(daemon.socket_path, seaweed.env(), root, 2, "--step", "4")
        daemon.wait_event("_exit", timeout=90)
        assert daemon.proc is not None and daemon.proc.wait(10) == 137
        committed = commit_of(seaweed, root, 4)
        if point in ("before_intent", "after_intent"):
            assert committed is None  # killed before the commit object
        else:
            assert committed is not None
        again = DaemonProcess(
            daemon.socket_path, [], *daemon.extra, state_dir=daemon.state_dir, env=seaweed.env()
        )
        again.start()
        try:
            assert job.wait() == [0, 0]
            with CheckpointClient(str(daemon.socket_path)) as client:
                outcome = client.wait(root, 4, timeout=60)
            assert outcome.state == "promoted", outcome
            commit = commit_of(seaweed, root, 4)
            assert commit is not None
            if committed is not None:
                assert commit == committed  # never written twice
            assert outcome.path == f"{root}/step_4/{commit['attempt']}"
            pointer = seaweed.client().get_object(
                Bucket=seaweed.bucket, Key=f"{root.split('/', 3)[3]}/latest"
            )["Body"]
            with pointer:
                assert msgspec.json.decode(pointer.read())["step"] == 4
            promoted = [e for e in again.drain() if e["event"] == "checkpoint.promoted"]
            assert len(promoted) <= 1
        finally:
            again.kill()
            if again.proc is not None and again.proc.stdout is not None:
                again.proc.stdout.close()

    def test_lost_state_directory(
        self,
        seaweed: S3Server,
        daemons: Callable[..., DaemonProcess],
        jobs: Callable[..., Job],
    ) -> None:
        """The root is the truth: a daemon on an empty state directory finishes the save."""
        root = seaweed.root()
        env = {**seaweed.env(), "CKPTD_CRASH_AT": "before_intent"}
        daemon = daemons([root], env, "lost")
        job = jobs(daemon.socket_path, seaweed.env(), root, 2, "--step", "6")
        daemon.wait_event("_exit", timeout=90)
        assert commit_of(seaweed, root, 6) is None
        job.kill()  # the job is gone too: only the store knows its ranks were done
        shutil.rmtree(daemon.state_dir)
        again = DaemonProcess(
            daemon.socket_path, [], *daemon.extra, state_dir=daemon.state_dir, env=seaweed.env()
        )
        again.start()
        try:
            promoted = again.wait_event("checkpoint.promoted", timeout=60)
            assert promoted["step"] == 6
            commit = commit_of(seaweed, root, 6)
            assert commit is not None and commit["attempt"] == promoted["attempt"]
        finally:
            again.kill()
            if again.proc is not None and again.proc.stdout is not None:
                again.proc.stdout.close()


class TestRaces:
    """Two daemons with one root: exactly one commit of a step, the other stands down."""

    def test_two_daemons(
        self,
        seaweed: S3Server,
        daemons: Callable[..., DaemonProcess],
        jobs: Callable[..., Job],
    ) -> None:
        root = seaweed.root()
        first = daemons([root], seaweed.env(), "a")
        second = daemons([root], seaweed.env(), "b")
        env = seaweed.env()
        job_a = jobs(first.socket_path, env, root, 1, "--step", "7", "--run", "run-a")
        job_b = jobs(second.socket_path, env, root, 1, "--step", "7", "--run", "run-b")
        begun = [job.wait_line("begun", rank=0) for job in (job_a, job_b)]
        codes = [job.wait()[0] for job in (job_a, job_b)]
        commit = commit_of(seaweed, root, 7)
        assert commit is not None
        # Exactly one attempt is the step's; it is one of the two daemons'.
        won = [i for i, b in enumerate(begun) if b["attempt"] == commit["attempt"]]
        assert len(won) == 1, (begun, commit)
        winner, loser = won[0], 1 - won[0]
        assert codes[winner] == 0
        daemon = (first, second)[winner]
        with CheckpointClient(str(daemon.socket_path)) as client:
            outcome = client.wait(root, 7, timeout=60)
        assert outcome.state == "promoted"
        assert outcome.path == f"{root}/step_7/{commit['attempt']}"
        other = (first, second)[loser]
        if begun[loser]["attempt"] is None:
            # Its begin came after the commit: refused (already promoted), nothing written.
            assert codes[loser] != 0
        else:
            failed = other.wait_event("checkpoint.failed", timeout=60)
            assert "another daemon committed step 7 first" in failed["reason"], failed
            assert not [e for e in other.drain() if e["event"] == "checkpoint.promoted"]


class TestRankDies:
    """A rank killed mid-upload: nothing committed; the step is saved again at once."""

    def test_mid_upload(
        self,
        seaweed: S3Server,
        daemons: Callable[..., DaemonProcess],
        jobs: Callable[..., Job],
    ) -> None:
        root = seaweed.root()
        daemon = daemons([root], seaweed.env())
        env = seaweed.env()
        job = jobs(daemon.socket_path, env, root, 2, "--step", "5", "--die-mid-upload")
        begun = job.wait_line("begun", rank=0)
        job.wait_line("dying", rank=1)
        failed = daemon.wait_event("checkpoint.failed", timeout=90)
        assert failed["step"] == 5
        job.kill()
        assert commit_of(seaweed, root, 5) is None
        dead = begun["attempt"]
        assert any(k.startswith(f"step_5/{dead}/") for k in seaweed.keys(root))
        retry = jobs(daemon.socket_path, env, root, 2, "--step", "5", "--load", "--run", "r2")
        promoted = daemon.wait_event("checkpoint.promoted", timeout=90)
        assert promoted["attempt"] != dead
        for rank in (0, 1):
            assert retry.wait_line("loaded", rank=rank)["same"] is True
        assert retry.wait() == [0, 0]
        commit = commit_of(seaweed, root, 5)
        assert commit is not None and commit["attempt"] == promoted["attempt"]
        # The dead attempt's objects are kept apart, and none is in the commit.
        assert all(dead not in key for key in commit["objects"])


class TestIsolation:
    """A denied credential fails its own root with a clear error; the other root works."""

    def test_denied_credential(
        self,
        seaweed: S3Server,
        daemons: Callable[..., DaemonProcess],
        jobs: Callable[..., Job],
        tmp_path: Path,
    ) -> None:
        root = seaweed.root()
        local = tmp_path / "run"
        local.mkdir()
        env = {**seaweed.env(), "AWS_SECRET_ACCESS_KEY": "wrong"}
        daemon = daemons([root, str(local)], env)
        failed = daemon.wait_event(
            "root.store_unusable", timeout=60, match=lambda e: e["root"] == root
        )
        assert "denied" in failed["error"] and "credentials" in failed["error"]
        assert failed["refused"] is False
        with CheckpointClient(str(daemon.socket_path), begin_timeout=30) as client:
            refused = client.begin(root, 1, 0, 1)
            assert refused.error is not None and "denied" in refused.error.message
        job = jobs(daemon.socket_path, seaweed.env(), str(local), 1, "--step", "2")
        assert job.wait() == [0]
        promoted = daemon.wait_event("checkpoint.promoted", timeout=60)
        assert promoted["root"] == str(local)


class TestRetention:
    """The daemon's retention and gc on an s3:// root: commit objects first, pins kept."""

    def test_keep_last_pin_and_gc(
        self,
        seaweed: S3Server,
        jobs: Callable[..., Job],
        short_dir: Path,
        capsys: pytest.CaptureFixture[str],
    ) -> None:
        root = seaweed.root()
        toml = short_dir / "ckptd.toml"
        toml.write_text(f'[[roots]]\npath = "{root}"\n[roots.retention]\nkeep_last = 1\n')
        env = seaweed.env()
        daemon = DaemonProcess(
            short_dir / "r.sock", [], "--config", str(toml), "--lease", "2",
            state_dir=short_dir / "r.state", env=env,
        )  # fmt: skip
        daemon.start()
        try:
            first = jobs(daemon.socket_path, env, root, 1, "--step", "1")
            assert first.wait() == [0]
            daemon.wait_event("checkpoint.promoted", match=lambda e: e["step"] == 1)
            with pytest.MonkeyPatch.context() as patch:
                for key, value in env.items():
                    patch.setenv(key, value)
                assert main(["pin", root, "1", "--socket", str(daemon.socket_path)]) == 0
                for step in (2, 3):
                    job = jobs(daemon.socket_path, env, root, 1, "--step", str(step))
                    assert job.wait() == [0]
                    promoted = daemon.wait_event("checkpoint.promoted")
                    assert promoted["step"] == step
                retired = daemon.wait_event("checkpoint.retired", timeout=60)
                assert retired["step"] == 2
                keys = seaweed.keys(root)
                assert not [k for k in keys if k.startswith("step_2/")]
                assert "step_1/.ckptd-commit.json" in keys  # pinned
                assert "step_3/.ckptd-commit.json" in keys  # newest
                # A retired step is gone from ls too, though the store may list its prefix.
                socket = ["--socket", str(daemon.socket_path)]
                capsys.readouterr()
                assert main(["ls", root, "--json", *socket]) == 0
                listed = json.loads(capsys.readouterr().out)
                assert [(r["step"], r["state"]) for r in listed] == [
                    (1, "promoted"),
                    (3, "promoted"),
                ]
                # A failed attempt's objects are what gc takes; nothing of a checkpoint.
                dying = jobs(daemon.socket_path, env, root, 2, "--step", "4", "--die-mid-upload")
                dying.wait_line("dying", rank=1)
                daemon.wait_event("checkpoint.failed", timeout=90)
                dying.kill()
                assert [k for k in seaweed.keys(root) if k.startswith("step_4/")]
                capsys.readouterr()
                assert main(["ls", root, "--json", *socket]) == 0
                (failed,) = [r for r in json.loads(capsys.readouterr().out) if r["step"] == 4]
                assert failed["state"] == "failed"
                assert failed["path"].startswith(f"{root}/step_4/")  # never tmp_step_4 there
                assert main(["gc", root, "--yes", "--socket", str(daemon.socket_path)]) == 0
                assert "removed" in capsys.readouterr().out
                keys = seaweed.keys(root)
                assert not [k for k in keys if k.startswith("step_4/")]
                assert "step_3/.ckptd-commit.json" in keys
                assert "step_1/.ckptd-commit.json" in keys
                capsys.readouterr()
                assert main(["ls", root, *socket]) == 0
                listing = capsys.readouterr().out
                assert "unknown" not in listing and "tmp_step_" not in listing
                assert [line.split()[0] for line in listing.splitlines()[1:]] == ["1", "3"]
        finally:
            daemon.kill()
            assert daemon.proc is not None and daemon.proc.stdout is not None
            daemon.proc.stdout.close()

    def test_a_store_that_lies_is_refused(
        self, daemons: Callable[..., DaemonProcess], tmp_path: Path
    ) -> None:
        honest = start_seaweedfs(auth=False)
        proxy = LyingProxy(honest.endpoint)
        try:
            root = f"s3://{honest.bucket}/lied-to"
            env = {**honest.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
            local = tmp_path / "run"
            local.mkdir()
            daemon = daemons([root, str(local)], env)
            refused = daemon.wait_event("root.store_unusable", timeout=60)
            assert refused["refused"] is True and "ignores If-None-Match" in refused["error"]
            with CheckpointClient(str(daemon.socket_path), begin_timeout=30) as client:
                begun = client.begin(root, 1, 0, 1)
                assert begun.error is not None and "ignores If-None-Match" in begun.error.message
                assert client.begin(str(local), 1, 0, 1).acknowledged  # the other root works
        finally:
            proxy.close()
            honest.stop()


class TestNodes:
    """A save spanning two nodes' daemons on one s3:// root: markers and verdicts as objects."""

    @staticmethod
    def _two_nodes(
        seaweed: S3Server,
        daemons: Callable[..., DaemonProcess],
        jobs: Callable[..., Job],
        root: str,
    ) -> tuple[DaemonProcess, DaemonProcess, Callable[..., Job]]:
        """Daemons of nodes n0 (the leader) and n1, and a starter of a rank on each."""
        leader = daemons([root], seaweed.env(), "n0", "--node", "n0")
        follower = daemons([root], seaweed.env(), "n1", "--node", "n1")
        env = {**seaweed.env(), "LOCAL_WORLD_SIZE": "1"}
        sockets = [leader.socket_path, follower.socket_path]
        return leader, follower, lambda *args: jobs(sockets, env, root, 2, *args)

    def test_two_nodes(
        self,
        seaweed: S3Server,
        daemons: Callable[..., DaemonProcess],
        jobs: Callable[..., Job],
    ) -> None:
        root = seaweed.root()
        leader, follower, start = self._two_nodes(seaweed, daemons, jobs, root)
        job = start("--step", "8", "--load", "--run", "two-nodes")
        promoted = leader.wait_event("checkpoint.promoted", timeout=90)
        assert promoted["step"] == 8
        learned = follower.wait_event("checkpoint.promoted", timeout=90)
        assert learned["path"] == promoted["path"]
        for rank in (0, 1):
            assert job.wait_line("loaded", rank=rank)["same"] is True
        assert job.wait() == [0, 0]
        keys = seaweed.keys(root)
        attempt = promoted["attempt"]
        assert f"step_8/{attempt}/.ckptd-node-n0.json" in keys
        assert f"step_8/{attempt}/.ckptd-node-n1.json" in keys
        assert f"step_8/{attempt}/.ckptd-verdict.json" in keys

    def test_a_follower_rank_dies(
        self,
        seaweed: S3Server,
        daemons: Callable[..., DaemonProcess],
        jobs: Callable[..., Job],
    ) -> None:
        root = seaweed.root()
        leader, follower, start = self._two_nodes(seaweed, daemons, jobs, root)
        job = start("--step", "9", "--die-mid-upload", "--run", "r")
        begun = job.wait_line("begun", rank=0)
        job.wait_line("dying", rank=1)
        failed = leader.wait_event("checkpoint.failed", timeout=90)
        assert failed["step"] == 9
        follower.wait_event("checkpoint.failed", timeout=90)
        job.kill()
        assert commit_of(seaweed, root, 9) is None
        keys = seaweed.keys(root)
        assert f"step_9/{begun['attempt']}/.ckptd-verdict.json" in keys

"""Fast tiers (docs/tiers.md): save into a node-local tier, drain, restore.

Real daemons, real files, real signals. The nodes are simulated (``tests/_nodes.py``):
each has its own mount namespace, the shared durable root on a caching bindfs mount, and
its own fast tier, a private directory bound at the same path on every node. Ranks speak
the wire protocol, except in the single-node restore, a real DCP save and restore
through ``orchestrator.CheckpointManager`` with the fast tier on tmpfs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._nodes import Cluster, cluster, wait_until
from tests._ranks import free_port, start_rank
from tests._system import require_root, require_tool
from tests.conftest import REPO, DaemonProcess, LineClient

WORKER = REPO / "tests" / "_tiers_worker.py"


def tier_config(
    home: Path, root: Path, fast: Path, *, root_extra: str = "", **settings: Any
) -> Path:
    """A TOML file configuring ``root`` with the fast tier ``fast`` and ``settings``."""
    lines = ["[[roots]]", f'path = "{root}"', root_extra, "[roots.fast]", f'path = "{fast}"']
    lines += [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    path = home / f"tiers-{root.name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def save(
    client: LineClient, root: Path | str, step: int, files: dict[str, bytes], *, rank: int = 0,
    world: int = 1, local: int | None = None, run: str = "torchelastic:job:0",
    write: Callable[[str], Path] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One rank's save of ``step``: begin, write ``files`` where told, done; the begin reply."""
    fields: dict[str, Any] = {"local_world_size": local} if local is not None else {}
    begun = client.request(
        "begin", root=str(root), step=step, rank=rank, world_size=world, run=run, **fields
    )
    assert begun["ok"], begun
    base = write(begun["path"]) if write is not None else Path(begun["path"])
    for rel, data in files.items():
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / rel).write_bytes(data)
    entries = [{"path": rel, "size": len(data)} for rel, data in files.items()]
    done = client.request(
        "done", root=str(root), step=step, rank=rank, files=entries, attempt=begun["attempt"]
    )
    assert done["ok"], done
    return begun


def at(step: int, root: Path | None = None) -> Callable[[dict[str, Any]], bool]:
    """An event matcher: of ``step`` (and of ``root``)."""
    return lambda e: e["step"] == step and (root is None or e["root"] == str(root))


def sha(path: Path) -> str:
    """SHA-256 of a file."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- across nodes --------------------------------------------------------------------------


def with_fast_tiers(nodes: Cluster, **settings: Any) -> tuple[Path, list[Path]]:
    """Give each node its own fast tier at one path, and start its daemon with ``settings``.

    Returns:
        The path every node names, and each node's private directory bound there.
    """
    fast = nodes.base / "fast"  # the path every node names; bound privately in each
    fast.mkdir()
    private = []
    for node in nodes:
        own = nodes.base / f"{node.name}-fast"
        own.mkdir()
        private.append(own)
        bound = node.run(["mount", "--bind", str(own), str(fast)])
        assert bound.returncode == 0, bound.stderr
        config = tier_config(
            node.home, nodes.root, fast, root_extra='watch = "poll"\npoll_interval = 0.1',
            **settings,
        )  # fmt: skip
        node.start_daemon([], "--config", str(config))
    return fast, private


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[tuple[Cluster, Path, list[Path]]]:
    """Two nodes, each with its own fast tier at one path, and their daemons."""
    with cluster(2) as nodes:
        fast, private = with_fast_tiers(nodes, keep=3, drain_every_steps=2, node_timeout=20)
        yield nodes, fast, private


def save_on_both(nodes: Cluster, private: list[Path], step: int) -> None:
    """Rank r of a 2-rank job saves ``step`` on node r, one file each."""
    for rank, node in enumerate(nodes):
        with node.connect() as client:
            save(
                client, nodes.root, step, {f"model/r{rank}.bin": os.urandom(50_000)},
                rank=rank, world=2, local=1,
                write=lambda path, own=private[rank]: own / Path(path).name,  # type: ignore[misc]
            )  # fmt: skip


def restore_on_both(nodes: Cluster, run: str) -> list[dict[str, Any]]:
    """Both ranks of run ``run`` ask where to restore from, at once; the replies."""
    replies: list[dict[str, Any]] = [{}, {}]

    def ask(rank: int) -> None:
        replies[rank] = nodes[rank].request(
            "restore", root=str(nodes.root), rank=rank, world_size=2, local_world_size=1,
            run=run, timeout=30,
        )  # fmt: skip

    threads = [threading.Thread(target=ask, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return replies


@pytest.mark.slow
def test_two_nodes_save_locally_drain_and_restore(
    two_nodes: tuple[Cluster, Path, list[Path]],
) -> None:
    """Local promotion across nodes, a drain committed by the usual rules, restores.

    Restores come from the fast tier while both nodes hold their parts, and from the
    durable root for every rank once one node's tier is wiped.
    """
    nodes, fast, private = two_nodes
    n0, n1 = (node.daemon for node in nodes)
    assert n0 is not None and n1 is not None
    for step in (1, 2, 3):
        save_on_both(nodes, private, step)
        for daemon in (n0, n1):
            daemon.wait_event("tier.promoted", match=at(step))
    for own in private:
        assert (own / "step_3").is_dir() and os.readlink(own / "latest") == "step_3"
    # Step 2 is selected (every 2 steps): each node drains its part, the leader commits.
    n0.wait_event("checkpoint.promoted", match=lambda e: e["step"] == 2)
    for daemon in (n0, n1):
        drained = daemon.wait_event("tier.drained", match=lambda e: e["step"] == 2)
        assert drained["bytes"] == 50_000
    durable = nodes.backing_root / "step_2"
    for rank in (0, 1):
        copy = durable / "model" / f"r{rank}.bin"
        assert sha(copy) == sha(private[rank] / "step_2" / "model" / f"r{rank}.bin")
    assert not (nodes.backing_root / "step_3").exists()  # never selected
    deep = subprocess.run(
        [sys.executable, "-m", "daemon", "verify", "--deep", str(durable)],
        cwd=REPO, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert deep.returncode == 0, deep.stdout + deep.stderr

    # A restart: step 3 is complete in the fast tier, newer than durable step 2.
    replies = restore_on_both(nodes, "torchelastic:job:1")
    assert [(r.get("step"), r.get("tier")) for r in replies] == [(3, "fast")] * 2, replies
    assert replies[0]["path"] == str(fast / "step_3")

    # Node 1's tier is wiped (a replaced node): every rank restores durable step 2.
    for entry in private[1].iterdir():
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    replies = restore_on_both(nodes, "torchelastic:job:2")
    assert [(r.get("step"), r.get("tier")) for r in replies] == [(2, "durable")] * 2, replies
    assert replies[1]["path"] == str(nodes.root / "step_2")
    for daemon in (n0, n1):
        event = daemon.wait_event("tier.restore", match=lambda e: e["run"].endswith(":2"))
        assert event["source"] == "durable"

    # A rank failing on node 1 fails the step on node 0 at once, not at its node_timeout.
    run = "torchelastic:job:3"
    with nodes[1].connect() as client:
        begun = client.request(
            "begin", root=str(nodes.root), step=4, rank=1, world_size=2, local_world_size=1,
            run=run,
        )  # fmt: skip
        assert begun["ok"], begun
        failed = client.request(
            "fail", root=str(nodes.root), step=4, rank=1, reason="CUDA error: out of memory"
        )
        assert failed["ok"], failed
    with nodes[0].connect() as client:
        save(
            client, nodes.root, 4, {"model/r0.bin": b"0" * 1000}, rank=0, world=2, local=1,
            run=run, write=lambda path: private[0] / Path(path).name,
        )  # fmt: skip
    event = n0.wait_event("tier.failed", match=at(4), timeout=10)
    assert event["reason"] == "node n1 failed: rank 1 failed: CUDA error: out of memory"
    wait_until(lambda: not (private[1] / "tmp_step_4").exists(), 10, "n1's failed save removed")


@pytest.mark.slow
def test_two_nodes_restore_real_dcp_from_their_own_tiers(
    two_nodes: tuple[Cluster, Path, list[Path]],
) -> None:
    """Real DCP across two nodes: each node's fast tier holds what its rank reads.

    ``CheckpointManager`` saves with per-rank metadata on a tiered root spanning nodes;
    a restarted job loads the newest step on each node from that node's own tier.
    """
    nodes, fast, private = two_nodes
    port = free_port()

    def job(mode: str, restarts: int) -> list[dict[str, Any]]:
        procs = []
        for rank, node in enumerate(nodes):
            env = {
                "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port + restarts),
                "CKPTD_SOCKET": str(node.socket), "OMP_NUM_THREADS": "1",
                "TORCHELASTIC_RUN_ID": "dcp", "TORCHELASTIC_RESTART_COUNT": str(restarts),
            }  # fmt: skip
            cmd = [sys.executable, str(WORKER), mode, str(nodes.root), "11"]
            procs.append(node.popen(cmd, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        lines = []
        for proc in procs:
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, out.decode()[-3000:]
            lines += [json.loads(x) for x in out.decode().splitlines() if x.startswith("{")]
        return lines

    saved = job("save", 0)
    assert {(x["saved"], x["state"]) for x in saved} == {(11, "promoted"), (12, "promoted")}
    for rank, own in enumerate(private):
        names = {p.name for p in (own / "step_12" / "model").iterdir()}
        assert f"__{rank}.metadata" in names and ".metadata" not in names, names
        assert not any(n.startswith(f"__{1 - rank}_") for n in names), names  # its own only
    restored = job("restore", 1)
    assert restored == [{"restored": 12, "same": True, "latest": str(fast / "step_12")}] * 2, (
        restored
    )


# -- one node ------------------------------------------------------------------------------


def test_configuration_is_checked(tmp_path: Path) -> None:
    """A fast tier's settings are validated like every other setting."""
    from daemon.base._errors import ConfigError
    from daemon.config._config import load_config
    from daemon.config._tiers import FastTier

    root, fast = tmp_path / "run", tmp_path / "fast"
    root.mkdir()
    fast.mkdir()
    cases = {
        "keep = 0": "keep 0 must be from 1",
        'drain_ionice = "low"': "drain_ionice 'low' must be one of",
        "shiny = 1": "unknown keys in [roots.fast]",
    }
    for line, message in cases.items():
        config = tier_config(tmp_path, root, fast)
        config.write_text(config.read_text() + line + "\n")
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(config_file=str(config))
    inside = root / "fast"
    inside.mkdir()
    with pytest.raises(ConfigError, match="must not be inside its root"):
        load_config(config_file=str(tier_config(tmp_path, root, inside)))
    with pytest.raises(ConfigError, match="is not a directory"):
        load_config(config_file=str(tier_config(tmp_path, root, tmp_path / "missing")))
    loaded = load_config(
        config_file=str(tier_config(tmp_path, root, fast, keep=3, drain_every_steps=5))
    )
    tier = loaded.roots[0].fast
    assert tier is not None and (tier.path, tier.keep, tier.selects(10)) == (str(fast), 3, True)
    timed = FastTier(path=str(fast), drain_every_minutes=0.5)
    assert [timed.due(7, since) for since in (None, 10.0, 29.9, 30.0)] == [True, False, False, True]
    both = FastTier(path=str(fast), drain_every_steps=4, drain_every_minutes=1)
    assert [both.due(8, 5.0), both.due(9, 5.0), both.due(9, 61.0)] == [True, False, True]
    assert not FastTier(path=str(fast)).due(1, None)  # no rule: never (but on stop)

    from daemon.ops._commands import summary

    said = [line.strip() for line in summary(loaded) if "fast tier" in line]
    want = (
        f"fast tier: {fast}/tmp_step_N -> {fast}/step_N, keep 3; drains every 5 steps, the "
        "newest on stop (within 60s); uncapped, IO class idle"
    )
    assert said == [want]


def test_a_lagging_drain_skips_older_steps_and_keeps_undrained_ones(
    tmp_path: Path, short_dir: Path, start: Callable[..., DaemonProcess]
) -> None:
    """While a drain runs, a newer selected step replaces an older one waiting.

    Retention (keep 1) evicts the skipped step, never the one being drained before it
    is durable; the newest is drained next. The metrics count it all.
    """
    root, fast = tmp_path / "run", tmp_path / "fast"
    root.mkdir()
    fast.mkdir()
    config = tier_config(short_dir, root, fast, keep=1, drain_every_steps=1, drain_rate_mb_s=1.0)
    daemon = start([], "--config", str(config), "--metrics-listen", "127.0.0.1:0")
    port = daemon.wait_event("metrics.listening")["port"]
    with LineClient(daemon.socket_path) as client:
        save(client, root, 1, {"m/a.bin": os.urandom(1_500_000)})
        daemon.wait_event("tier.drain_started", match=at(1))
        for step in (2, 3):
            save(client, root, step, {"m/a.bin": os.urandom(1_000)})
            daemon.wait_event("tier.promoted", match=at(step))
    assert daemon.wait_event("tier.drain_skipped")["step"] == 2
    assert daemon.wait_event("tier.evicted", match=at(2))["durable"] is False
    daemon.wait_event("tier.drained", match=at(1), timeout=30)
    assert daemon.wait_event("tier.evicted", match=at(1))["durable"] is True
    daemon.wait_event("tier.drained", match=at(3), timeout=30)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_1", "step_3"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    series = f'root="{root}"'
    assert f'ckptd_tier_drains_total{{result="skipped",{series}}} 1.0' in text, text
    assert f"ckptd_tier_local_step{{{series}}} 3.0" in text
    assert f"ckptd_tier_drain_lag_steps{{{series}}} 0.0" in text


def test_a_later_run_replaces_a_step_and_restores_only_whole_steps(
    tmp_path: Path, short_dir: Path, start: Callable[..., DaemonProcess]
) -> None:
    """A run that saves a step an earlier run saved replaces it in the fast tier.

    A failed save's files never reach the next attempt. A restore offers a local step
    only while every file its ranks wrote is there.
    """
    root, fast = tmp_path / "run", tmp_path / "fast"
    root.mkdir()
    fast.mkdir()
    daemon = start([], "--config", str(tier_config(short_dir, root, fast)))
    with LineClient(daemon.socket_path) as client:
        # A failed save leaves nothing behind for the next attempt to mix with.
        begun = client.request("begin", root=str(root), step=1, rank=0, world_size=1, run="a:0")
        (Path(begun["path"]) / "junk.bin").write_bytes(b"junk")
        assert client.request("fail", root=str(root), step=1, rank=0, reason="boom")["ok"]
        assert daemon.wait_event("tier.failed", match=at(1))["reason"] == "rank 0 failed: boom"
        again = client.request("begin", root=str(root), step=1, rank=0, world_size=1, run="a:0")
        assert again["ok"] and not (Path(again["path"]) / "junk.bin").exists()
        for run, data in (("torchelastic:j:0", b"old" * 100), ("torchelastic:j:1", b"new" * 10)):
            save(client, root, 1, {"m/a.bin": data}, run=run)
            daemon.wait_event("tier.promoted", match=at(1))
            assert (fast / "step_1" / "m" / "a.bin").read_bytes() == data
        reply = client.request("restore", root=str(root), rank=0, world_size=1, run="r:1")
        assert (reply["step"], reply["tier"]) == (1, "fast"), reply
        (fast / "step_1" / "m" / "a.bin").unlink()
        save(client, root, 2, {"m/a.bin": b"2"}, run="torchelastic:j:1")
        daemon.wait_event("tier.promoted", match=at(2))
        (fast / "step_2" / "m" / "a.bin").write_bytes(b"22")  # not the size it was
        reply = client.request("restore", root=str(root), rank=0, world_size=1, run="r:2")
        assert (reply["step"], reply["tier"]) == (None, "durable"), reply
        # On one node, rank 0 alone asking is answered at once (not at node_timeout).
        for rank in (0, 1):
            save(client, root, 3, {f"m/{rank}.bin": b"3"}, rank=rank, world=2, run="j:2")
        daemon.wait_event("tier.promoted", match=at(3))
        reply = client.request(
            "restore", root=str(root), rank=0, world_size=2, run="r:3", timeout=5
        )
    assert (reply["step"], reply["tier"]) == (3, "fast"), reply


def test_ranks_beginning_at_once_share_one_save(
    tmp_path: Path, short_dir: Path, start: Callable[..., DaemonProcess]
) -> None:
    """Begins of one step that arrive together (every rank at once) join one save.

    The first begin prepares the step's directory in a worker thread; the others arrive
    meanwhile, wait for it, and are admitted to the same save: none is forgotten (its
    ``done`` refused as never begun), and no directory is prepared twice under a rank
    already writing.
    """
    root, fast = tmp_path / "run", tmp_path / "fast"
    root.mkdir()
    fast.mkdir()
    daemon = start([], "--config", str(tier_config(short_dir, root, fast)))
    world = 4
    clients = [LineClient(daemon.socket_path) for _ in range(world)]
    try:
        for step in (1, 2, 3):
            for rank, client in enumerate(clients):  # every begin sent before any reply
                begin = {"op": "begin", "id": step, "root": str(root), "step": step}
                begin.update(rank=rank, world_size=world, run="torchelastic:j:0")
                client.send_raw(json.dumps(begin).encode() + b"\n")
            replies = [client.recv() for client in clients]
            assert all(r["ok"] for r in replies), replies
            assert len({r["path"] for r in replies}) == 1, replies
            for rank in range(world):
                (Path(replies[rank]["path"]) / f"r{rank}.bin").write_bytes(b"x" * (rank + 1))
            for rank, client in enumerate(clients):
                files = [{"path": f"r{rank}.bin", "size": rank + 1}]
                done = client.request(
                    "done", root=str(root), step=step, rank=rank, files=files,
                    attempt=replies[rank]["attempt"],
                )  # fmt: skip
                assert done["ok"], done
            daemon.wait_event("tier.promoted", match=at(step))
            assert sorted(p.name for p in (fast / f"step_{step}").glob("r*.bin")) == [
                f"r{rank}.bin" for rank in range(world)
            ]
    finally:
        for client in clients:
            client.close()


def test_a_damaged_fast_tier_file_is_never_drained(
    tmp_path: Path, short_dir: Path, start: Callable[..., DaemonProcess]
) -> None:
    """A byte changed in the fast tier after the seal fails the drain; nothing is committed."""
    root, fast = tmp_path / "run", tmp_path / "fast"
    root.mkdir()
    fast.mkdir()
    daemon = start([], "--config", str(tier_config(short_dir, root, fast)))
    with LineClient(daemon.socket_path) as client:
        save(client, root, 1, {"m/a.bin": b"a" * 100_000})
        daemon.wait_event("tier.promoted", match=at(1))
    with open(fast / "step_1" / "m" / "a.bin", "r+b") as f:
        f.seek(5000)
        f.write(b"b")
    assert daemon.stop(signal.SIGTERM) == 0  # drains the newest local step: it cannot
    failed = daemon.wait_event("tier.drain_failed", match=at(1))
    assert "no longer matches its checksum" in failed["reason"]
    unfinished = daemon.wait_event("tier.stop_drain_unfinished", match=at(1))
    assert unfinished["reason"].startswith("the drain failed")
    assert not (root / "step_1").exists()


@pytest.mark.slow
def test_sigkill_mid_drain_resumes(
    tmp_path: Path, short_dir: Path, start: Callable[..., DaemonProcess]
) -> None:
    """A daemon killed mid-drain finishes it after a restart.

    The drain's threads copy at the idle IO class; the durable step is then exactly the
    fast tier's.
    """
    require_tool("ionice", "util-linux")
    root, fast = tmp_path / "run", tmp_path / "fast"
    root.mkdir()
    fast.mkdir()
    config = tier_config(short_dir, root, fast, drain_every_steps=1, drain_rate_mb_s=1.0)
    daemon = start([], "--config", str(config))
    data = os.urandom(3_000_000)
    with LineClient(daemon.socket_path) as client:
        save(client, root, 1, {"m/big.bin": data})
    daemon.wait_event("tier.drain_started", match=lambda e: e["step"] == 1)
    partial = root / "tmp_step_1" / "m" / "big.bin.ckptd-drain.tmp"
    wait_until(lambda: partial.exists() and partial.stat().st_size > 0, 20, "copy under way")
    assert daemon.proc is not None
    tasks = Path(f"/proc/{daemon.proc.pid}/task")
    copiers = [
        t.name for t in tasks.iterdir() if (t / "comm").read_text().startswith("ckptd-drain")
    ]
    classes = {subprocess.run(["ionice", "-p", tid], capture_output=True, text=True).stdout
               for tid in copiers}  # fmt: skip
    assert copiers and classes == {"idle\n"}, (copiers, classes)  # drain_ionice's default
    daemon.kill()
    assert not (root / "step_1").exists()
    again = start([], "--config", str(config), socket_name="d2.sock")
    resumed = again.wait_event("tier.drain_started", match=lambda e: e["step"] == 1)
    assert resumed["resumed"] is True
    again.wait_event("tier.drained", match=lambda e: e["step"] == 1, timeout=30)
    assert hashlib.sha256((root / "step_1" / "m" / "big.bin").read_bytes()).digest() == (
        hashlib.sha256(data).digest()
    )


def test_full_fast_tier_fails_the_save_clearly(
    tmp_path: Path, short_dir: Path, start: Callable[..., DaemonProcess]
) -> None:
    """A save the fast tier has no room for is refused at ``begin``, saying so.

    The steps already there stay.
    """
    require_root("a tmpfs mount")
    root, fast = tmp_path / "run", Path(tempfile.mkdtemp(prefix="ckf-", dir="/tmp"))
    root.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(fast)])
    assert mounted.returncode == 0
    try:
        config = tier_config(short_dir, root, fast)
        daemon = start([], "--config", str(config))
        with LineClient(daemon.socket_path) as client:

            def refused(step: int) -> str:
                reply = client.request("begin", root=str(root), step=step, rank=0, world_size=1)
                assert not reply["ok"], reply
                assert daemon.wait_event("tier.full")["step"] == step
                return str(reply["error"]["message"])

            save(client, root, 1, {"m/a.bin": os.urandom(400_000)})
            daemon.wait_event("tier.promoted", match=at(1))
            # A reload asks for more free space than there is: refused, saying so.
            config.write_text(config.read_text() + "min_free_mb = 0.9\n")
            assert daemon.proc is not None
            daemon.proc.send_signal(signal.SIGHUP)
            assert daemon.wait_event("config.reloaded")["changed"] == {str(root): ["fast"]}
            assert f"fast tier {fast} is full" in refused(2)
            config.write_text(config.read_text().replace("min_free_mb = 0.9", "min_free_mb = 0"))
            daemon.proc.send_signal(signal.SIGHUP)
            daemon.wait_event("config.reloaded")
            save(client, root, 2, {"m/a.bin": os.urandom(400_000)})
            daemon.wait_event("tier.promoted", match=at(2))
            # Less free space than the last step took: the next save is refused.
            assert "this save needs about 400" in refused(3)
        assert (fast / "step_1" / "m" / "a.bin").stat().st_size == 400_000
        daemon.stop()
    finally:
        subprocess.run(["umount", "-l", str(fast)], check=False)
        fast.rmdir()


def test_sigterm_drains_the_newest_step_within_grace(
    tmp_path: Path, short_dir: Path, start: Callable[..., DaemonProcess]
) -> None:
    """On SIGTERM the newest local step is drained within the grace.

    Where the grace is too short, the daemon says which step stays only in the fast tier.
    """
    roots = []
    for name, rate in (("quick", 0.0), ("slow", 0.2)):
        root, fast = tmp_path / name, tmp_path / f"{name}-fast"
        root.mkdir()
        fast.mkdir()
        roots.append((root, fast))
        extra: dict[str, Any] = {"drain_rate_mb_s": rate, "stop_grace": 1.0} if rate else {}
        tier_config(short_dir, root, fast, **extra)
    config = short_dir / "both.toml"
    config.write_text("\n".join(p.read_text() for p in sorted(short_dir.glob("tiers-*.toml"))))
    daemon = start([], "--config", str(config))
    with LineClient(daemon.socket_path) as client:
        for root, _fast in roots:
            for step in (1, 2):
                save(client, root, step, {"m/a.bin": os.urandom(400_000)})
                daemon.wait_event("tier.promoted", match=at(step, root))
    assert daemon.stop(signal.SIGTERM) == 0
    quick, slow = (str(r) for r, _f in roots)
    assert daemon.wait_event("tier.stop_drained", match=lambda e: e["root"] == quick)["step"] == 2
    assert (roots[0][0] / "step_2").is_dir() and not (roots[0][0] / "step_1").exists()
    unfinished = daemon.wait_event("tier.stop_drain_unfinished", match=lambda e: e["root"] == slow)
    assert unfinished["step"] == 2 and unfinished["local"] == str(roots[1][1] / "step_2")
    assert unfinished["reason"].startswith("not durable within the grace")
    assert not (roots[1][0] / "step_2").exists()


@pytest.mark.slow
def test_single_node_restore_from_tmpfs(
    short_dir: Path, start: Callable[..., DaemonProcess]
) -> None:
    """A restarted job restores the newest step from a fast tier on tmpfs.

    Real DCP saves and restores through ``CheckpointManager``; nothing is drained.
    """
    base = Path(tempfile.mkdtemp(prefix="ckt-", dir="/dev/shm"))
    try:
        root, fast = short_dir / "run", base / "fast"
        root.mkdir()
        fast.mkdir()
        config = tier_config(short_dir, root, fast)
        daemon = start([], "--config", str(config))
        for run, mode in (("torchelastic:t:0", "save"), ("torchelastic:t:1", "restore")):
            env = {"TORCHELASTIC_RUN_ID": "t", "TORCHELASTIC_RESTART_COUNT": run[-1]}
            proc = start_rank(
                [str(WORKER), mode, str(root)], 0, 1, free_port(), daemon.socket_path, env
            )
            out, _ = proc.communicate(timeout=120)
            lines = [json.loads(x) for x in out.decode().splitlines() if x.startswith("{")]
            assert proc.returncode == 0, out.decode()[-3000:]
            if mode == "save":
                assert [x["path"] for x in lines] == [str(fast / "step_1"), str(fast / "step_2")]
            else:
                assert lines == [{"restored": 2, "same": True, "latest": str(fast / "step_2")}], (
                    lines
                )
        assert daemon.wait_event("tier.restore")["source"] == "fast"
        assert not (root / "step_2").exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def deep_verify_on_the_store(
    server: Any, root: str, data: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ckptd verify --deep`` streams each drained object and re-hashes it.

    An object changed since (the same size) is found by its checksum.
    """
    from daemon.cli import main

    with pytest.MonkeyPatch.context() as patch:
        for key, value in server.env().items():
            patch.setenv(key, value)
        capsys.readouterr()
        assert main(["verify", "--deep", f"{root}/step_1"]) == 0
        said = capsys.readouterr().out
        assert "2 files: each re-hashed, matching its recorded SHA-256" in said, said
        key = next(k for k in server.keys(root) if k.endswith("/m/a.bin"))
        damaged = bytearray(data)
        damaged[12345] ^= 1
        prefix = root.split("/", 3)[3]
        server.client().put_object(Bucket=server.bucket, Key=f"{prefix}/{key}", Body=damaged)
        assert main(["verify", "--deep", f"{root}/step_1", "--json"]) == 1
        problems = json.loads(capsys.readouterr().out)["problems"]
    rel = key.split("/", 2)[2]
    assert f"{rel}: SHA-256 " in " ".join(problems), problems


@pytest.mark.slow
def test_drain_to_an_object_store_and_restore_from_it(
    tmp_path: Path, short_dir: Path, start: Callable[..., DaemonProcess],
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """On an ``s3://`` root (SeaweedFS) the drain commits by the commit object.

    ``ckptd verify --deep`` re-hashes its objects. Once the fast tier is wiped, a
    restart restores the durable step.
    """
    from tests._s3 import serve

    for server in serve("seaweedfs"):
        root, fast = server.root(), tmp_path / "fast"
        fast.mkdir()
        config = short_dir / "s3.toml"
        config.write_text(
            f'[[roots]]\npath = "{root}"\n[roots.fast]\npath = "{fast}"\ndrain_every_steps = 1\n'
        )
        daemon = start([], "--config", str(config), env=server.env())
        data = os.urandom(7_000_000)
        with LineClient(daemon.socket_path) as client:
            save(client, root, 1, {"m/a.bin": data, "m/b.bin": b"x" * 10})
            daemon.wait_event("tier.drained", match=at(1), timeout=60)
            keys = server.keys(root)
            assert any(k.endswith("/m/a.bin") and size == len(data) for k, size in keys.items())
            assert any(k.endswith(".ckptd-commit.json") for k in keys), keys
            deep_verify_on_the_store(server, root, data, capsys)
            for entry in fast.iterdir():
                shutil.rmtree(
                    entry
                ) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            reply = client.request(
                "restore", root=root, rank=0, world_size=1, run="torchelastic:job:9"
            )
        assert (reply["step"], reply["tier"]) == (1, "durable"), reply
        assert reply["path"].startswith(f"{root}/step_1/")
        # A file larger than one part goes up as a multipart upload, and comes back whole.
        from daemon.config._s3 import S3Options
        from daemon.store._s3client import Bucket
        from tests._s3 import ACCESS_KEY, SECRET_KEY

        options = S3Options(
            endpoint_url=server.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY
        )
        bucket = Bucket(root, options)
        parts = [os.urandom(5 << 20), os.urandom(5 << 20), b"end"]
        bucket.upload("big", iter(parts))
        assert b"".join(bucket.download("big")) == b"".join(parts)
        assert server.keys(root)["big"] == sum(map(len, parts))

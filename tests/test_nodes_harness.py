"""The simulated nodes behave as nodes on a caching shared filesystem do.

Each node of ``tests/_nodes.py`` is a mount namespace with its own 1 s-caching bindfs
mount of one shared directory. These tests prove the properties the multi-node tests
rely on: the mounts are private to their node, writes through one node's mount reach
the others only once their caches expire, inotify on one mount misses them, and
``RENAME_NOREPLACE`` is refused, as on NFS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

from tests._nodes import Cluster, make_cluster, wait_until

__all__ = ["make_cluster"]  # the fixture, imported for pytest

MakeCluster = Callable[..., Cluster]

INOTIFY_WATCHER = """
import json, sys
from watchfiles import watch
for changes in watch(sys.argv[1], yield_on_timeout=True, rust_timeout=200, debounce=50,
                     step=20, force_polling=False):
    names = sorted({c[1].rsplit("/", 1)[-1] for c in changes})
    print(json.dumps(names), flush=True)
"""


class TestNamespaces:
    """Each node's mount is its own: the host and other nodes do not see it."""

    def test_mount_private_to_its_node(self, make_cluster: MakeCluster) -> None:
        nodes = make_cluster(2)
        a, b = nodes[0], nodes[1]
        assert a.pid != b.pid
        for node in (a, b):
            table = node.run(["cat", "/proc/self/mountinfo"]).stdout
            mounts = [line.split()[4] for line in table.splitlines()]
            assert mounts.count(str(nodes.mount)) == 1
        with open("/proc/self/mountinfo") as fh:  # the test's own namespace has none
            assert str(nodes.mount) not in [ln.split()[4] for ln in fh]
        # Every node sees the shared directory at the same path.
        (nodes.backing_root / "seed.txt").write_text("seed")
        assert a.fs.read(nodes.root / "seed.txt") == "seed"
        assert b.fs.read(nodes.root / "seed.txt") == "seed"

    def test_processes_run_inside(self, make_cluster: MakeCluster) -> None:
        nodes = make_cluster(1)
        node = nodes[0]
        ns = node.run(["readlink", "/proc/self/ns/mnt"]).stdout.strip()
        assert ns != os.readlink("/proc/self/ns/mnt")
        assert ns == os.readlink(f"/proc/{node.pid}/ns/mnt")
        proc = node.popen(["readlink", "/proc/self/ns/mnt"], stdout=subprocess.PIPE)
        out, _ = proc.communicate(timeout=30)
        assert out.decode().strip() == ns


class TestCaching:
    """A file made through one node's mount reaches another's only when its cache expires."""

    def test_invisible_then_visible(self, make_cluster: MakeCluster) -> None:
        nodes = make_cluster(2)
        a, b = nodes[0], nodes[1]
        path = nodes.root / "marker.json"
        assert not b.fs.exists(path)  # B looks it up now: a negative entry, cached ~1 s
        a.fs.write(path, data="{}")
        written = time.monotonic()
        assert a.fs.exists(path)
        assert (nodes.backing_root / "marker.json").exists()  # it is on the shared disk
        assert not b.fs.exists(path), "B's cached lookup hid the file for a while"
        wait_until(lambda: b.fs.exists(path), 10.0, "B sees A's file")
        # It was hidden for a while, by B's cache (bounded here only by the deadline).
        assert time.monotonic() - written > 0.05
        assert b.fs.read(path) == "{}"

    def test_directory_listing_is_cached_too(self, make_cluster: MakeCluster) -> None:
        nodes = make_cluster(2)
        a, b = nodes[0], nodes[1]
        tmp = nodes.root / "tmp_step_1"
        a.fs.mkdir(tmp)
        wait_until(lambda: b.fs.listdir(tmp) == [], 10.0, "B sees the empty directory")
        a.fs.write(tmp / ".ckptd-node-n0.json", data="{}")
        wait_until(lambda: b.fs.listdir(tmp) == [".ckptd-node-n0.json"], 10.0, "B lists A's marker")

    def test_replaced_file_read_stale_then_fresh(self, make_cluster: MakeCluster) -> None:
        # A marker replaced by a rename through A: B's stat keeps the old file's
        # attributes for a while, and open() through B already reads the new file's
        # bytes, but only up to the old size (a JSON reader sees a truncated marker).
        nodes = make_cluster(2)
        a, b = nodes[0], nodes[1]
        path = nodes.root / "marker.json"
        a.fs.write(path, data="writing")
        wait_until(lambda: b.fs.size(path) == 7, 10.0, "B sees the first marker")
        a.fs.write(nodes.root / "marker.tmp", data="done, with every file")
        assert a.run(["mv", str(nodes.root / "marker.tmp"), str(path)]).returncode == 0
        assert b.fs.size(path) == 7, "B's cached attributes still describe the old file"
        assert b.fs.read(path) == "done, w"
        wait_until(lambda: b.fs.size(path) == 21, 10.0, "B's stat catches up")
        assert b.fs.read(path) == "done, with every file"

    def test_rename_noreplace_einval(self, make_cluster: MakeCluster) -> None:
        nodes = make_cluster(1)
        node = nodes[0]
        node.fs.mkdir(nodes.root / "tmp_step_1")
        error = node.fs.rename_noreplace(nodes.root / "tmp_step_1", nodes.root / "step_1")
        assert error == "EINVAL"
        assert (nodes.backing_root / "tmp_step_1").is_dir()
        assert not (nodes.backing_root / "step_1").exists()


class TestInotify:
    """inotify on one node's mount sees that node's writes, not another node's."""

    def test_other_nodes_writes_unseen(self, make_cluster: MakeCluster) -> None:
        nodes = make_cluster(2)
        a, b = nodes[0], nodes[1]
        watched = nodes.root / "w"
        a.fs.mkdir(watched)
        wait_until(lambda: b.fs.listdir(watched) == [], 10.0, "B sees the directory")
        watcher = b.popen(
            [sys.executable, "-c", INOTIFY_WATCHER, str(watched)],
            stdout=subprocess.PIPE,
        )
        assert watcher.stdout is not None
        seen: list[str] = []
        probes = iter(range(10_000))

        def saw(name: str) -> bool:
            assert watcher.stdout is not None
            line = watcher.stdout.readline()  # one line per 200 ms timeout at the latest
            seen.extend(json.loads(line))
            return name in seen

        def probe() -> bool:
            # The watcher may not be watching yet: each look writes a new file through
            # B's mount and reads one batch; it is ready once it reports one of them.
            b.fs.write(watched / f"from-b-{next(probes)}", data="b")
            return any(name.startswith("from-b-") for name in seen) or saw("from-b-0")

        wait_until(probe, 20.0, "inotify on B sees B's own write")
        a.fs.write(watched / "from-a", data="a")
        wait_until(lambda: b.fs.exists(watched / "from-a"), 10.0, "B's mount shows A's file")
        b.fs.write(watched / "from-b-last", data="b")  # a later write that B does see
        wait_until(lambda: saw("from-b-last"), 20.0, "inotify on B sees B's later write")
        assert "from-a" not in seen

"""``gc`` end to end: slow removal never holds the root's lock; deletion is resumed and retried.

Real daemons, real files, a real FUSE mount (bindfs) that hangs on demand and real bind
mounts, which make the kernel answer ``EBUSY`` and ``ENOTEMPTY`` as a file still in use
does. A failed attempt's directory is set aside in the root's trash when it fails, so
what gc removes of a failed step is that kept entry (``save.set_aside`` says where).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from daemon.cli import main
from daemon.ledger._records import JBegin, JFail, JournalRecord
from daemon.store._journal import Journal
from orchestrator.protocol import ATTEMPT_MARKER
from tests._fuse import bindfs_mount, waiting_requests
from tests._system import in_ci, require_root, require_tool
from tests.conftest import REPO, DaemonProcess, LineClient
from tests.test_server import (
    TIMEOUT,
    begin,
    connect,
    done,
    error_code,
    of,
    ok,
    set_mtime,
    write_files,
)

LIVENESS = 10.0
"""Seconds a promotion may take while a removal in the same root hangs."""
UNCACHED = "attr_timeout=0,entry_timeout=0"
"""bindfs options under which every lookup and stat on the mount asks its server."""

Start = Callable[..., DaemonProcess]


def trash(root: Path) -> Path:
    return root / ".ckptd-trash"


def doomed(root: Path) -> list[Path]:
    """What is waiting in the root's doomed area to be deleted."""
    area = trash(root) / "delete"
    return sorted(area.iterdir()) if area.is_dir() else []


def failed_step(client: LineClient, daemon: DaemonProcess, root: Path, step: int) -> Path:
    """A one-rank save of ``step`` that wrote two 100-byte files and failed.

    Returns:
        Its set-aside directory in the trash (``save.set_aside``): what gc removes of it.
    """
    ok(begin(client, root, step, 0, 1))
    write_files(root / f"tmp_step_{step}", 0)
    return fail(client, daemon, root, step)


def fail(client: LineClient, daemon: DaemonProcess, root: Path, step: int) -> Path:
    """Fail the one-rank save of ``step``; return where its directory was set aside."""
    ok(client.request("fail", root=str(root), step=step, rank=0, reason="boom"))
    kept = Path(daemon.wait_event("save.set_aside", TIMEOUT, of(root, step))["path"])
    daemon.wait_event("checkpoint.failed", TIMEOUT, of(root, step))
    assert kept.parent == trash(root) and not (root / f"tmp_step_{step}").exists()
    return kept


def marker_size(kept: Path) -> int:
    """Bytes of the attempt marker in a set-aside directory (it names the root's path)."""
    return (kept / ATTEMPT_MARKER).stat().st_size


def steps_known(client: LineClient) -> list[int]:
    """The steps the daemon knows, from ``status``."""
    return [s["step"] for s in ok(client.request("status"))["saves"]]


def gc_cli(daemon: DaemonProcess, root: Path, *args: str) -> subprocess.Popen[str]:
    """``ckptd gc ROOT ARGS`` as a real subprocess."""
    cmd = [sys.executable, "-m", "daemon", "gc", str(root), *args]
    cmd += ["--socket", str(daemon.socket_path)]
    return subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_until(condition: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    """Return once ``condition()`` holds; fail after ``timeout`` seconds.

    For a change only the filesystem shows (a rename nothing reports): it is re-checked
    every 10 ms, as ``tests._fuse`` waits for a mount to appear.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout}s")
        time.sleep(0.01)


def mount_under(root: Path) -> Path:
    """The one mount point below ``root``: where a mount went when gc moved its parent."""
    prefix = f"{root}/"
    with open("/proc/self/mounts", encoding="utf-8") as fh:
        points = [Path(line.split()[1]) for line in fh if line.split()[1].startswith(prefix)]
    assert len(points) == 1, points
    return points[0]


def emitted_at(event: dict[str, Any]) -> float:
    """The event's timestamp as seconds since the epoch."""
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


class BindMount:
    """A kernel bind mount; ``path`` follows it when a directory above it is renamed."""

    def __init__(self, path: Path) -> None:
        self.path = path


@contextmanager
def bind_mount(source: Path, target: Path) -> Iterator[BindMount]:
    """Bind ``source`` onto ``target`` (``mount --bind``) for the block; needs root."""
    require_tool("mount")
    require_root("bind mounts")
    made = subprocess.run(
        ["mount", "--bind", str(source), str(target)], capture_output=True, text=True
    )
    if made.returncode != 0:
        reason = f"mount --bind is not permitted here: {made.stderr.strip()}"
        if in_ci():
            pytest.fail(reason)
        pytest.skip(reason)
    handle = BindMount(target)
    try:
        yield handle
    finally:
        subprocess.run(["umount", "-l", str(handle.path)], check=False, capture_output=True)


class TestHungRemoval:
    """Deleting what gc removed happens after its reply, outside the root's lock."""

    def test_promotion_completes_while_removal_hangs(
        self, start: Start, root: Path, tmp_path: Path
    ) -> None:
        daemon = start([root])
        backing = tmp_path / "backing"
        backing.mkdir()
        (backing / "data.bin").write_bytes(b"d" * 1000)
        with connect(daemon) as client:
            # What gc removes of failed step 1 is its set-aside directory in the trash.
            kept = failed_step(client, daemon, root, 1)
            marker = marker_size(kept)
            ok(begin(client, root, 2, 0, 1))
            files = write_files(root / "tmp_step_2", 0)
            # A filesystem mounted inside what gc removes, whose server then stops
            # answering: every call on it blocks, as on a hung NFS server.
            with bindfs_mount(backing, kept / "mnt", UNCACHED) as mount:
                mount.stop()
                gc = gc_cli(daemon, root, "--yes")
                try:
                    wait_until(lambda: not kept.exists(), "gc's rename")
                    mount.mount = mount_under(root)  # for cleanup, whatever happens next
                    ok(done(client, root, 2, 0, files))
                    daemon.wait_event("checkpoint.promoted", LIVENESS, of(root, 2))
                    out, err = gc.communicate(timeout=LIVENESS)
                finally:
                    if gc.poll() is None:
                        mount.cont()
                        gc.kill()
                        gc.communicate()
                [entry] = doomed(root)
                assert entry.name == kept.name
                assert mount.mount == entry / "mnt"
                assert (gc.returncode, out, err) == (0, f"removed: {kept}\n", "")
                event = daemon.wait_event("gc.removed", TIMEOUT)
                assert (event["steps"], event["set_aside"], event["forgotten"]) == (
                    [],
                    [kept.name],
                    [1],
                )
                assert os.readlink(root / "latest") == "step_2"

                resumed = time.time()
                mount.cont()
                busy = daemon.wait_event("trash.busy", TIMEOUT)
                # The remover waited on the hung mount, then left it alone: gc never
                # deletes another filesystem's files.
                assert emitted_at(busy) >= resumed
                assert busy["entry"] == entry.name
                assert busy["reason"] == f"{entry / 'mnt'} is a mount point"
                assert busy["attempts"] == 1
                assert (backing / "data.bin").read_bytes() == b"d" * 1000
            deleted = daemon.wait_event("trash.deleted", TIMEOUT)
            # The entry, model/, its two files, the attempt marker, and the mount point
            # once unmounted.
            assert (deleted["entry"], deleted["entries"], deleted["bytes"]) == (
                entry.name,
                6,
                200 + marker,
            )
            assert deleted["attempts"] >= 2
            assert doomed(root) == []
            assert sorted(p.name for p in backing.iterdir()) == ["data.bin"]


class TestResume:
    """What was doomed before a crash is deleted after the restart."""

    def test_sigkill_during_removal(self, start: Start, root: Path, tmp_path: Path) -> None:
        daemon = start([root])
        backing = tmp_path / "backing"
        backing.mkdir()
        with connect(daemon) as client:
            # The hung mount is inside failed step 1's set-aside directory.
            kept = failed_step(client, daemon, root, 1)
            marker = marker_size(kept)
            with bindfs_mount(backing, kept / "mnt", UNCACHED) as mount:
                mount.stop()
                try:
                    removed = ok(client.request("gc", root=str(root), remove=True))
                finally:
                    mount.mount = mount_under(root)  # for cleanup, whatever happened
                assert (removed["candidates"], removed["set_aside"]) == ([], [str(kept)])
                [entry] = doomed(root)
                assert entry.name == kept.name
                assert mount.mount == entry / "mnt"
                daemon.kill()  # SIGKILL, while the removal waits on the hung mount
        assert doomed(root) == [entry]
        assert (entry / "model" / "rank0-0.bin").is_file()

        daemon = start([root])
        deleted = daemon.wait_event("trash.deleted", TIMEOUT)
        assert (deleted["entry"], deleted["entries"], deleted["bytes"]) == (
            entry.name,
            6,
            200 + marker,
        )
        assert doomed(root) == []
        with connect(daemon) as client:
            # The step was forgotten before the kill (journaled before the reply).
            listed = ok(client.request("gc", root=str(root)))
            assert (listed["candidates"], listed["set_aside"], listed["absent"]) == ([], [], [])
            assert steps_known(client) == []

    def test_crash_after_rename_before_journal(self, start: Start, root: Path) -> None:
        daemon = start([root], env={"CKPTD_CRASH_AT": "gc_after_doom"})
        with connect(daemon) as client:
            kept = failed_step(client, daemon, root, 1)
            marker = marker_size(kept)
            request = {"op": "gc", "id": 1, "root": str(root), "remove": True}
            client.send_raw(json.dumps(request).encode() + b"\n")
            assert client.file.readline() == b""  # the daemon died before replying
        assert daemon.stop() == 137
        [entry] = doomed(root)
        assert entry.name == kept.name
        assert not kept.exists() and not (root / "tmp_step_1").exists()

        daemon = start([root])
        deleted = daemon.wait_event("trash.deleted", TIMEOUT)
        # The entry, model/, its two files and the attempt marker.
        assert (deleted["entry"], deleted["entries"], deleted["bytes"]) == (
            entry.name,
            5,
            200 + marker,
        )
        assert doomed(root) == []
        with connect(daemon) as client:
            # Forgetting the step was never journaled: gc lists it again, as a failed
            # step with nothing left on disk, and clears it.
            listed = ok(client.request("gc", root=str(root)))
            tmp = str(root / "tmp_step_1")
            assert (listed["candidates"], listed["absent"], listed["set_aside"]) == (
                [tmp],
                [tmp],
                [],
            )
            cleared = ok(client.request("gc", root=str(root), remove=True))
            assert (cleared["candidates"], cleared["absent"], cleared["removed"]) == (
                [tmp],
                [tmp],
                True,
            )
            event = daemon.wait_event("gc.removed", TIMEOUT)
            assert (event["steps"], event["set_aside"], event["forgotten"]) == ([], [], [1])
            assert ok(client.request("gc", root=str(root)))["candidates"] == []
            assert ok(begin(client, root, 1, 0, 1))["path"] == tmp


class TestRetries:
    """Transient failures are retried with a growing delay until the entry is gone."""

    def test_file_in_use(self, start: Start, root: Path, tmp_path: Path) -> None:
        daemon = start([root])
        source = tmp_path / "source.bin"
        source.write_bytes(b"s" * 7)
        with connect(daemon) as client:
            # The file in use is in failed step 1's set-aside directory.
            kept = failed_step(client, daemon, root, 1)
            marker = marker_size(kept)
            held = kept / "model" / ".nfs00000000002a5f1c00000001"
            held.write_bytes(b"h" * 10)
            # A file the kernel refuses to unlink while it is in use (EBUSY), named as
            # an NFS client names a file unlinked while still open.
            with bind_mount(source, held) as mount:
                try:
                    ok(client.request("gc", root=str(root), remove=True))
                finally:
                    mount.path = mount_under(root)  # for cleanup, whatever happened
                [entry] = doomed(root)
                assert entry.name == kept.name
                assert mount.path == entry / "model" / held.name
                first = daemon.wait_event("trash.busy", TIMEOUT)
                assert first["reason"] == (
                    f"{mount.path}: Device or resource busy (an NFS client's placeholder "
                    "for a file still open somewhere)"
                )
                assert first["problems"] == 2  # the file (EBUSY) and model/ (ENOTEMPTY)
                second = daemon.wait_event("trash.busy", TIMEOUT)
                assert (first["attempts"], second["attempts"]) == (1, 2)
                assert second["retry_in_s"] == 2 * first["retry_in_s"]
                assert (entry / "model").is_dir()
            deleted = daemon.wait_event("trash.deleted", TIMEOUT)
        # The two files, the placeholder, the attempt marker, model/ and the entry; what
        # the mount showed is not counted.
        assert (deleted["entry"], deleted["entries"], deleted["bytes"]) == (
            entry.name,
            6,
            210 + marker,
        )
        assert deleted["attempts"] >= 3
        assert doomed(root) == []
        assert source.read_bytes() == b"s" * 7

    def test_many_files(self, start: Start, root: Path) -> None:
        daemon = start([root])
        with connect(daemon) as client:
            # The failed attempt wrote 1000 shards; they are set aside with it.
            ok(begin(client, root, 1, 0, 1))
            write_files(root / "tmp_step_1", 0)
            for d in range(10):
                shard = root / "tmp_step_1" / f"shard{d}"
                shard.mkdir()
                for f in range(100):
                    (shard / f"{f}.distcp").write_bytes(b"x" * 10)
            kept = fail(client, daemon, root, 1)
            marker = marker_size(kept)
            assert len(list((kept / "shard9").iterdir())) == 100
            ok(client.request("gc", root=str(root), remove=True))
            deleted = daemon.wait_event("trash.deleted", TIMEOUT)
        # 1000 shards in 10 directories, model/ with 2 files, the attempt marker, and the
        # entry itself.
        assert (deleted["entry"], deleted["entries"], deleted["bytes"]) == (
            kept.name,
            1015,
            10_200 + marker,
        )
        assert deleted["attempts"] == 1
        assert doomed(root) == []


class TestTrashLayout:
    """Only the doomed area is deleted by itself; set-aside attempts wait for a gc."""

    def test_kept_until_gc_names_them(self, start: Start, root: Path, tmp_path: Path) -> None:
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "precious").write_text("keep")
        kept = {
            "tmp_step_7.failed-0123456789ab": b"a" * 3,
            "tmp_step_8.attempt-0f1e2d3c": b"b" * 5,
            "tmp_step_9.attempt-4b5a6978": b"c" * 7,
        }
        for name, data in kept.items():
            (trash(root) / name / "model").mkdir(parents=True)
            (trash(root) / name / "model" / "0.distcp").write_bytes(data)
        (trash(root) / "notes.txt").write_text("an operator's")
        # What a previous run doomed and did not get to delete, one entry a symlink out.
        leftover = trash(root) / "delete" / "tmp_step_3.00112233aabb"
        write_files(leftover, 0)
        (trash(root) / "delete" / "tmp_step_4.44556677ccdd").symlink_to(outside)

        daemon = start([root])
        deleted = {daemon.wait_event("trash.deleted", TIMEOUT)["entry"] for _ in range(2)}
        assert deleted == {"tmp_step_3.00112233aabb", "tmp_step_4.44556677ccdd"}
        assert (outside / "precious").read_text() == "keep"
        names = sorted(p.name for p in trash(root).iterdir())
        assert names == ["delete", "notes.txt", *sorted(kept)]

        with connect(daemon) as client:
            ok(begin(client, root, 9, 0, 2))  # a new attempt at step 9 is in flight
            listed = ok(client.request("gc", root=str(root)))
            expected = [str(trash(root) / n) for n in sorted(kept)[:2]]
            assert listed == {
                "id": listed["id"],
                "ok": True,
                "candidates": [],
                "removed": False,
                "set_aside": expected,
                "absent": [],
            }
            removed = ok(client.request("gc", root=str(root), remove=True))
            assert (removed["set_aside"], removed["removed"]) == (expected, True)
            event = daemon.wait_event("gc.removed", TIMEOUT)
            # No save of steps 7 and 8 is known: nothing to forget.
            assert (event["steps"], event["set_aside"], event["forgotten"]) == (
                [],
                sorted(kept)[:2],
                [],
            )
            done_with = {daemon.wait_event("trash.deleted", TIMEOUT)["entry"] for _ in range(2)}
            assert done_with == set(sorted(kept)[:2])
            names = sorted(p.name for p in trash(root).iterdir())
            assert names == ["delete", "notes.txt", "tmp_step_9.attempt-4b5a6978"]
            assert doomed(root) == []
            # While step 9 is in flight its set-aside attempt stays, even with --yes.
            again = ok(client.request("gc", root=str(root), remove=True))
            assert (again["set_aside"], again["removed"]) == ([], False)

    def test_entry_that_cannot_be_moved(self, start: Start, root: Path) -> None:
        daemon = start([root])
        with connect(daemon) as client:
            kept1 = failed_step(client, daemon, root, 1)
            kept2 = failed_step(client, daemon, root, 2)
            (kept2 / "mnt").mkdir()
            with bind_mount(kept2 / "mnt", kept2):
                # Step 2's set-aside directory is a mount point: it cannot be renamed
                # (EBUSY).
                reply = client.request("gc", root=str(root), remove=True)
                assert error_code(reply) == "invalid_state"
                message = reply["error"]["message"]
                assert message.startswith(f"cannot move {kept2} into the trash: ")
                assert message.endswith("; the other candidates were removed")
                event = daemon.wait_event("gc.removed", TIMEOUT)
                assert (event["steps"], event["set_aside"], event["forgotten"]) == (
                    [],
                    [kept1.name],
                    [1],
                )
                assert not kept1.exists()
                # Step 2 is not forgotten: its files are still there, and listed.
                assert steps_known(client) == [2]
                listed = ok(client.request("gc", root=str(root)))
                assert (listed["candidates"], listed["set_aside"]) == ([], [str(kept2)])


class TestFailedSteps:
    """gc finds what a failed step left where it is, and takes nothing else with it."""

    def test_directory_that_could_not_be_set_aside(self, start: Start, root: Path) -> None:
        trash(root).write_text("in the way")  # the trash cannot be created
        daemon = start([root])
        tmp = root / "tmp_step_1"
        with connect(daemon) as client:
            ok(begin(client, root, 1, 0, 1))
            write_files(tmp, 0)
            ok(client.request("fail", root=str(root), step=1, rank=0, reason="boom"))
            daemon.wait_event("save.set_aside_failed", TIMEOUT, of(root, 1))
            daemon.wait_event("checkpoint.failed", TIMEOUT, of(root, 1))
            trash(root).unlink()
            # Written a moment ago, so no orphan: it is listed because its marker names
            # the failed attempt.
            listed = ok(client.request("gc", root=str(root)))
            assert (listed["candidates"], listed["set_aside"], listed["absent"]) == (
                [str(tmp)],
                [],
                [],
            )
            removed = ok(client.request("gc", root=str(root), remove=True))
            assert (removed["candidates"], removed["removed"]) == ([str(tmp)], True)
            event = daemon.wait_event("gc.removed", TIMEOUT)
            assert (event["steps"], event["set_aside"], event["forgotten"]) == ([1], [], [1])
            assert not tmp.exists()
            assert daemon.wait_event("trash.deleted", TIMEOUT)["entry"].startswith("tmp_step_1.")
            assert steps_known(client) == []

    def test_files_written_for_the_next_attempt_stay(self, start: Start, root: Path) -> None:
        daemon = start([root])
        with connect(daemon) as client:
            kept = failed_step(client, daemon, root, 2)
            # The job restarts and writes into tmp_step_2 before its begin (NeMo-RL's
            # training_info.json): those files are the next attempt's, not the failed one's.
            early = root / "tmp_step_2" / "training_info.json"
            early.parent.mkdir()
            early.write_text("{}")
            listed = ok(client.request("gc", root=str(root)))
            assert (listed["candidates"], listed["set_aside"], listed["absent"]) == (
                [],
                [str(kept)],
                [],
            )
            ok(client.request("gc", root=str(root), remove=True))
            event = daemon.wait_event("gc.removed", TIMEOUT)
            assert (event["steps"], event["set_aside"], event["forgotten"]) == (
                [],
                [kept.name],
                [2],
            )
            assert early.read_text() == "{}"
            assert ok(begin(client, root, 2, 0, 1))["path"] == str(early.parent)
            assert early.read_text() == "{}"  # adopted by the new save

    def test_set_aside_the_journal_lost(self, start: Start, root: Path, tmp_path: Path) -> None:
        # The journal has step 3's failure but not where its directory went (that write
        # failed); the trash entry's name still says whose it is.
        attempt, earlier = "a1b2c3d4e5f60718", "0123456789abcdef"
        t = time.time() - 60
        records: list[JournalRecord] = [
            JBegin(str(root), 3, 0, 1, t, attempt),
            JFail(str(root), 3, 0, "boom", t + 1),
        ]
        state = tmp_path / "state"
        journal = Journal(str(state / "journal"))
        journal.open()
        journal.compact(records)
        journal.close()
        before = trash(root) / f"tmp_step_3.attempt-{earlier}-5e6f7a8b"
        write_files(before, 0)
        daemon = start([root], "--state-dir", str(state))
        daemon.wait_event("daemon.recovered", TIMEOUT)
        tmp = str(root / "tmp_step_3")
        with connect(daemon) as client:
            assert steps_known(client) == [3]
            # Only an earlier attempt's directory is in the trash: of the failed attempt
            # nothing is left.
            listed = ok(client.request("gc", root=str(root)))
            assert (listed["candidates"], listed["set_aside"], listed["absent"]) == (
                [tmp],
                [str(before)],
                [tmp],
            )
            own = trash(root) / f"tmp_step_3.attempt-{attempt}-1a2b3c4d"
            write_files(own, 0)
            listed = ok(client.request("gc", root=str(root)))
            assert (listed["candidates"], listed["set_aside"], listed["absent"]) == (
                [],
                [str(before), str(own)],
                [],
            )
            removed = ok(client.request("gc", root=str(root), remove=True))
            assert removed["set_aside"] == [str(before), str(own)]
            event = daemon.wait_event("gc.removed", TIMEOUT)
            assert (event["steps"], event["set_aside"], event["forgotten"]) == (
                [],
                [before.name, own.name],
                [3],
            )
            assert steps_known(client) == []


class TestPromoteMeanwhile:
    """A ``ckptd promote`` that takes a step while gc lists it is never undone by that gc."""

    def test_failed_step_promoted_during_the_walk(
        self, start: Start, root: Path, tmp_path: Path
    ) -> None:
        daemon = start([root])
        with connect(daemon) as client:
            # Failed step 1 holds a complete DCP checkpoint: its rank failed after writing.
            ok(begin(client, root, 1, 0, 1))
            state = {"w": torch.arange(16, dtype=torch.float32)}
            dcp_save(state, checkpoint_id=str(root / "tmp_step_1" / "model"), no_dist=True)
            kept = fail(client, daemon, root, 1)
        backing = tmp_path / "backing"
        backing.mkdir()
        # An orphan with a hung filesystem inside: gc's walk of the orphans stops there,
        # after gc has read the ledger (step 1 failed, set aside at ``kept``).
        with bindfs_mount(backing, root / "tmp_step_9" / "mnt", UNCACHED) as mount:
            waiting = waiting_requests(mount.mount)
            mount.stop()
            with connect(daemon) as client, connect(daemon) as operator:
                request = {"op": "gc", "id": 1, "root": str(root), "remove": True}
                client.send_raw(json.dumps(request).encode() + b"\n")
                wait_until(lambda: waiting() > 0, "gc's walk to reach the hung mount")
                # Meanwhile an operator promotes step 1: its set-aside directory is
                # restored, verified and renamed to step_1.
                promoted = ok(operator.request("promote", root=str(root), step=1))
                assert (promoted["state"], promoted["path"]) == ("promoted", str(root / "step_1"))
                assert not kept.exists()
                mount.cont()
                reply = ok(client.recv())
                # gc found step 1 changed under the root's lock and left it alone: it did
                # not forget the promoted step, and nothing was removed.
                assert reply == {
                    "id": 1,
                    "ok": True,
                    "candidates": [],
                    "removed": False,
                    "set_aside": [],
                    "absent": [],
                }
                saves = ok(operator.request("status"))["saves"]
                assert [(s["step"], s["state"]) for s in saves] == [(1, "promoted")]
        assert "gc.removed" not in [e["event"] for e in daemon.drain()]
        assert (root / "step_1" / "model" / ".metadata").is_file()
        assert os.readlink(root / "latest") == "step_1"


class TestCommandLine:
    """``ckptd gc`` lists what it would remove and forget, and ``--yes`` does exactly that."""

    def test_list_then_remove(
        self, start: Start, root: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        set_aside = trash(root) / "tmp_step_3.failed-00aa11bb22cc"  # an earlier version's
        set_aside.mkdir(parents=True)
        orphan = root / "tmp_step_6"
        write_files(orphan, 0)
        set_mtime(orphan, 1_000_000_000.0)  # 2001: untouched for longer than save_timeout
        daemon = start([root])
        with connect(daemon) as client:
            # Failed step 4's files are in its set-aside directory, not in tmp_step_4.
            kept = failed_step(client, daemon, root, 4)
            # Failed step 5's set-aside directory was deleted by hand: nothing is left.
            shutil.rmtree(failed_step(client, daemon, root, 5))
        argv = ["gc", str(root), "--socket", str(daemon.socket_path)]
        capsys.readouterr()
        assert main(argv) == 0
        assert capsys.readouterr().out == (
            f"would remove (pass --yes): {orphan}\n"
            f"would remove (pass --yes): {set_aside}\n"
            f"would remove (pass --yes): {kept}\n"
            f"would forget (pass --yes): {root / 'tmp_step_5'} "
            "(a failed step; none of its files are left)\n"
        )
        assert orphan.is_dir() and set_aside.is_dir() and kept.is_dir()
        assert main([*argv, "--yes"]) == 0
        assert capsys.readouterr().out == (
            f"removed: {orphan}\n"
            f"removed: {set_aside}\n"
            f"removed: {kept}\n"
            f"forgot: {root / 'tmp_step_5'} (a failed step; none of its files were left)\n"
        )
        assert not orphan.exists() and not set_aside.exists() and not kept.exists()
        deleted = sorted(daemon.wait_event("trash.deleted", TIMEOUT)["entry"] for _ in range(3))
        assert deleted[:2] == sorted([set_aside.name, kept.name])
        assert deleted[2].startswith("tmp_step_6.")
        with connect(daemon) as client:
            assert steps_known(client) == []  # steps 4 and 5 were forgotten
        assert main(argv) == 0
        assert capsys.readouterr().out == f"{root}: nothing to collect\n"

"""Durable small writes: shared directory flushes, and files flushed before they are named.

Concurrent flushes of one directory share the disk's work; a file flushed under no name
is named in one call.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from daemon.store._durable import fsync_dir, stage
from tests._fuse import bindfs_mount
from tests._system import require_tool

_FLUSHERS = 64

# Each thread adds an entry to the directory, then flushes it, all at once.
_SCRIPT = """
import os, sys, threading
from daemon.store._durable import fsync_dir
where, n = sys.argv[1], int(sys.argv[2])
barrier = threading.Barrier(n)
def one(i):
    barrier.wait()
    with open(os.path.join(where, f"f{i}"), "wb"):
        pass
    fsync_dir(where)
threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


class TestSharedFlushes:
    """Callers flushing one directory together share fsyncs; each still gets one after it."""

    def test_concurrent_flushes_share_fsyncs(self, tmp_path: Path) -> None:
        strace = require_tool("strace")
        where = tmp_path / "d"
        where.mkdir()
        log = tmp_path / "strace.log"
        cmd = [strace, "-f", "-qq", "-e", "trace=fsync", "-o", str(log)]
        cmd += [sys.executable, "-c", _SCRIPT, str(where), str(_FLUSHERS)]
        subprocess.run(cmd, check=True, cwd=Path(__file__).parent.parent, timeout=120)
        fsyncs = [ln for ln in log.read_text().splitlines() if "fsync(" in ln and "= 0" in ln]
        assert 1 <= len(fsyncs) < _FLUSHERS
        assert len(list(where.iterdir())) == _FLUSHERS

    def test_a_failed_flush_fails_every_caller_sharing_it(self, tmp_path: Path) -> None:
        missing = str(tmp_path / "gone")
        errors: list[BaseException] = []
        barrier = threading.Barrier(8)

        def one() -> None:
            barrier.wait()
            try:
                fsync_dir(missing)
            except OSError as exc:
                errors.append(exc)

        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(errors) == 8 and all(isinstance(e, FileNotFoundError) for e in errors)

    def test_one_flush_after_another(self, tmp_path: Path) -> None:
        fsync_dir(str(tmp_path))
        fsync_dir(str(tmp_path))
        with pytest.raises(NotADirectoryError):
            (tmp_path / "f").write_bytes(b"")
            fsync_dir(str(tmp_path / "f"))


class TestStaged:
    """A small file flushed under no name, then named in one call (an attempt's marker)."""

    def test_placed_file_holds_the_bytes_and_nothing_else_is_left(self, tmp_path: Path) -> None:
        before = set(os.listdir(tmp_path))
        staged = stage(str(tmp_path), b"marker bytes")
        assert staged is not None, "ext4 and tmpfs have O_TMPFILE"
        assert set(os.listdir(tmp_path)) == before  # no name until placed
        (tmp_path / "tmp_step_1").mkdir()
        staged.place(str(tmp_path / "tmp_step_1" / "m.json"))
        staged.close()
        assert (tmp_path / "tmp_step_1" / "m.json").read_bytes() == b"marker bytes"
        assert os.stat(tmp_path / "tmp_step_1" / "m.json").st_nlink == 1
        assert set(os.listdir(tmp_path)) == before | {"tmp_step_1"}

    def test_never_placed_leaves_nothing(self, tmp_path: Path) -> None:
        staged = stage(str(tmp_path), b"x" * 10_000)
        assert staged is not None
        staged.close()
        staged.close()  # idempotent
        assert os.listdir(tmp_path) == []

    def test_an_existing_name_is_not_replaced(self, tmp_path: Path) -> None:
        (tmp_path / "m.json").write_bytes(b"old")
        staged = stage(str(tmp_path), b"new")
        assert staged is not None
        with pytest.raises(FileExistsError):
            staged.place(str(tmp_path / "m.json"))
        staged.close()
        assert (tmp_path / "m.json").read_bytes() == b"old"

    def test_a_filesystem_without_unnamed_files_stages_nothing(self, tmp_path: Path) -> None:
        require_tool("bindfs")
        backing, mount = tmp_path / "backing", tmp_path / "mnt"
        backing.mkdir()
        with bindfs_mount(backing, mount):
            assert stage(str(mount), b"m") is None
            assert os.listdir(backing) == []

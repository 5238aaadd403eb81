"""Flushing a directory: concurrent flushes of one directory share the disk's work."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from daemon.store._durable import fsync_dir
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

"""The shared-root fences: one claim per step, and a pointer that never moves back.

Run through two bindfs mounts of one directory with NFS-like caching, where
``RENAME_NOREPLACE`` fails with ``EINVAL`` and each mount sees the other's changes only
after its cache expires, as two nodes' NFS clients do; the contenders are separate
processes.
"""

from __future__ import annotations

import ctypes
import errno
import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.config._config import RootConfig
from daemon.store._fence import ClaimedError, claim, pointer_lock, release
from daemon.store._local import LocalStorage
from daemon.store._promote import _advance_pointer, read_pointer
from tests._fuse import CACHING, bindfs_mount


@pytest.fixture
def two_mounts(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """Two caching FUSE mounts of one backing directory."""
    backing = tmp_path / "backing"
    backing.mkdir()
    with (
        bindfs_mount(backing, tmp_path / "a", CACHING) as a,
        bindfs_mount(backing, tmp_path / "b", CACHING) as b,
    ):
        yield a.mount, b.mount


def _root(path: Path) -> RootConfig:
    return RootConfig(path=str(path), real=str(path))


def _claim_in(path: str, node: str, go: Any, out: Any) -> None:
    go.wait()
    try:
        claim(RootConfig(path=path, real=path), 5, node, "att")
    except ClaimedError:
        out.put(False)
    else:
        out.put(True)


class TestClaim:
    """Of two nodes claiming a step at once, exactly one gets it."""

    def test_renameat2_noreplace_fails_here(self, two_mounts: tuple[Path, Path]) -> None:
        a, _ = two_mounts
        (a / "x").mkdir()
        storage = LocalStorage()
        # The fallback is the normal path on these mounts: nothing but the claim fences it.
        assert storage._renameat2 is not None
        rc = storage._renameat2(-100, os.fsencode(a / "x"), -100, os.fsencode(a / "y"), 1)
        assert rc != 0 and ctypes.get_errno() == errno.EINVAL

    def test_one_winner_among_racing_nodes(self, two_mounts: tuple[Path, Path]) -> None:
        a, b = two_mounts
        (a / "tmp_step_5").mkdir()
        ctx = multiprocessing.get_context("spawn")
        for trial in range(5):
            claim_file = a / "tmp_step_5" / ".ckptd-claim"
            if claim_file.exists():
                claim_file.unlink()
            go, out = ctx.Event(), ctx.Queue()
            procs = [
                ctx.Process(target=_claim_in, args=(str(m), f"n{i}-{trial}", go, out))
                for i, m in enumerate((a, b))
            ]
            for proc in procs:
                proc.start()
            go.set()
            won = [out.get(timeout=30) for _ in procs]
            for proc in procs:
                proc.join(30)
            assert sorted(won) == [False, True], won

    def test_the_holder_may_claim_again_and_release(self, tmp_path: Path) -> None:
        (tmp_path / "tmp_step_5").mkdir()
        root = _root(tmp_path)
        claim(root, 5, "n0", "att")
        claim(root, 5, "n0", "att")  # a restarted leader resuming its promotion
        with pytest.raises(ClaimedError, match="claimed for promotion by node n0"):
            claim(root, 5, "n1", "att")
        release(root, 5, "n1", "att")  # not the holder's: nothing happens
        assert (tmp_path / "tmp_step_5" / ".ckptd-claim").exists()
        release(root, 5, "n0", "att")
        claim(root, 5, "n1", "att")


class TestPointerLock:
    """Under the lock, an older step never replaces a newer step's pointer."""

    def test_a_newer_pointer_is_never_moved_back(self, two_mounts: tuple[Path, Path]) -> None:
        a, b = two_mounts
        for step in (9, 10):
            (a / f"step_{step}").mkdir()
        storage = LocalStorage()
        with pointer_lock(_root(a), "n0"):
            assert _advance_pointer(storage, _root(a), 10)
        # Through the other node's mount, once its cache has seen step_10.
        with pointer_lock(_root(b), "n1"):
            _advance_pointer(storage, _root(b), 9)
        assert read_pointer(_root(a)) == 10

    def test_a_held_lock_makes_the_other_node_wait(self, tmp_path: Path) -> None:
        root = _root(tmp_path)
        with pointer_lock(root, "n0"):
            lock = tmp_path / ".ckptd-pointer.lock"
            assert lock.read_text().startswith("n0 ")
            os.utime(lock, (0, 0))  # as if its holder died a long time ago
            with pointer_lock(root, "n1"):  # the stale lock is broken
                assert lock.read_text().startswith("n1 ")

"""Promotion's file-system steps on real files: what they accept, skip and refuse."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from pathlib import Path

import pytest

from daemon.base._errors import PromotionError, VerificationError
from daemon.config._config import RootConfig
from daemon.server._promotion import _verify_and_promote
from daemon.store._attempts import prepare
from daemon.store._local import LocalStorage
from daemon.store._verify import MANIFEST_NAME, scan_save
from orchestrator.protocol import ATTEMPT_MARKER, FileEntry


class TestFsync:
    """``LocalStorage.fsync`` flushes files and directories and never hangs."""

    def test_fifo_fails_at_once(self, tmp_path: Path) -> None:
        # A file swapped for a FIFO after verification: a blocking open would wait for a
        # writer forever (pytest-timeout ends this test if it does).
        fifo = tmp_path / "shard.distcp"
        os.mkfifo(fifo)
        with pytest.raises(OSError) as caught:
            LocalStorage().fsync(str(fifo))
        assert caught.value.errno == errno.EINVAL

    def test_file_and_directory(self, tmp_path: Path) -> None:
        (tmp_path / "a.bin").write_bytes(b"a" * 10)
        LocalStorage().fsync(str(tmp_path / "a.bin"))
        LocalStorage().fsync(str(tmp_path), directory=True)


class TestScan:
    """``scan_save`` describes the files a checkpoint is made of."""

    def test_manifest_leftover_is_not_a_checkpoint_file(self, tmp_path: Path) -> None:
        root = tmp_path / "run"
        tmp = root / "tmp_step_3"
        tmp.mkdir(parents=True)
        (tmp / "w.bin").write_bytes(b"w" * 100)
        # A manifest write cut short by a crash before its rename (resumed promotion).
        (tmp / f"{MANIFEST_NAME}.0123abcd.tmp").write_bytes(b'{"form')
        config = RootConfig(path=str(root), real=str(root))
        manifest = scan_save(config, 3, 1, {0: (FileEntry("w.bin", 100),)})
        assert manifest.files == {"w.bin": 100}


class TestRenamesWhatWasVerified:
    """The directory renamed to ``step_N`` is the one verified, never one swapped in."""

    def test_directory_swapped_after_verification_is_not_promoted(self, tmp_path: Path) -> None:
        root = tmp_path / "run"
        root.mkdir()
        config = RootConfig(path=str(root), real=str(root))
        tmp = root / "tmp_step_3"
        prepare(config, 3, "a1", 1)
        (tmp / "w.bin").write_bytes(b"verified")
        impostor = tmp_path / "impostor"

        impostor.mkdir()
        shutil.copy(tmp / ATTEMPT_MARKER, impostor / ATTEMPT_MARKER)  # the same attempt's
        (impostor / "w.bin").write_bytes(b"impostor")

        def swap() -> None:
            # Between verification and the rename another directory takes tmp_step_3's
            # place, in one atomic exchange: every path stays valid throughout.
            _exchange(impostor, tmp)

        with pytest.raises(PromotionError) as caught:
            _verify_and_promote(
                LocalStorage(), config, 3, 1, {0: (FileEntry("w.bin", 8),)}, "a1", swap
            )
        assert caught.value.errno == errno.ESTALE
        assert not (root / "step_3").exists()
        assert (tmp / "w.bin").read_bytes() == b"impostor"  # left where it was, unpromoted

    def test_other_attempts_files_are_refused(self, tmp_path: Path) -> None:
        root = tmp_path / "run"
        root.mkdir()
        config = RootConfig(path=str(root), real=str(root))
        prepare(config, 4, "other", 1)
        (root / "tmp_step_4" / "w.bin").write_bytes(b"w")
        with pytest.raises(VerificationError, match="belongs to attempt other, not to attempt a1"):
            scan_save(config, 4, 1, {}, "a1")
        with pytest.raises(VerificationError, match="belongs to no attempt"):
            os.unlink(root / "tmp_step_4" / ATTEMPT_MARKER)
            scan_save(config, 4, 1, {}, "a1")


def _exchange(a: Path, b: Path) -> None:
    """``renameat2(a, b, RENAME_EXCHANGE)``: swap two directories atomically."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), 2) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))

"""The journal on real files: round trip, group commit, torn tails, compaction, full disks."""

from __future__ import annotations

import errno
import os
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.ledger._records import (
    JBegin,
    JDone,
    JFail,
    JForget,
    JIntent,
    JournalFormatError,
    JournalRecord,
    JPromoted,
    JSaveFailed,
    frame,
    parse,
)
from daemon.store._journal import Journal
from orchestrator.protocol import FileEntry

RECORDS: list[JournalRecord] = [
    JBegin("/ckpt/run", 1, 0, 2, 100.0),
    JBegin("/ckpt/run", 1, 1, 2, 100.5),
    JDone("/ckpt/run", 1, 0, [FileEntry("model/__0_0.distcp", 4096)], 101.0),
    JFail("/ckpt/run", 2, 1, "CheckpointException: boom", 102.0),
    JSaveFailed("/ckpt/run", 2, "rank 1 failed", 102.0),
    JIntent("/ckpt/run", 1),
    JPromoted("/ckpt/run", 1, "/ckpt/run/step_1", 103.5),
    JForget("/ckpt/run", 2),
]


def _write(path: Path, records: list[JournalRecord]) -> None:
    journal = Journal(str(path))
    journal.open()

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(journal.run)
            await journal.append(records)
            tg.cancel_scope.cancel()

    anyio.run(main)
    journal.close()


def _reopen(path: Path) -> list[JournalRecord]:
    journal = Journal(str(path))
    try:
        return journal.open().records
    finally:
        journal.close()


class TestRoundTrip:
    """What is appended is what is replayed, in order."""

    def test_every_record_kind(self, tmp_path: Path) -> None:
        path = tmp_path / "state" / "journal"
        _write(path, RECORDS)
        assert _reopen(path) == RECORDS
        _write(path, RECORDS[:2])  # appends after the existing records
        assert _reopen(path) == RECORDS + RECORDS[:2]

    def test_not_a_journal_is_refused(self, tmp_path: Path) -> None:
        path = tmp_path / "journal"
        path.write_bytes(b"something else entirely")
        with pytest.raises(ValueError, match="not a ckptd journal"):
            Journal(str(path)).open()


class TestGroupCommit:
    """Concurrent appends share writes and fsyncs."""

    def test_many_concurrent_appends_few_commits(self, tmp_path: Path) -> None:
        journal = Journal(str(tmp_path / "journal"))
        journal.open()
        n = 200

        async def main() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(journal.run)
                async with anyio.create_task_group() as clients:
                    for i in range(n):
                        rec = JBegin("/r", i, 0, 1, float(i))
                        clients.start_soon(journal.append, [rec])
                tg.cancel_scope.cancel()

        anyio.run(main)
        journal.close()
        assert 1 <= journal.commits < n
        assert sorted(r.step for r in _reopen(tmp_path / "journal")) == list(range(n))


class TestTornTail:
    """A crash mid-write leaves a tail that is detected, dropped and never replayed."""

    def test_every_truncation_point(self, tmp_path: Path) -> None:
        path = tmp_path / "journal"
        _write(path, RECORDS)
        full = path.read_bytes()
        last = len(frame(RECORDS[-1]))
        for cut in range(1, last):
            path.write_bytes(full[:-cut])
            replay = Journal(str(path))
            got = replay.open()
            replay.close()
            assert got.records == RECORDS[:-1]
            assert got.dropped_bytes == last - cut
            # The tail was cut off on disk: appending continues from a clean end.
            assert path.stat().st_size == len(full) - last
        _write(path, [RECORDS[0]])
        assert _reopen(path) == [*RECORDS[:-1], RECORDS[0]]

    def test_flipped_byte_stops_replay_there(self, tmp_path: Path) -> None:
        path = tmp_path / "journal"
        _write(path, RECORDS)
        data = bytearray(path.read_bytes())
        offset = len(data) - len(frame(RECORDS[-1])) - len(frame(RECORDS[-2])) + 10
        data[offset] ^= 0xFF
        path.write_bytes(bytes(data))
        replay = parse(bytes(data))
        assert replay.records == RECORDS[:-2]
        assert replay.problem in ("checksum mismatch", "torn record")

    def test_torn_header(self, tmp_path: Path) -> None:
        path = tmp_path / "journal"
        path.write_bytes(b"CKP")
        assert _reopen(path) == []
        _write(path, RECORDS[:1])
        assert _reopen(path) == RECORDS[:1]

    @settings(max_examples=200, deadline=None)
    @given(st.binary(max_size=2000))
    def test_garbage_after_header_never_replays_garbage(self, tail: bytes) -> None:
        good = b"CKPTDJ\x00\x01" + b"".join(frame(r) for r in RECORDS)
        replay = parse(good + tail)
        assert replay.records[: len(RECORDS)] == RECORDS
        assert replay.valid_bytes + replay.dropped_bytes == len(good) + len(tail)


class TestCompaction:
    """Compaction replaces the journal with a snapshot, atomically."""

    def test_compacts_between_batches_once_grown(self, tmp_path: Path) -> None:
        path = tmp_path / "journal"
        journal = Journal(str(path))
        journal.open()
        live = [RECORDS[0], RECORDS[1]]

        async def main() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(journal.run, lambda: live, 4096)
                for i in range(200):  # each batch alone: 200 appends, far past 4 KiB
                    await journal.append([JBegin("/r", i, 0, 1, float(i))])
                tg.cancel_scope.cancel()

        anyio.run(main)
        journal.close()
        replayed = _reopen(path)
        # Compacted to the snapshot at least once, then appended after it.
        assert replayed[:2] == live and len(replayed) < 200
        assert path.stat().st_size < 3 * 4096

    def test_compact_then_append(self, tmp_path: Path) -> None:
        path = tmp_path / "journal"
        _write(path, RECORDS * 50)
        big = path.stat().st_size
        journal = Journal(str(path))
        journal.open()
        journal.compact(RECORDS[:2])
        assert journal.size == path.stat().st_size < big

        async def main() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(journal.run)
                await journal.append([RECORDS[5]])
                tg.cancel_scope.cancel()

        anyio.run(main)
        journal.close()
        assert _reopen(path) == [RECORDS[0], RECORDS[1], RECORDS[5]]
        assert not (tmp_path / "journal.compact").exists()


@pytest.fixture
def full_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 64 KiB tmpfs (needs root and CAP_SYS_ADMIN, which CI machines have)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


class TestFullDisk:
    """ENOSPC fails the batch, leaves the journal replayable, and later appends work."""

    def test_enospc(self, full_fs: Path) -> None:
        path = full_fs / "journal"
        journal = Journal(str(path))
        journal.open()
        filler = full_fs / "filler"
        caught: list[OSError] = []

        async def main() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(journal.run)
                await journal.append(RECORDS[:2])
                fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
                try:  # fill the filesystem to the last byte
                    for size in (4096, 512, 1):
                        while os.write(fd, b"\0" * size):
                            pass
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                finally:
                    os.close(fd)
                try:
                    await journal.append([JBegin("/r", 9, 0, 1, 1.0)] * 200)
                except OSError as exc:
                    caught.append(exc)
                os.unlink(filler)
                await journal.append(RECORDS[2:4])
                tg.cancel_scope.cancel()

        anyio.run(main)
        journal.close()
        assert caught and caught[0].errno == errno.ENOSPC
        assert _reopen(path) == RECORDS[:4]


class TestVersions:
    """Records of another version: older shapes replay; an unknown kind stops the daemon."""

    def test_begin_without_attempt_replays_as_unnamed(self, tmp_path: Path) -> None:
        old = msgspec.msgpack.encode(["b", "/ckpt/run", 1, 0, 2, 100.0])  # before attempts
        data = b"CKPTDJ\x00\x01" + struct.pack("<II", len(old), zlib.crc32(old)) + old
        assert parse(data).records == [JBegin("/ckpt/run", 1, 0, 2, 100.0, "")]

    def test_unknown_intact_record_refuses_and_keeps_the_file(
        self, tmp_path: Path, short_dir: Path
    ) -> None:
        state = tmp_path / "state"
        state.mkdir()
        path = state / "journal"
        _write(path, RECORDS)
        newer = msgspec.msgpack.encode(["z", "/ckpt/run", 3, "a record of a newer version"])
        with open(path, "ab") as fh:
            fh.write(struct.pack("<II", len(newer), zlib.crc32(newer)) + newer)
            fh.write(frame(RECORDS[0]))  # acknowledged after it: must not be cut off
        before = path.read_bytes()
        with pytest.raises(JournalFormatError, match="newer ckptd"):
            parse(before)
        with pytest.raises(JournalFormatError):
            Journal(str(path)).open()
        assert path.read_bytes() == before
        root = tmp_path / "run"
        root.mkdir()
        proc = subprocess.run(
            [sys.executable, "-m", "daemon", "serve", "--root", str(root)]
            + ["--socket", str(short_dir / "d.sock"), "--state-dir", str(state)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "newer ckptd" in proc.stdout + proc.stderr
        assert path.read_bytes() == before

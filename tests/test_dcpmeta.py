"""Tests for daemon.store._dcpmeta: parsing DCP .metadata without unpickling it."""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import (
    FileSystemReader,
    FileSystemWriter,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.state_dict_saver import save

from daemon.store._dcpdir import check_dcp_dir
from daemon.store._dcpmeta import (
    DcpMetadataError,
    Global,
    Instance,
    ShardRef,
    parse_pickle,
    referenced_shards,
)

META = ".metadata"


def _state_dict() -> dict[str, object]:
    torch.manual_seed(0)
    return {
        "model": {
            "w": torch.randn(8, 16),
            "b": torch.zeros(16, dtype=torch.float16),
            "emb": torch.arange(60, dtype=torch.int64).reshape(3, 4, 5),
            "scale": torch.tensor(3.5, dtype=torch.float64),
        },
        "optim": {
            "state": {"m": torch.ones(4, 4, dtype=torch.bfloat16), "mask": torch.tensor([True])},
            "lr": 0.1,
        },
        "blob": b"\x00\x01" * 50,
        "step": 7,
    }


def _save(directory: Path, thread_count: int = 2, *, single_file_per_rank: bool = True) -> Path:
    writer = FileSystemWriter(
        str(directory), thread_count=thread_count, single_file_per_rank=single_file_per_rank
    )
    with warnings.catch_warnings():
        # dcp.save always warns when asked to save without a process group.
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled", category=UserWarning
        )
        save(_state_dict(), storage_writer=writer, no_dist=True)
    return directory


def _read_metadata(directory: Path) -> Metadata:
    """Really unpickle .metadata, as torch does; trusted test data only."""
    return FileSystemReader(str(directory)).read_metadata()


def _truth(directory: Path) -> list[ShardRef]:
    sizes: dict[str, int] = {}
    for info in _read_metadata(directory).storage_data.values():
        end = info.offset + info.length
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), end)
    return [ShardRef(path, size) for path, size in sorted(sizes.items())]


def _crafted(directory: Path, entries: dict[str, int]) -> Path:
    """Write a .metadata whose storage_data references ``entries`` (path -> length)."""
    storage = {
        MetadataIndex(f"item{i}"): _StorageInfo(path, 0, length)
        for i, (path, length) in enumerate(entries.items())
    }
    directory.mkdir(exist_ok=True)
    (directory / META).write_bytes(pickle.dumps(Metadata({}, storage_data=storage)))
    return directory


@pytest.fixture(scope="module")
def real_metadata(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return (_save(tmp_path_factory.mktemp("dcp") / "ckpt") / META).read_bytes()


class TestReferencedShards:
    """referenced_shards agrees with the metadata torch itself unpickles."""

    @pytest.mark.parametrize("thread_count", [1, 2, 3, 4])
    def test_matches_unpickled_metadata(self, tmp_path: Path, thread_count: int) -> None:
        ckpt = _save(tmp_path / "ckpt", thread_count)
        shards = referenced_shards((ckpt / META).read_bytes())
        assert shards == _truth(ckpt)
        assert len(shards) == thread_count
        assert {s.relative_path for s in shards} == {p.name for p in ckpt.glob("*.distcp")}
        for shard in shards:
            assert shard.min_size <= (ckpt / shard.relative_path).stat().st_size

    def test_one_file_per_item(self, tmp_path: Path) -> None:
        ckpt = _save(tmp_path / "ckpt", 1, single_file_per_rank=False)
        shards = referenced_shards((ckpt / META).read_bytes())
        assert shards == _truth(ckpt)
        assert len(shards) == 9  # six tensors and three byte items

    @pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
    def test_every_pickle_protocol(self, tmp_path: Path, protocol: int) -> None:
        ckpt = _save(tmp_path / "ckpt")
        data = pickle.dumps(_read_metadata(ckpt), protocol=protocol)
        assert referenced_shards(data) == _truth(ckpt)

    def test_real_pickle_shape(self, real_metadata: bytes) -> None:
        root = parse_pickle(real_metadata)
        assert isinstance(root, Instance)
        assert root.cls == Global("torch.distributed.checkpoint.metadata", "Metadata")
        assert isinstance(root.state, dict)
        storage = root.state["storage_data"]
        assert isinstance(storage, dict) and storage
        for key, info in storage.items():
            assert isinstance(key, Instance) and key.cls.name == "MetadataIndex"
            assert isinstance(info, Instance)
            assert info.cls == Global("torch.distributed.checkpoint.filesystem", "_StorageInfo")
            assert info.args == ()
            # _StorageInfo.__getstate__ drops transform_descriptors when it is None.
            assert isinstance(info.state, dict)
            assert set(info.state) == {"relative_path", "offset", "length"}

    def test_size_limit(self, real_metadata: bytes) -> None:
        assert referenced_shards(real_metadata, max_bytes=len(real_metadata))
        with pytest.raises(DcpMetadataError, match="limit"):
            referenced_shards(real_metadata, max_bytes=len(real_metadata) - 1)


class TestCheckDcpDir:
    """check_dcp_dir reports each way a checkpoint directory can be incomplete."""

    def test_complete_checkpoint(self, tmp_path: Path) -> None:
        assert check_dcp_dir(str(_save(tmp_path / "ckpt"))) == []

    def test_truncated_shard(self, tmp_path: Path) -> None:
        ckpt = _save(tmp_path / "ckpt")
        shard = _truth(ckpt)[1]
        os.truncate(ckpt / shard.relative_path, shard.min_size - 100)
        need = f"metadata needs at least {shard.min_size}"
        assert check_dcp_dir(str(ckpt)) == [
            f"{shard.relative_path}: {shard.min_size - 100} bytes on disk, {need}"
        ]

    def test_deleted_shard(self, tmp_path: Path) -> None:
        ckpt = _save(tmp_path / "ckpt")
        (ckpt / "__0_0.distcp").unlink()
        assert check_dcp_dir(str(ckpt)) == ["__0_0.distcp: missing"]

    def test_shard_replaced_by_directory(self, tmp_path: Path) -> None:
        ckpt = _save(tmp_path / "ckpt")
        (ckpt / "__0_1.distcp").unlink()
        (ckpt / "__0_1.distcp").mkdir()
        assert check_dcp_dir(str(ckpt)) == ["__0_1.distcp: not a regular file"]

    def test_missing_metadata(self, tmp_path: Path) -> None:
        ckpt = _save(tmp_path / "ckpt")
        (ckpt / META).unlink()
        assert check_dcp_dir(str(ckpt)) == [".metadata: missing"]
        assert check_dcp_dir(str(tmp_path / "never-created")) == [".metadata: missing"]

    def test_metadata_is_not_a_regular_file(self, tmp_path: Path) -> None:
        (tmp_path / "dir" / META).mkdir(parents=True)
        assert check_dcp_dir(str(tmp_path / "dir")) == [".metadata: unreadable (Is a directory)"]
        os.mkfifo(tmp_path / META)  # must not block waiting for a writer
        assert check_dcp_dir(str(tmp_path)) == [".metadata: unreadable (not a regular file)"]

    @pytest.mark.parametrize(
        "garbage",
        [b"", b"not a pickle at all", b"\x80\x04\x95garbage", pickle.dumps({"a": 1})],
    )
    def test_garbage_metadata(self, tmp_path: Path, garbage: bytes) -> None:
        ckpt = _save(tmp_path / "ckpt")
        (ckpt / META).write_bytes(garbage)
        [problem] = check_dcp_dir(str(ckpt))
        assert problem.startswith(".metadata: unparseable (")

    @pytest.mark.parametrize("keep", [1, 0.25, 0.5, 0.9, -1])
    def test_torn_metadata(self, tmp_path: Path, keep: float) -> None:
        ckpt = _save(tmp_path / "ckpt")
        data = (ckpt / META).read_bytes()
        cut = int(keep) if isinstance(keep, int) else int(len(data) * keep)
        (ckpt / META).write_bytes(data[:cut])
        [problem] = check_dcp_dir(str(ckpt))
        assert problem.startswith(".metadata: unparseable (")

    def test_shards_in_a_subdirectory(self, tmp_path: Path) -> None:
        ckpt = _save(tmp_path / "ckpt")
        metadata = _read_metadata(ckpt)
        (ckpt / "model").mkdir()
        for info in metadata.storage_data.values():
            info.relative_path = f"model/{info.relative_path}"
        for shard in ckpt.glob("*.distcp"):
            shard.rename(ckpt / "model" / shard.name)
        (ckpt / META).write_bytes(pickle.dumps(metadata))
        assert check_dcp_dir(str(ckpt)) == []
        os.truncate(ckpt / "model" / "__0_1.distcp", 1024)
        [problem] = check_dcp_dir(str(ckpt))
        assert problem.startswith("model/__0_1.distcp: 1024 bytes on disk, metadata needs")


class TestPathSafety:
    """Paths in metadata cannot make check_dcp_dir accept files outside the checkpoint."""

    @pytest.mark.parametrize(
        ("path", "problem"),
        [
            ("../../etc/passwd", "path escapes the checkpoint directory"),
            ("sub/../../outside.bin", "path escapes the checkpoint directory"),
            ("/etc/passwd", "absolute path in metadata"),
            ("//etc/passwd", "absolute path in metadata"),
            ("", "invalid path in metadata"),
            (".", "not a regular file"),
        ],
    )
    def test_escaping_path(self, tmp_path: Path, path: str, problem: str) -> None:
        (tmp_path / "outside.bin").write_bytes(b"x" * 100)
        ckpt = _crafted(tmp_path / "ckpt", {path: 1})
        (ckpt / "sub").mkdir()
        assert check_dcp_dir(str(ckpt)) == [f"{path}: {problem}"]

    def test_symlink_out_of_the_directory(self, tmp_path: Path) -> None:
        (tmp_path / "outside.bin").write_bytes(b"x" * 100)
        ckpt = _crafted(tmp_path / "ckpt", {"link.distcp": 10, "sub/inner.distcp": 10})
        (ckpt / "link.distcp").symlink_to(tmp_path / "outside.bin")
        (ckpt / "sub").symlink_to(tmp_path)
        assert check_dcp_dir(str(ckpt)) == [
            "link.distcp: path resolves outside the checkpoint directory",
            "sub/inner.distcp: path resolves outside the checkpoint directory",
        ]

    def test_symlink_inside_the_directory(self, tmp_path: Path) -> None:
        ckpt = _crafted(tmp_path / "ckpt", {"link.distcp": 10})
        (ckpt / "real.distcp").write_bytes(b"x" * 10)
        (ckpt / "link.distcp").symlink_to("real.distcp")
        assert check_dcp_dir(str(ckpt)) == []

    def test_unprintable_path_is_escaped(self, tmp_path: Path) -> None:
        ckpt = _crafted(tmp_path / "ckpt", {"a\nb": 1, "a\0b": 1, "d/" * 150: 1})
        assert check_dcp_dir(str(ckpt)) == [
            "'a\\x00b': invalid path in metadata",
            "'a\\nb': missing",
            f"'{'d/' * 100}': missing",
        ]


class _RunsCommand:
    """Pickles as a call to os.system; only ever pickled, never unpickled here."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (self.command,))


class TestHostileInput:
    """Hostile or malformed input never runs code and only raises DcpMetadataError."""

    @pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
    def test_reduce_to_os_system_is_inert(self, tmp_path: Path, protocol: int) -> None:
        sentinel = tmp_path / "SENTINEL"
        data = pickle.dumps(_RunsCommand(f"touch {sentinel}"), protocol=protocol)
        value = parse_pickle(data)
        assert isinstance(value, Instance)
        assert value.cls == Global(os.system.__module__, "system")
        assert value.args == (f"touch {sentinel}",)
        with pytest.raises(DcpMetadataError, match="Metadata"):
            referenced_shards(data)
        (tmp_path / "ckpt").mkdir()
        (tmp_path / "ckpt" / META).write_bytes(data)
        assert check_dcp_dir(str(tmp_path / "ckpt"))[0].startswith(".metadata: unparseable")
        assert not sentinel.exists()

    def test_os_system_inside_real_metadata(self, tmp_path: Path) -> None:
        sentinel = tmp_path / "SENTINEL"
        ckpt = _save(tmp_path / "ckpt")
        expected = _truth(ckpt)
        metadata = _read_metadata(ckpt)
        metadata.planner_data = _RunsCommand(f"touch {sentinel}")
        (ckpt / META).write_bytes(pickle.dumps(metadata))
        assert referenced_shards((ckpt / META).read_bytes()) == expected
        assert check_dcp_dir(str(ckpt)) == []
        assert not sentinel.exists()

    @pytest.mark.parametrize(
        ("data", "opcode"),
        [
            (b"Pid\n.", "PERSID"),
            (b"\x80\x02NQ.", "BINPERSID"),
            (b"\x80\x02\x82\x01.", "EXT1"),
            (b"\x80\x02\x83\x01\x00.", "EXT2"),
            (b"\x80\x02\x84\x01\x00\x00\x00.", "EXT4"),
            (b"\x80\x05\x97.", "NEXT_BUFFER"),
            (b"\x80\x05N\x98.", "READONLY_BUFFER"),
        ],
    )
    def test_unsupported_opcode(self, data: bytes, opcode: str) -> None:
        with pytest.raises(DcpMetadataError, match=f"unsupported pickle opcode {opcode}"):
            parse_pickle(data)

    @pytest.mark.parametrize(
        ("data", "message"),
        [
            (b"(" * 5000 + b".", "MARK nesting"),
            (b"N" * ((1 << 20) + 1) + b".", "stack exceeds"),
            (b"0.", "underflow"),
            (b"N(.", "unclosed MARK"),
            (b"NN.", "extra values"),
            (b"h\x07.", "memo index"),
            (b"\x80\x06N.", "protocol"),
            (b"\x80\x02Nt.", "MARK"),
            (b"\x80\x02]}b.", "BUILD: target is not an object"),
            (b"\x80\x02NNR.", "global"),
            (b"\x80\x02}]Ns.", "unhashable"),
        ],
    )
    def test_malformed(self, data: bytes, message: str) -> None:
        with pytest.raises(DcpMetadataError, match=message):
            parse_pickle(data)

    def test_deep_tuple_key_is_refused_before_hashing(self) -> None:
        deep = b"\x80\x02}" + b"N" + b"\x85" * 100_000 + b"Ns."
        with pytest.raises(DcpMetadataError, match="too large"):
            parse_pickle(deep)
        # (t, t) doubled 64 times: hashing it would take 2**64 steps.
        dag = b"\x80\x04\x8f(N" + b"2\x86" * 64 + b"\x90."
        with pytest.raises(DcpMetadataError, match="too large"):
            parse_pickle(dag)

    def test_deeply_nested_value_is_harmless(self) -> None:
        deep = b"\x80\x02N" + b"\x85" * 100_000 + b"."
        assert isinstance(parse_pickle(deep), tuple)
        with pytest.raises(DcpMetadataError):
            referenced_shards(deep)

    @settings(max_examples=300, deadline=None, database=None)
    @given(st.binary(max_size=600))
    def test_random_bytes(self, data: bytes) -> None:
        try:
            referenced_shards(data)
        except DcpMetadataError:
            pass

    @settings(max_examples=300, deadline=None, database=None)
    @given(
        st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=8),
        st.one_of(st.none(), st.integers(0, 1 << 16)),
    )
    def test_mutated_real_metadata(
        self, real_metadata: bytes, edits: list[tuple[int, int]], cut: int | None
    ) -> None:
        data = bytearray(real_metadata)
        for position, byte in edits:
            data[position % len(data)] = byte
        try:
            shards = referenced_shards(bytes(data[:cut]))
        except DcpMetadataError:
            return
        assert all(isinstance(s.relative_path, str) and s.min_size >= 0 for s in shards)

"""The daemon's checks of each save form, on files written by real torch saves.

Per-rank metadata (``use_collectives=False``: ``__R.metadata`` beside each rank's
shards, no ``.metadata``), safetensors headers and their index json
(``HuggingFaceStorageWriter``), and the refusal of a step with nothing to verify. The
files are made by torch itself, in this process, then damaged as a disk or a crash would.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

from daemon.base._errors import VerificationError
from daemon.config._config import RootConfig
from daemon.store._dcpdir import check_dcp_dir
from daemon.store._safetensors import MAX_HEADER, check_index, check_safetensors
from daemon.store._verify import scan_save
from orchestrator.protocol import FileEntry

SAFETENSORS = "model-00001-of-00001.safetensors"
INDEX = "model.safetensors.index.json"


def _state(rank: int) -> dict[str, torch.Tensor]:
    return {
        f"rank{rank}.weight": torch.arange(256, dtype=torch.float32) + rank,
        "shared.bias": torch.ones(4, 4, dtype=torch.bfloat16),
    }


class _AsRank(FileSystemWriter):
    """torch's own writer, saving without collectives as rank ``rank`` would.

    A process saving with ``no_dist`` is rank 0; this one names its files (and its
    ``__R.metadata``) as rank ``rank`` of a job does, so one process writes a 2-rank
    directory.
    """

    def __init__(self, path: Path, rank: int) -> None:
        super().__init__(path)
        self.as_rank = rank

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, rank=self.as_rank, use_collectives=False)


def per_rank_files(directory: Path, ranks: int = 2) -> Path:
    """A directory of ``ranks`` ranks' files saved without collectives, as torch writes it."""
    for rank in range(ranks):
        save(
            _state(rank),
            storage_writer=_AsRank(directory, rank),
            no_dist=True,
            use_collectives=False,
        )
    return directory


def _hf(directory: Path) -> Path:
    save(_state(0), storage_writer=HuggingFaceStorageWriter(str(directory)), no_dist=True)
    return directory


class TestPerRankMetadata:
    """Each rank's shards are checked against its own ``__R.metadata``."""

    def test_intact_and_loadable(self, tmp_path: Path) -> None:
        ckpt = per_rank_files(tmp_path / "ckpt")
        names = sorted(p.name for p in ckpt.iterdir())
        assert names == ["__0.metadata", "__0_0.distcp", "__1.metadata", "__1_0.distcp"]
        assert check_dcp_dir(str(ckpt)) == []
        # What was accepted is what torch reads: each rank's tensors in its own metadata,
        # and a lone process (rank 0) loads rank 0's, falling back to __0.metadata.
        for rank in (0, 1):
            metadata = FileSystemReader(ckpt).read_metadata(rank=rank)
            assert set(metadata.state_dict_metadata) == set(_state(rank))
        loaded = {k: torch.zeros_like(v) for k, v in _state(0).items()}
        load(loaded, checkpoint_id=str(ckpt), no_dist=True)
        assert all(torch.equal(loaded[k], v) for k, v in _state(0).items())

    def test_a_ranks_metadata_missing(self, tmp_path: Path) -> None:
        ckpt = per_rank_files(tmp_path / "ckpt")
        (ckpt / "__1.metadata").unlink()
        assert check_dcp_dir(str(ckpt)) == [
            "__1_0.distcp: no __1.metadata (rank 1's metadata) covers it"
        ]

    def test_a_shard_its_metadata_names_missing(self, tmp_path: Path) -> None:
        ckpt = per_rank_files(tmp_path / "ckpt")
        (ckpt / "__1_0.distcp").unlink()
        assert check_dcp_dir(str(ckpt)) == ["__1_0.distcp: missing"]

    def test_a_short_shard(self, tmp_path: Path) -> None:
        ckpt = per_rank_files(tmp_path / "ckpt")
        os.truncate(ckpt / "__0_0.distcp", 100)
        [problem] = check_dcp_dir(str(ckpt))
        assert problem.startswith("__0_0.distcp: 100 bytes on disk, metadata needs at least")

    def test_an_unparseable_rank_metadata(self, tmp_path: Path) -> None:
        ckpt = per_rank_files(tmp_path / "ckpt")
        data = (ckpt / "__0.metadata").read_bytes()
        (ckpt / "__0.metadata").write_bytes(data[: len(data) // 2])
        [problem] = check_dcp_dir(str(ckpt))
        assert problem.startswith("__0.metadata: unparseable")

    def test_a_global_metadata_is_still_required_without_rank_files(self, tmp_path: Path) -> None:
        ckpt = per_rank_files(tmp_path / "ckpt")
        for rank in (0, 1):
            (ckpt / f"__{rank}.metadata").unlink()
        assert check_dcp_dir(str(ckpt)) == [".metadata: missing"]


def _header(path: Path) -> tuple[dict[str, Any], int]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header: dict[str, Any] = json.loads(data[8 : 8 + length])
    return header, length


def _rewrite_header(path: Path, header: dict[str, Any]) -> None:
    """Write ``header`` in place of the file's own, keeping its data."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])


class TestSafetensorsHeader:
    """A safetensors file's header is parsed, and its tensors' data must lie in the file."""

    def test_intact(self, tmp_path: Path) -> None:
        ckpt = _hf(tmp_path / "hf")
        header, _ = _header(ckpt / SAFETENSORS)
        assert {"rank0.weight", "shared.bias"} <= set(header)
        assert check_safetensors(str(ckpt / SAFETENSORS)) == []

    def test_truncated_within_the_header(self, tmp_path: Path) -> None:
        path = _hf(tmp_path / "hf") / SAFETENSORS
        _, length = _header(path)
        os.truncate(path, 8 + length // 2)
        assert check_safetensors(str(path)) == [
            f"header length {length} runs past the file's {8 + length // 2} bytes"
        ]
        os.truncate(path, 5)
        assert check_safetensors(str(path)) == ["5 bytes: shorter than the 8-byte header length"]

    def test_offsets_past_the_end_of_the_file(self, tmp_path: Path) -> None:
        path = _hf(tmp_path / "hf") / SAFETENSORS
        os.truncate(path, path.stat().st_size - 10)
        problems = check_safetensors(str(path))
        assert len(problems) == 1 and "is past the data" in problems[0], problems

    def test_bad_json(self, tmp_path: Path) -> None:
        path = _hf(tmp_path / "hf") / SAFETENSORS
        data = bytearray(path.read_bytes())
        data[8:12] = b"{{{{"
        path.write_bytes(bytes(data))
        [problem] = check_safetensors(str(path))
        assert problem.startswith("header is not JSON")

    def test_a_huge_header_length(self, tmp_path: Path) -> None:
        path = tmp_path / "x.safetensors"
        path.write_bytes(struct.pack("<Q", MAX_HEADER + 1) + b"{}")
        [problem] = check_safetensors(str(path))
        assert "exceeds the" in problem

    def test_dtype_and_shape_must_match_the_bytes(self, tmp_path: Path) -> None:
        path = _hf(tmp_path / "hf") / SAFETENSORS
        header, _ = _header(path)
        header["rank0.weight"]["shape"] = [512]  # twice the elements its offsets hold
        header["shared.bias"]["dtype"] = "Q7"
        _rewrite_header(path, header)
        problems = check_safetensors(str(path))
        assert "tensor 'rank0.weight': F32 [512] needs 2048 bytes" in problems[0]
        assert problems[1] == "tensor 'shared.bias': unknown dtype 'Q7'"

    def test_not_an_object(self, tmp_path: Path) -> None:
        path = _hf(tmp_path / "hf") / SAFETENSORS
        _rewrite_header(path, [1, 2])  # type: ignore[arg-type]
        assert check_safetensors(str(path)) == ["header is not a JSON object"]


class TestSafetensorsIndex:
    """An index's weight map must name files beside it that hold its tensors."""

    def test_intact(self, tmp_path: Path) -> None:
        ckpt = _hf(tmp_path / "hf")
        weights = json.loads((ckpt / INDEX).read_text())["weight_map"]
        assert set(weights.values()) == {SAFETENSORS}
        assert check_index(str(ckpt / INDEX)) == []

    def test_a_named_file_missing(self, tmp_path: Path) -> None:
        ckpt = _hf(tmp_path / "hf")
        (ckpt / SAFETENSORS).unlink()
        assert check_index(str(ckpt / INDEX)) == [
            f"weight_map names '{SAFETENSORS}' (2 tensors), which is missing"
        ]

    def test_a_tensor_the_file_lacks(self, tmp_path: Path) -> None:
        ckpt = _hf(tmp_path / "hf")
        index = json.loads((ckpt / INDEX).read_text())
        index["weight_map"]["ghost"] = SAFETENSORS
        (ckpt / INDEX).write_text(json.dumps(index))
        [problem] = check_index(str(ckpt / INDEX))
        assert "its header lacks (first: 'ghost')" in problem

    @pytest.mark.parametrize("name", ["../elsewhere.safetensors", "/etc/passwd"])
    def test_a_path_outside(self, tmp_path: Path, name: str) -> None:
        ckpt = _hf(tmp_path / "hf")
        (ckpt / INDEX).write_text(json.dumps({"weight_map": {"w": name}}))
        [problem] = check_index(str(ckpt / INDEX))
        assert "not a path inside its directory" in problem

    def test_bad_json_and_no_weight_map(self, tmp_path: Path) -> None:
        ckpt = _hf(tmp_path / "hf")
        (ckpt / INDEX).write_text("{")
        assert check_index(str(ckpt / INDEX))[0].startswith("not JSON")
        (ckpt / INDEX).write_text(json.dumps({"metadata": {}}))
        assert check_index(str(ckpt / INDEX)) == [
            "no weight_map mapping tensor names to file names"
        ]


def _root(path: Path) -> RootConfig:
    return RootConfig(path=str(path), real=str(path))


class TestScanSave:
    """A step's verification runs each form's checks, and refuses a step it cannot verify."""

    def test_a_damaged_safetensors_file_nobody_reported(self, tmp_path: Path) -> None:
        _hf(tmp_path / "tmp_step_1")
        assert scan_save(_root(tmp_path), 1, 1, {}).files  # unreported, but parsed: verified
        os.truncate(tmp_path / "tmp_step_1" / SAFETENSORS, 300)
        with pytest.raises(VerificationError, match=f"{SAFETENSORS}: "):
            scan_save(_root(tmp_path), 1, 1, {})

    def test_the_index_naming_a_missing_file(self, tmp_path: Path) -> None:
        _hf(tmp_path / "tmp_step_2")
        (tmp_path / "tmp_step_2" / SAFETENSORS).unlink()
        with pytest.raises(VerificationError, match=f"{INDEX}: weight_map names"):
            scan_save(_root(tmp_path), 2, 1, {})

    def test_per_rank_metadata(self, tmp_path: Path) -> None:
        per_rank_files(tmp_path / "tmp_step_3" / "model")
        assert scan_save(_root(tmp_path), 3, 2, {}).dcp_dirs == ["model"]
        (tmp_path / "tmp_step_3" / "model" / "__0.metadata").unlink()
        with pytest.raises(VerificationError, match="model/__0_0.distcp: no __0.metadata"):
            scan_save(_root(tmp_path), 3, 2, {})

    def test_nothing_to_verify(self, tmp_path: Path) -> None:
        step = tmp_path / "tmp_step_4"
        step.mkdir()
        with pytest.raises(VerificationError, match=r"unknown save form.*\(empty\)"):
            scan_save(_root(tmp_path), 4, 2, {0: (), 1: ()})
        torch.save(_state(0), step / "model.pt")
        with pytest.raises(VerificationError, match=r"unknown save form.*it holds model\.pt"):
            scan_save(_root(tmp_path), 4, 2, {0: (), 1: ()})
        # The same file, reported with its size by the rank that wrote it, is verified.
        size = (step / "model.pt").stat().st_size
        manifest = scan_save(_root(tmp_path), 4, 2, {0: (FileEntry("model.pt", size),), 1: ()})
        assert manifest.files == {"model.pt": size}

"""Inert checks of safetensors files and their index json, as DCP's HF writer leaves them.

``torch.distributed.checkpoint.HuggingFaceStorageWriter`` writes no DCP ``.metadata``:
each rank writes ``shard-{R+1:05d}-model-*.safetensors`` (in ``sharded/`` when the save
is consolidated), and with consolidation the coordinator then writes
``model-*-of-*.safetensors`` and ``model.safetensors.index.json``. So the daemon checks
the files themselves, by the format's own rules, reading only headers:

- a safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of
  JSON, then the data. Every tensor entry names a known ``dtype``, a ``shape`` of
  non-negative ints and ``data_offsets`` ``[begin, end]`` relative to the data, whose
  length is exactly what the dtype and shape need and whose end lies within the file;
- an index's ``weight_map`` maps each tensor to a file beside the index, which must
  exist and whose header must hold that tensor.

Nothing is executed or imported: JSON is decoded with msgspec, sizes are bounded
(safetensors' own 100 MB header limit; indexes up to 64 MB). Blocking filesystem reads;
callers run these in a worker thread.
"""

from __future__ import annotations

import errno
import math
import os
import stat
import struct
from typing import Final

import msgspec

__all__ = [
    "SafetensorsError",
    "check_index",
    "check_safetensors",
    "is_index",
    "is_safetensors",
    "tensor_names",
]

MAX_HEADER: Final = 100 * 1024 * 1024
"""Largest header accepted: the limit the safetensors library itself enforces."""
MAX_INDEX: Final = 64 * 1024 * 1024
_LEN: Final = 8
_SUFFIX: Final = ".safetensors"
_INDEX_SUFFIX: Final = ".safetensors.index.json"
_META: Final = "__metadata__"
_MAX_SHOWN: Final = 120
_MAX_NAMED: Final = 20  # problems named per file before "... and N more"
_BITS: Final = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}
"""Bits per element of every dtype the safetensors format (0.8) defines."""


class SafetensorsError(ValueError):
    """Raised when a safetensors file or index cannot be read or breaks the format."""


def is_safetensors(name: str) -> bool:
    """Whether ``name`` is a safetensors file by its name."""
    return name.endswith(_SUFFIX)


def is_index(name: str) -> bool:
    """Whether ``name`` is a safetensors index (``model.safetensors.index.json``)."""
    return name.endswith(_INDEX_SUFFIX)


def _show(text: str) -> str:
    return (
        repr(text) if text.isprintable() and len(text) <= _MAX_SHOWN else ascii(text[:_MAX_SHOWN])
    )


def _open_regular(path: str) -> tuple[int, int]:
    """An fd on ``path`` (no symlink followed, no FIFO blocked on) and its size."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file")
    return fd, st.st_size


def _read_exact(fd: int, offset: int, count: int) -> bytes:
    data = os.pread(fd, count, offset)
    while len(data) < count:  # short reads happen on network filesystems
        more = os.pread(fd, count - len(data), offset + len(data))
        if not more:
            raise SafetensorsError(f"ended after {offset + len(data)} bytes while reading")
        data += more
    return data


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry_problem(name: str, entry: object, available: int) -> str | None:
    """What is wrong with one tensor's header entry, given the data's length."""
    if not isinstance(entry, dict):
        return f"tensor {_show(name)}: entry is not an object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _BITS:
        return f"tensor {_show(name)}: unknown dtype {_show(str(dtype))}"
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        return f"tensor {_show(name)}: shape is not a list of non-negative integers"
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        return f"tensor {_show(name)}: data_offsets is not [begin, end] with begin <= end"
    begin, end = offsets
    bits = math.prod(shape) * _BITS[dtype]
    if bits % 8 or bits // 8 != end - begin:
        return (
            f"tensor {_show(name)}: {dtype} {shape} needs {bits / 8:g} bytes, "
            f"data_offsets [{begin}, {end}] hold {end - begin}"
        )
    if end > available:
        return f"tensor {_show(name)}: data_offsets end {end} is past the data ({available} bytes)"
    return None


def _header(path: str) -> tuple[dict[str, object], int]:
    """The decoded JSON header of the safetensors file at ``path``, and the data's length.

    Raises:
        OSError: the file cannot be opened or read, or is not a regular file.
        SafetensorsError: the header length or JSON is malformed.
    """
    fd, size = _open_regular(path)
    try:
        if size < _LEN:
            raise SafetensorsError(f"{size} bytes: shorter than the 8-byte header length")
        (length,) = struct.unpack("<Q", _read_exact(fd, 0, _LEN))
        if length > MAX_HEADER:
            raise SafetensorsError(f"header length {length} exceeds the {MAX_HEADER}-byte limit")
        if _LEN + length > size:
            raise SafetensorsError(f"header length {length} runs past the file's {size} bytes")
        raw = _read_exact(fd, _LEN, length)
    finally:
        os.close(fd)
    header = _decode(raw, "header is ")
    if not isinstance(header, dict):
        raise SafetensorsError("header is not a JSON object")
    return header, size - _LEN - length


def check_safetensors(path: str) -> list[str]:
    """Return the problems (empty list = OK) of the safetensors file at ``path``.

    Returns:
        Human-readable problems, without the file's name (the caller prefixes it), e.g.
        ``"tensor 'w': data_offsets end 4096 is past the data (1024 bytes)"``.
    """
    try:
        header, available = _header(path)
    except FileNotFoundError:
        return ["missing"]
    except OSError as exc:
        return [f"unreadable ({exc.strerror or exc})"]
    except SafetensorsError as exc:
        return [str(exc)]
    problems = []
    meta = header.get(_META)
    if meta is not None and (
        not isinstance(meta, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    ):
        problems.append(f"{_META} is not an object of strings")
    for name, entry in header.items():
        if name != _META:
            problem = _entry_problem(name, entry, available)
            if problem is not None:
                problems.append(problem)
    if len(problems) > _MAX_NAMED:
        problems[_MAX_NAMED:] = [f"... and {len(problems) - _MAX_NAMED} more"]
    return problems


def tensor_names(path: str) -> frozenset[str] | None:
    """The tensors the safetensors file at ``path`` holds; None if it cannot be read."""
    try:
        header, _ = _header(path)
    except (OSError, SafetensorsError):
        return None
    return frozenset(name for name in header if name != _META)


def _weight_map(path: str) -> dict[str, str]:
    """The index's ``weight_map`` (tensor name -> file name).

    Raises:
        OSError: the index cannot be read.
        SafetensorsError: it is too large, not JSON, or has no weight map of strings.
    """
    fd, size = _open_regular(path)
    try:
        if size > MAX_INDEX:
            raise SafetensorsError(f"{size} bytes: larger than {MAX_INDEX}")
        raw = _read_exact(fd, 0, size)
    finally:
        os.close(fd)
    index = _decode(raw, "")
    weights = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weights, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weights.items()
    ):
        raise SafetensorsError("no weight_map mapping tensor names to file names")
    return weights


def check_index(path: str) -> list[str]:
    """Return the problems (empty list = OK) of the safetensors index at ``path``.

    Every file the ``weight_map`` names must be a plain name or relative path inside
    the index's directory, exist as a regular file, and hold the tensors mapped to it.
    A named file whose own header is broken is left to its own check.

    Returns:
        Human-readable problems, without the index's name (the caller prefixes it).
    """
    try:
        weights = _weight_map(path)
    except FileNotFoundError:
        return ["missing"]
    except OSError as exc:
        return [f"unreadable ({exc.strerror or exc})"]
    except SafetensorsError as exc:
        return [str(exc)]
    base = os.path.dirname(path)
    real_base = os.path.realpath(base)
    by_file: dict[str, list[str]] = {}
    for tensor, name in weights.items():
        by_file.setdefault(name, []).append(tensor)
    problems = []
    for name, tensors in sorted(by_file.items()):
        shown = _show(name)
        if not name or "\0" in name or os.path.isabs(name) or ".." in name.split("/"):
            problems.append(f"weight_map names {shown}, which is not a path inside its directory")
            continue
        full = os.path.join(base, name)
        if os.path.commonpath([real_base, os.path.realpath(full)]) != real_base:
            problems.append(f"weight_map names {shown}, which resolves outside its directory")
            continue
        try:
            st = os.lstat(full)
        except OSError:
            problems.append(f"weight_map names {shown} ({len(tensors)} tensors), which is missing")
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"weight_map names {shown}, which is not a regular file")
            continue
        held = tensor_names(full)
        if held is None:
            continue  # not readable as safetensors: its own check names the problem
        lacking = sorted(t for t in tensors if t not in held)
        if lacking:
            problems.append(
                f"weight_map puts {len(lacking)} tensors in {shown} that its header lacks "
                f"(first: {_show(lacking[0])})"
            )
    if len(problems) > _MAX_NAMED:
        problems[_MAX_NAMED:] = [f"... and {len(problems) - _MAX_NAMED} more"]
    return problems


def _decode(raw: bytes, subject: str) -> object:
    """``raw`` decoded as JSON, without executing anything.

    Raises:
        SafetensorsError: it is not JSON (the message begins ``{subject}not JSON``).
    """
    try:
        value: object = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise SafetensorsError(f"{subject}not JSON ({str(exc)[:_MAX_SHOWN]})") from None
    return value

"""Finding a LoRA adapter on disk, and handing it to Automodel's PEFT load path."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "_resolve_lora_adapter_dir", "peft_load_dir"]

ADAPTER_WEIGHTS: Final = "adapter_model.safetensors"
"""The adapter tensors, as Automodel's PEFT save and HF PEFT write them."""

ADAPTER_CONFIG: Final = "adapter_config.json"
"""The HF PEFT adapter configuration written next to them."""


def _resolve_lora_adapter_dir(restore_from: str) -> str:
    """Resolve a ``lora_cfg.restore_from`` path to the adapter directory.

    Accepts a NeMo-RL checkpoint weights directory (``step_*/policy/weights``), its
    ``model`` subdirectory, or any directory directly holding ``adapter_model.safetensors``
    and ``adapter_config.json`` (the HF PEFT layout).

    Args:
        restore_from: The configured path.

    Returns:
        The directory holding both adapter files: ``restore_from`` itself or its
        ``model`` subdirectory.

    Raises:
        FileNotFoundError: neither place holds both files; the message says which files
            were looked for, where, and what was missing.
    """
    candidates = (restore_from, os.path.join(restore_from, "model"))
    found: list[str] = []
    for candidate in candidates:
        present = [n for n in (ADAPTER_WEIGHTS, ADAPTER_CONFIG) if _is_file(candidate, n)]
        if len(present) == 2:
            return candidate
        found += [os.path.join(candidate, n) for n in present]
    partial = f" (found only {', '.join(found)})" if found else ""
    raise FileNotFoundError(
        f"lora_cfg.restore_from={restore_from!r}: no LoRA adapter there. Looked for "
        f"{ADAPTER_WEIGHTS} and {ADAPTER_CONFIG} in {candidates[0]} and in "
        f"{candidates[1]}{partial}. Point restore_from at a PEFT adapter directory (both "
        "files), a checkpoint's step_*/policy/weights directory, or its model "
        "subdirectory."
    )


@contextmanager
def peft_load_dir(adapter_dir: str) -> Iterator[str]:
    """A path to ``adapter_dir`` that Automodel's loader treats as a model directory.

    ``Checkpointer.load_model`` takes the PEFT path only for a directory named ``model``
    (or one holding the adapter file: nemo_automodel 0.7.0 accepts either, older
    releases only the name). An adapter elsewhere is reached through a symlink named
    ``model`` in a temporary directory that is removed afterwards.

    Args:
        adapter_dir: A directory :func:`_resolve_lora_adapter_dir` returned.

    Yields:
        The path to pass as ``model_path``.
    """
    adapter_dir = os.path.abspath(adapter_dir)
    if os.path.basename(adapter_dir) == "model":
        yield adapter_dir
        return
    with tempfile.TemporaryDirectory(prefix="ckptd-lora-") as staging:
        link = os.path.join(staging, "model")
        os.symlink(adapter_dir, link)
        yield link


def _is_file(directory: str, name: str) -> bool:
    return os.path.isfile(os.path.join(directory, name))

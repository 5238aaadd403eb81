"""Where a NeMo-RL save lives for ckptd, and what each rank wrote into it.

NeMo-RL writes step N of a run into ``ROOT/tmp_step_N/`` (``policy/weights``,
``policy/optimizer``, ``policy/tokenizer``, ``training_info.json``, ``config.yaml``).
The daemon needs ``(root, step)`` and, from each rank, the files it wrote; this module
derives the first from the paths the caller passes and lists the second from what the
Checkpointer produced, so the daemon can check every reported file's size before it
promotes.
"""

from __future__ import annotations

import glob
import os
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from orchestrator import FileEntry

__all__ = [
    "StepLocation",
    "consolidation_future",
    "dcp_rank_files",
    "locate_step",
    "plain_files",
    "safetensors_rank_files",
]


@dataclass(frozen=True, slots=True)
class StepLocation:
    """One step's place on disk.

    Attributes:
        root: The checkpoint root (what the daemon is configured with), absolute.
        step: The step number.
        tmp_dir: ``root/<tmp_prefix><step>``: where the step is written.
    """

    root: str
    step: int
    tmp_dir: str

    def relative(self, path: str) -> str:
        """``path`` relative to :attr:`tmp_dir`.

        Raises:
            ValueError: ``path`` is not inside the step's tmp directory.
        """
        full = os.path.abspath(path)
        if not (full == self.tmp_dir or full.startswith(self.tmp_dir + os.sep)):
            raise ValueError(
                f"{path} is not inside {self.tmp_dir}: ckptd promotes that directory "
                "as a whole, so every part of step "
                f"{self.step} (weights, optimizer, tokenizer, extra files) must be in it"
            )
        return os.path.relpath(full, self.tmp_dir)


def locate_step(path: str, tmp_prefix: str = "tmp_step_") -> StepLocation | None:
    """The step a path belongs to: its nearest ancestor named ``<tmp_prefix><N>``.

    ``ROOT/tmp_step_7/policy/weights`` gives root ``ROOT``, step 7.

    Args:
        path: Any path inside the step (absolute or relative to the working directory).
        tmp_prefix: The root's ``tmp_prefix`` as configured in the daemon.

    Returns:
        The location, or None when no ancestor has that name (not a ckptd layout).
    """
    current = os.path.abspath(path)
    while True:
        name = os.path.basename(current)
        digits = name[len(tmp_prefix) :] if name.startswith(tmp_prefix) else ""
        if digits.isascii() and digits.isdigit():
            return StepLocation(os.path.dirname(current), int(digits), current)
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent


def dcp_rank_files(directory: str, rel: str, rank: int) -> list[FileEntry]:
    """The DCP files ``rank`` wrote in ``directory`` by a save that has completed.

    For synchronous saves, whose results the Checkpointer does not return: the shards
    ``__{rank}_*.distcp`` and, for the coordinator, ``.metadata``, with their sizes now.
    """
    names = [os.path.basename(p) for p in glob.glob(os.path.join(directory, f"__{rank}_*.distcp"))]
    if rank == 0:
        names.append(".metadata")
    return _entries(directory, rel, names)


def safetensors_rank_files(directory: str, rel: str, rank: int) -> list[FileEntry]:
    """The sharded safetensors files ``rank`` wrote in a completed model save.

    nemo_automodel's HF storage writer gives rank r (in the checkpoint group) the files
    ``shard-{r+1:05d}-model-*.safetensors``. There is no ``.metadata`` for the daemon to
    check in such a directory: these reported sizes are its only evidence.
    """
    pattern = os.path.join(directory, f"shard-{rank + 1:05d}-model-*.safetensors")
    return _entries(directory, rel, [os.path.basename(p) for p in glob.glob(pattern)])


def plain_files(directory: str, rel: str) -> list[FileEntry]:
    """Every regular file under ``directory`` (recursively), e.g. a saved tokenizer."""
    entries: list[FileEntry] = []
    for dirpath, _dirs, files in os.walk(directory):
        sub = os.path.relpath(dirpath, directory)
        entries += _entries(dirpath, os.path.normpath(os.path.join(rel, sub)), files)
    return sorted(entries, key=lambda e: e.path)


def consolidation_future(checkpointer: Any) -> Future[None] | None:
    """A future for the HF consolidation the last async model save scheduled, if any.

    With ``is_async``, safetensors and ``save_consolidated`` active for the save,
    nemo_automodel 0.7.0 merges the shards into ``model/consolidated/`` on a thread
    started by ``save_model`` (``Checkpointer._consolidation_thread``), after the
    upload. Those files belong to the step, so the step must not be promoted before the
    thread ends. The returned future resolves when it does, with the error the thread
    recorded, if any.

    The Checkpointer clears that error when ``async_wait`` joins the thread, so callers
    must wait for this future before calling ``async_wait`` again (the manager does).
    """
    thread = getattr(checkpointer, "_consolidation_thread", None)
    if not isinstance(thread, threading.Thread):
        return None
    future: Future[None] = Future()

    def watch() -> None:
        thread.join()
        error = getattr(checkpointer, "_consolidation_error", None)
        if isinstance(error, BaseException):
            future.set_exception(error)
        else:
            future.set_result(None)

    threading.Thread(target=watch, name="ckptd-consolidation-watch", daemon=True).start()
    return future


def _entries(directory: str, rel: str, names: Iterable[str]) -> list[FileEntry]:
    entries = []
    for name in names:
        try:
            size = os.stat(os.path.join(directory, name)).st_size
        except FileNotFoundError:
            continue
        entries.append(FileEntry(os.path.normpath(os.path.join(rel, name)), size))
    return entries

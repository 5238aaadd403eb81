"""A save into an ``s3://`` root: written to a local stand-in, uploaded by its own rank.

nemo_automodel 0.7.0's ``Checkpointer`` writes with local file I/O wherever it writes:
DCP's ``FileSystemWriter`` (or its safetensors writer) for the shards, ``open`` and
``save_pretrained`` for configs, adapters, tokenizers and scripts, ``os.makedirs`` for
its directories; of remote paths it knows only ``msc://``, and it takes no storage
writer from its caller. So on an object-store root each rank's manager hands it a local
directory that stands for the step's ``ROOT/tmp_step_N``: one per rank and per save,
under ``$CKPTD_STAGING_DIR`` (else the system's temporary directory). Every file in it
is this rank's own.

Once the step is sealed and everything the Checkpointer started for it has landed there
(the model and optimizer uploads of DCP's async process), a thread of this rank uploads
the directory, file by file, under the attempt's own prefix (the ``begin`` reply's
``s3://BUCKET/PREFIX/step_N/ATTEMPT``), hands the uploaded keys and sizes to the step's
``SaveHandle`` (they go with the rank's ``done``; any error is its ``fail``) and removes
the directory. The training thread never waits for an upload, the daemon never carries
a byte, and the daemon's commit rule is unchanged: it verifies what the ranks reported
by LIST and ``.metadata`` before its one create-only write.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from .._objstore import filesystem, is_object_url
from .._tracking import SaveHandle
from ..protocol import FileEntry
from ._steps import StepLocation, plain_files

__all__ = [
    "StagedStep",
    "prepare_staged",
    "refuse_on_store",
    "stage_save",
    "stage_step",
    "staging_base",
    "upload_tree",
]

logger = logging.getLogger("orchestrator.automodel")

_UPLOAD_BATCH = 8
"""Files a rank uploads at once (s3fs runs them concurrently on its event loop)."""


def staging_base() -> str:
    """Where ranks stage saves into (and fetch loads from) an object-store root.

    ``$CKPTD_STAGING_DIR`` if set, else ``ckptd-staging-<uid>`` in the system's
    temporary directory. It should be node-local and hold one save of the rank's part.
    """
    configured = os.environ.get("CKPTD_STAGING_DIR")
    if configured:
        return os.path.abspath(configured)
    return os.path.join(tempfile.gettempdir(), f"ckptd-staging-{os.getuid()}")


@dataclass(slots=True)
class StagedStep:
    """One rank's save of a step of an object-store root, staged in a local directory.

    Attributes:
        root: The ``s3://`` root, as the daemon is configured with it.
        step: The step number.
        url: ``ROOT/<tmp_prefix>N``: the step as the caller names its paths.
        local: The local directory that stands for :attr:`url` during the save.
        landing: Futures of what the Checkpointer is still writing into :attr:`local`.
    """

    root: str
    step: int
    url: str
    local: str
    landing: list[Future[Any]] = field(default_factory=list)

    @property
    def location(self) -> StepLocation:
        """The step for the tracker: the store's root, written into :attr:`local`."""
        return StepLocation(self.root, self.step, self.local)

    def local_path(self, url: str) -> str:
        """The local stand-in of a path of the step (``ROOT/tmp_step_N/policy/weights``).

        Raises:
            ValueError: ``url`` is not inside :attr:`url`.
        """
        if url == self.url:
            return self.local
        if not url.startswith(self.url + "/") or "/../" in f"{url}/":
            raise ValueError(
                f"{url} is not inside {self.url}: every part of step {self.step} "
                "(weights, optimizer, tokenizer) must be in it"
            )
        return os.path.join(self.local, *url[len(self.url) + 1 :].split("/"))

    def after(self, response: Any) -> Future[Any]:
        """Wait for ``response`` (a future or an ``AsyncSaveResponse``) before uploading."""
        landed: Future[Any] = getattr(response, "upload_completion", response)
        self.landing.append(landed)
        return landed

    def upload_when_landed(self, handle: SaveHandle) -> Future[None]:
        """Upload :attr:`local` under the attempt's prefix once it has all landed.

        Runs on a thread of its own. The returned future resolves once every file is an
        object and has been added to ``handle`` (path relative to the attempt, size);
        it fails with the first error (a write that failed, the store refusing a PUT).
        The local directory is removed either way.
        """
        done: Future[None] = Future()

        def run() -> None:
            error: BaseException | None = None
            try:
                wait(self.landing)
                for landed in self.landing:
                    landed.result()  # a failed write: nothing of this rank is uploaded
                began = time.monotonic()
                target = handle.path  # the attempt's prefix (waits for the begin's reply)
                entries = upload_tree(self.local, target)
                handle.add_files(entries)
                logger.info(
                    "ckptd: uploaded %d files (%d bytes) of step %s to %s in %.2f s",
                    len(entries),
                    sum(e.size for e in entries),
                    self.step,
                    target,
                    time.monotonic() - began,
                )
            except BaseException as exc:  # a thread boundary: the step must not hang
                error = exc
            # Removed before the outcome is known: a rank may exit once it is reported.
            self.discard()
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)

        name = f"ckptd-upload-step-{self.step}"
        threading.Thread(target=run, name=name, daemon=True).start()
        return done

    def discard(self) -> None:
        """Remove the local directory (its save is uploaded, failed or abandoned)."""
        shutil.rmtree(os.path.dirname(self.local), ignore_errors=True)


def stage_step(url: str, tmp_prefix: str, rank: int) -> StagedStep | None:
    """A fresh local stand-in for the step ``url`` is in (``s3://B/P/tmp_step_7/...``).

    The nearest component of ``url`` named ``<tmp_prefix><N>`` gives step N; the URL
    above it is the root. The directory is new for every save (a retried step never
    meets an earlier save's files) and is ``.../<tmp_prefix>N`` itself.

    Args:
        url: Any path of the step, in an ``s3://`` root.
        tmp_prefix: The root's ``tmp_prefix`` as configured in the daemon.
        rank: This rank (its staging directories are its own).

    Returns:
        The staged step, or None when no component has that name.

    Raises:
        ValueError: ``url`` is not on an object store.
    """
    if not is_object_url(url):
        raise ValueError(f"{url} is not an object-store URL")
    parts = url.rstrip("/").split("/")
    for index in range(len(parts) - 1, 2, -1):  # scheme, "", bucket: never a step
        name = parts[index]
        digits = name[len(tmp_prefix) :] if name.startswith(tmp_prefix) else ""
        if digits.isascii() and digits.isdigit():
            local = os.path.join(staging_base(), f"rank{rank}", uuid.uuid4().hex, name)
            os.makedirs(local)
            root = "/".join(parts[:index])
            return StagedStep(root, int(digits), f"{root}/{name}", local)
    return None


def upload_tree(local: str, url: str) -> list[FileEntry]:
    """Upload every file under ``local`` to the same relative keys under ``url``.

    Returns:
        The uploaded files, relative to ``url``, with their sizes.

    Raises:
        OSError: the store refused or failed an upload (s3fs raises ``OSError`` kinds).
    """
    entries = plain_files(local, ".")
    if entries:
        fs = filesystem(url)
        locals_ = [os.path.join(local, e.path) for e in entries]
        remotes = [f"{url}/{e.path}" for e in entries]
        fs.put(locals_, remotes, batch_size=_UPLOAD_BATCH)
    return entries


def stage_save(
    weights_path: str, optimizer_path: str | None, tokenizer_path: str | None, tmp_prefix: str
) -> tuple[StagedStep, str, str | None, str | None]:
    """Stage a save whose paths are in an ``s3://`` root: the step and the local paths.

    Returns:
        The staged step, then the weights, optimizer and tokenizer paths in its stand-in.

    Raises:
        ValueError: ``weights_path`` is in no ``<tmp_prefix>N`` directory, or another
            path is outside that step.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    staged = stage_step(weights_path, tmp_prefix, rank)
    if staged is None:
        raise ValueError(
            f"{weights_path} is not inside a {tmp_prefix}N directory of its root: on an "
            "object store every save is a step the daemon commits"
        )
    try:
        optimizer, tokenizer = (
            None if path is None else staged.local_path(path)
            for path in (optimizer_path, tokenizer_path)
        )
    except ValueError:
        staged.discard()
        raise
    return staged, staged.local_path(weights_path), optimizer, tokenizer


def prepare_staged(
    staged: StagedStep,
    checkpointer: Any,
    tracker: Any,
    is_final_checkpoint: bool | None,
    dirs: Iterable[str | None],
) -> None:
    """Check a staged save can go to the store, and make the directories DCP writes into.

    The Checkpointer creates a DCP directory on the group's rank 0 only (shared
    storage is its assumption); each rank's stand-in is its own, so each makes
    ``model`` under the weights path and ``optim`` under the optimizer path.

    Args:
        staged: The save's staged step.
        checkpointer: The manager's ``Checkpointer``.
        tracker: The manager's ``StepTracker`` (None: no daemon).
        is_final_checkpoint: As given to ``save_checkpoint``.
        dirs: The weights and optimizer paths in the stand-in (None: not saved).

    Raises:
        ValueError: see :func:`refuse_on_store` (the stand-in is removed first).
    """
    try:
        refuse_on_store(checkpointer, tracker, staged, is_final_checkpoint)
    except ValueError:
        staged.discard()
        raise
    for path, name in zip(dirs, ("model", "optim"), strict=False):
        if path is not None:
            os.makedirs(os.path.join(path, name), exist_ok=True)


def refuse_on_store(
    checkpointer: Any, tracker: Any, staged: StagedStep, is_final_checkpoint: bool | None
) -> None:
    """Refuse, before anything is written, a save an object-store root cannot take.

    Args:
        checkpointer: The manager's ``Checkpointer``.
        tracker: The manager's ``StepTracker`` (None: no daemon).
        staged: The save's staged step.
        is_final_checkpoint: As given to ``save_checkpoint``.

    Raises:
        ValueError: no daemon registers the save (only its ``begin`` names the
            attempt's prefix, and only its commit makes the save a checkpoint), or the
            save would consolidate HF safetensors (that reads every rank's shards from
            one filesystem; each rank's stand-in holds only its own).
    """
    if tracker is None:
        raise ValueError(
            f"{staged.root} is an object-store root: saves into it need the ckptd daemon "
            "(AutomodelCheckpointManager(use_daemon=True), or a daemon on every rank)"
        )
    from nemo_automodel.components.checkpoint._backports.filesystem import SerializationFormat
    from nemo_automodel.components.checkpoint.config import SaveConsolidatedMode

    config = checkpointer.config
    mode = config.save_consolidated
    consolidating = mode == SaveConsolidatedMode.EVERY or (
        mode == SaveConsolidatedMode.FINAL and bool(is_final_checkpoint)
    )
    if consolidating and config.model_save_format == SerializationFormat.SAFETENSORS:
        if not config.is_peft:
            raise ValueError(
                f"consolidated HF safetensors cannot be written into {staged.root}: "
                "consolidation reads every rank's shards from one filesystem; save with "
                "save_consolidated='false' (and consolidate offline from a local copy)"
            )

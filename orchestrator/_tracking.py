"""Turning a rank's save futures into one ``done`` (or ``fail``) for the daemon.

A rank may write a step through several futures (model, optimizer) and plain files
(tokenizer). :class:`SaveHandle` collects them; once it is sealed and every future has
resolved without error, it reports ``done`` with the files the rank wrote. Any error,
including DCP's ``CheckpointException`` (a ``BaseException``), reports ``fail``.
Callbacks run on the writer's thread; nothing here runs on the training thread after
the save call returns. An error while reporting (e.g. reading the shard files from a
result whose metadata is broken) reports ``fail`` too: ``concurrent.futures`` would
otherwise swallow it, and the step would be neither done nor failed.

A handle needs little of the client that began it: the :class:`SaveLink` protocol
(which ``PendingBegin`` implements), so this module does not depend on the client.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import Any, Protocol

from ._forms import files_from_metadata, files_written
from ._pending import Begun
from .protocol import ErrorInfo, FileEntry

__all__ = ["SaveHandle", "SaveLink", "describe", "files_from_metadata"]


def describe(exc: BaseException, limit: int = 2000) -> str:
    """A one-line reason for ``exc`` that never raises (its ``__str__`` may)."""
    try:
        text = str(exc)
    except Exception:  # a broken __str__ must not lose the failure itself
        text = "<unprintable>"
    text = " | ".join(line.strip() for line in text.splitlines() if line.strip())
    return f"{type(exc).__name__}: {text}"[:limit]


class SaveLink(Protocol):
    """What a :class:`SaveHandle` needs from the client that began its save."""

    @property
    def path(self) -> str:
        """Directory the step is written into."""
        ...

    def result(self) -> Begun:
        """The daemon's answer to the save's ``begin`` (bounded wait, never raises)."""
        ...

    @property
    def local_world_size(self) -> int | None:
        """The step's ranks on this node, as the save's ``begin`` said (None: all)."""
        ...

    def when_refused(self, callback: Callable[[], None]) -> None:
        """Have ``callback`` called if the daemon refuses the save's ``begin``."""
        ...

    def report_done(
        self, files: Iterable[FileEntry], metrics: Mapping[str, float] | None = None
    ) -> None:
        """Send the save's ``done`` with the files this rank wrote. Never blocks."""
        ...

    def report_fail(self, reason: str) -> None:
        """Send the save's ``fail``. Never blocks."""
        ...


class SaveHandle:
    """One rank's save of one step, reported to the daemon when every part has landed.

    Create it with :meth:`CheckpointClient.save`. Add each future the rank's save
    produced, then :meth:`seal` it: no ``done`` is sent before the seal, so a step saved
    through several calls cannot be promoted after only the first. A save whose
    ``begin`` the daemon refused reports nothing (:attr:`refusal` says why), and counts
    as settled as soon as the refusal arrives: the daemon never admitted this rank, so a
    ``fail`` would land on whichever save holds the step.

    Args:
        root: The checkpoint root.
        step: The step.
        rank: This rank.
        link: How the handle reaches the daemon (the save's ``PendingBegin``).
        on_settled: Called once the handle has reported ``done`` or ``fail``.
    """

    def __init__(
        self,
        root: str,
        step: int,
        rank: int,
        link: SaveLink,
        on_settled: Callable[[SaveHandle], None] | None = None,
    ) -> None:
        self.root = root
        self.step = step
        self.rank = rank
        self._link = link
        self._on_settled = on_settled
        self._lock = threading.Lock()
        self._outstanding = 0
        self._sealed = False
        self._finished = False
        self._files: list[FileEntry] = []
        self._metrics: dict[str, float] = {}
        self._settled = threading.Event()
        link.when_refused(self._refused)

    @property
    def path(self) -> str:
        """Directory this step is written into (``ROOT/tmp_step_N``).

        Exists once :meth:`CheckpointClient.save` or ``orchestrator.async_save``
        returned, whether or not the daemon is reachable.
        """
        return self._link.path

    @property
    def begun(self) -> Begun:
        """The daemon's answer to this save's ``begin``.

        Waits for it at most the client's ``begin_timeout`` (the first time only).
        """
        return self._link.result()

    @property
    def attempt(self) -> str | None:
        """The attempt this save joined (waits as :attr:`begun` does).

        None until the daemon acknowledged the ``begin``, and from a daemon that
        predates attempts.
        """
        return self.begun.attempt

    @property
    def refusal(self) -> ErrorInfo | None:
        """Why the daemon refused this save's ``begin`` (waits as :attr:`begun` does).

        None unless it refused: acknowledged, or not answered in time (the save then
        goes on unpromoted unless the daemon acknowledges it later).
        """
        return self.begun.error

    @property
    def local_world_size(self) -> int | None:
        """How many of the step's ranks write on this node, as this save's ``begin`` said.

        None when nothing said it: the daemon takes ``world_size``, one node.
        """
        return self._link.local_world_size

    @property
    def sealed(self) -> bool:
        """Whether :meth:`seal` was called: no more parts come."""
        return self._sealed

    def add(
        self, future: Any, *, dcp_dir: str | None = None, group_rank: int | None = None
    ) -> None:
        """Track one save future.

        Args:
            future: A ``concurrent.futures.Future`` or an ``AsyncSaveResponse`` (its
                ``upload_completion`` is tracked); or what a finished save returned
                (the ``Metadata`` of a synchronous ``dcp.save``), taken as done.
            dcp_dir: The DCP directory relative to :attr:`path`; when given, the files
                this rank wrote there are reported, whatever the save's form: from the
                save's resulting metadata (``__R_*.distcp``, and ``.metadata`` or
                ``__R.metadata``), or for safetensors (``HuggingFaceStorageWriter``)
                from the directory, by the writer's file names.
            group_rank: This rank in the checkpoint process group (default: ``rank``).

        Raises:
            RuntimeError: the handle is already sealed.
        """
        tracked: Any = getattr(future, "upload_completion", future)
        upload: Future[Any]
        if isinstance(tracked, Future):
            upload = tracked
        else:  # a finished save's result
            upload = Future()
            upload.set_result(tracked)
        with self._lock:
            if self._sealed:
                raise RuntimeError("SaveHandle.add after seal(): the step may already be done")
            self._outstanding += 1
        rank = self.rank if group_rank is None else group_rank

        def on_done(fut: Future[Any]) -> None:
            try:
                if fut.cancelled():
                    self._resolve(None, "the save future was cancelled")
                    return
                exc = fut.exception()
                if exc is not None:
                    self._resolve(None, describe(exc))
                    return
                found = [] if dcp_dir is None else self._written(fut.result(), dcp_dir, rank)
            except BaseException as exc:  # a callback boundary: never leave the step hanging
                self._resolve(None, f"reporting the save's files raised {describe(exc)}")
                if not isinstance(exc, Exception):
                    raise
                return
            self._resolve(found, None)

        upload.add_done_callback(on_done)

    def _written(self, result: Any, dcp_dir: str, rank: int) -> list[FileEntry]:
        directory = os.path.normpath(os.path.join(self.path, dcp_dir))
        return files_written(result, directory, dcp_dir, rank)

    def add_files(self, files: Iterable[FileEntry]) -> None:
        """Record files this rank already wrote synchronously (e.g. a tokenizer)."""
        with self._lock:
            self._files.extend(files)

    def add_metrics(self, metrics: Mapping[str, float]) -> None:
        """Record metrics of this checkpoint, sent with its ``done`` (e.g. ``val_loss``).

        The daemon keeps them with the step once it is promoted; a root's retention
        policy (``keep_best``) and its ``best`` pointer judge by them. Later values of a
        name replace earlier ones.

        Raises:
            ValueError: a value is not a finite number.
            RuntimeError: the handle already reported.
        """
        values: dict[str, float] = {}
        for name, value in metrics.items():
            number = float(value)
            if not math.isfinite(number):
                raise ValueError(f"metric {name!r} is not finite: {value!r}")
            values[str(name)] = number
        with self._lock:
            if self._finished:
                raise RuntimeError("SaveHandle.add_metrics after the save was reported")
            self._metrics.update(values)

    def seal(self) -> None:
        """No more parts: report ``done`` once every tracked future has succeeded."""
        with self._lock:
            self._sealed = True
            ready = self._outstanding == 0 and not self._finished
            if ready:
                self._finished = True
        if ready:
            self._send_done()

    def fail(self, reason: str) -> None:
        """Report the save failed (e.g. the save call itself raised).

        Does nothing if the handle already reported. Parts added later are ignored.
        """
        with self._lock:
            if self._finished:
                return
            self._finished = True
        self._link.report_fail(reason)
        self._settle()

    def wait_local(self, timeout: float | None = None) -> bool:
        """Block until this rank's parts have resolved and been reported (tests, shutdown).

        Returns:
            Whether the handle reported ``done`` or ``fail`` within ``timeout`` seconds.
        """
        return self._settled.wait(timeout)

    def _refused(self) -> None:
        # Nothing of this save will ever be reported: it is settled as it stands.
        with self._lock:
            if self._finished:
                return
            self._finished = True
        self._settle()

    def _resolve(self, files: list[FileEntry] | None, error: str | None) -> None:
        if error is not None:
            self.fail(error)
            return
        with self._lock:
            self._files.extend(files or ())
            self._outstanding -= 1
            ready = self._sealed and self._outstanding == 0 and not self._finished
            if ready:
                self._finished = True
        if ready:
            self._send_done()

    def _send_done(self) -> None:
        self._link.report_done(self._files, self._metrics or None)
        self._settle()

    def _settle(self) -> None:
        self._settled.set()
        if self._on_settled is not None:
            self._on_settled(self)

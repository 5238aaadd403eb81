"""A ``begin`` on its way: where the step goes, and the daemon's answer once it comes.

:class:`PendingBegin` is what :meth:`CheckpointClient.begin_nowait` returns and what a
:class:`~orchestrator.SaveHandle` holds. Its :attr:`~PendingBegin.path` is known at once
whenever the client can name the step's directory without the daemon (see
``_layout.py``); :meth:`~PendingBegin.result` waits for the answer, at most the client's
``begin_timeout``, and never raises. It is also the way the save's ``done`` or ``fail``
goes out, tied to its ``begin`` so that the I/O thread can name the attempt the begin
joined, and send nothing for a save the daemon refused.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from . import protocol as p
from ._channel import Channel
from ._errors import DaemonError
from ._wire import SaveRecord

__all__ = ["Begun", "PendingBegin"]

log = logging.getLogger("orchestrator")


@dataclass(frozen=True, slots=True)
class Begun:
    """Outcome of :meth:`CheckpointClient.begin`.

    Attributes:
        path: Directory to write the step into.
        acknowledged: The daemon confirmed the save; it will promote it when complete.
        error: Why the daemon refused, if it did: nothing of the save may be written
            (the save will not be promoted). None when it acknowledged, and when it did
            not answer in time or could not be reached (the save goes on unpromoted
            unless the daemon acknowledges it later).
        attempt: The attempt the save joined, as the daemon named it; None before it
            acknowledged, and from a daemon that predates attempts.
    """

    path: str
    acknowledged: bool
    error: p.ErrorInfo | None = None
    attempt: str | None = None


class PendingBegin:
    """A ``begin`` sent to the daemon whose acknowledgement may still be on its way.

    :attr:`path` is known at once when the client can name the step's directory without
    the daemon (a layout learned from an earlier acknowledged ``begin`` of the root, or
    the root's layout file); :meth:`result` waits for the acknowledgement.

    Args:
        channel: The client's connection.
        record: The save, as the connection knows it.
        future: Resolves with the daemon's reply to the ``begin``.
        path: The step's directory if the client could name it without the daemon.
        fallback: The directory to use if neither the client nor the daemon names one.
        timeout: The client's ``begin_timeout``, in seconds.
    """

    def __init__(
        self,
        channel: Channel,
        record: SaveRecord,
        future: concurrent.futures.Future[dict[str, Any]],
        path: str | None,
        fallback: str,
        timeout: float,
    ) -> None:
        self._channel = channel
        self._record = record
        self._future = future
        self._path = path
        self._fallback = fallback
        self._timeout = timeout
        self._lock = threading.Lock()
        self._begun: Begun | None = None
        self._answered = False

    @property
    def path(self) -> str:
        """Directory to write the step into (waits for the acknowledgement if unknown)."""
        return self._path if self._path is not None else self.result().path

    @property
    def local_world_size(self) -> int | None:
        """The step's ranks on this node, as this ``begin`` (and every re-send) says."""
        return self._record.local_world_size

    def result(self) -> Begun:
        """The daemon's answer, waiting for it at most the client's ``begin_timeout``.

        Waits once: later calls return at once, with the answer if it has come since.
        Never raises: an unreachable daemon, a timeout or a refusal give a
        :class:`Begun` that is not acknowledged (the refusal is logged when it arrives).
        """
        with self._lock:  # the training and the upload thread may both ask
            if self._begun is None:
                self._begun, self._answered = self._wait()
            elif not self._answered and self._future.done():
                self._begun, self._answered = self._settled(), True
            return self._begun

    def known(self) -> Begun | None:
        """The answer as :meth:`result` last gave it, without waiting; None before."""
        with self._lock:
            return self._begun

    def when_refused(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the client's thread) if the daemon refuses the begin."""

        def check(future: concurrent.futures.Future[dict[str, Any]]) -> None:
            if future.exception() is None and not future.result().get("ok"):
                callback()

        self._future.add_done_callback(check)

    def report_done(
        self, files: Iterable[p.FileEntry], metrics: Mapping[str, float] | None = None
    ) -> None:
        """Send this save's ``done`` (after its ``begin`` is answered). Never blocks."""
        record = self._record
        done = p.Done(
            id=0,
            root=record.root,
            step=record.step,
            rank=record.rank,
            files=list(files),
            metrics=dict(metrics) if metrics else None,
        )
        self._channel.post(done, None, record)

    def report_fail(self, reason: str) -> None:
        """Send this save's ``fail`` (after its ``begin`` is answered). Never blocks."""
        record = self._record
        fail = p.Fail(
            id=0, root=record.root, step=record.step, rank=record.rank, reason=reason[:4000]
        )
        self._channel.post(fail, None, record)

    def _wait(self) -> tuple[Begun, bool]:
        channel = self._channel
        if not self._future.done():
            channel.attempted.wait(self._timeout)
            if not channel.connected.is_set():
                return Begun(self._path or self._fallback, False), False
        try:
            self._future.result(timeout=self._timeout)
        except concurrent.futures.TimeoutError:
            log.warning(
                "ckptd: begin for step %s not acknowledged within %ss",
                self._record.step,
                self._timeout,
            )
            return Begun(self._path or self._fallback, False), False
        except DaemonError:
            pass
        return self._settled(), True

    def _settled(self) -> Begun:
        fallback = self._path or self._fallback
        try:
            reply = self._future.result(timeout=0)
        except DaemonError:  # closed, dropped, or a reply it could not read
            return Begun(fallback, False)
        if not reply.get("ok"):
            return Begun(fallback, False, msgspec.convert(reply["error"], p.ErrorInfo))
        attempt = str(reply.get("attempt") or "") or None
        path = str(reply["path"])
        if self._path is not None and path != self._path:
            log.warning(
                "ckptd: step %s was written into %s but the daemon expects %s; "
                "it will not be promoted",
                self._record.step,
                self._path,
                path,
            )
            return Begun(self._path, False, attempt=attempt)
        return Begun(path, True, attempt=attempt)

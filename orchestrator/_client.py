"""The trainer-side connection to the node's ckptd daemon.

A background thread runs a small asyncio loop that owns the socket, reconnects with
backoff and re-sends what the daemon has not acknowledged. Calls from the training
thread only append a message to a queue: a relay thread wakes the loop, so the caller
never waits for another thread's turn (a wake-up through the loop's self-pipe releases
the GIL to the woken thread, which costs the caller tens of microseconds). ``done``,
``fail`` and :meth:`CheckpointClient.track` cost microseconds; an awaited ``begin``
waits for the daemon at most ``begin_timeout`` seconds (not at all while the daemon is
known to be down), and :class:`PendingBegin` lets another thread (DCP's upload) do that
waiting instead of the training thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from . import protocol as p
from ._tracking import SaveHandle
from .protocol import default_socket_path

__all__ = ["Begun", "CheckpointClient", "DaemonError", "PendingBegin", "default_socket_path"]

log = logging.getLogger("orchestrator")

_MAX_UNACKED: Final = 100_000
_RETRY_UNAVAILABLE: Final = 0.5
_BACKOFF_START: Final = 0.05


class DaemonError(RuntimeError):
    """Raised by the blocking query calls when the daemon refuses or cannot be reached.

    Attributes:
        code: The daemon's error code, or ``"unreachable"``/``"timeout"``.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass(frozen=True, slots=True)
class Begun:
    """Outcome of :meth:`CheckpointClient.begin`.

    Attributes:
        path: Directory to write the step into.
        acknowledged: The daemon confirmed the save; it will promote it when complete.
        error: Why the daemon refused, if it did (the save will not be promoted).
    """

    path: str
    acknowledged: bool
    error: p.ErrorInfo | None = None


@dataclass(slots=True)
class _Outgoing:
    message: p.Request
    future: concurrent.futures.Future[dict[str, Any]] | None = None
    line: bytes = b""


@dataclass(frozen=True, slots=True)
class _Barrier:
    """Resolves ``future`` once everything queued before it is acknowledged."""

    future: concurrent.futures.Future[None]


class PendingBegin:
    """A ``begin`` sent to the daemon whose acknowledgement may still be on its way.

    :attr:`path` is known at once when the client has learned the root's layout from an
    earlier acknowledged ``begin``; :meth:`result` waits for the acknowledgement.
    """

    def __init__(
        self,
        client: CheckpointClient,
        step: int,
        future: concurrent.futures.Future[dict[str, Any]],
        path: str | None,
        fallback: str,
    ) -> None:
        self._client = client
        self._step = step
        self._future = future
        self._path = path
        self._fallback = fallback
        self._lock = threading.Lock()
        self._begun: Begun | None = None

    @property
    def path(self) -> str:
        """Directory to write the step into (waits for the acknowledgement if unknown)."""
        return self._path if self._path is not None else self.result().path

    def result(self) -> Begun:
        """The daemon's answer, waiting for it at most the client's ``begin_timeout``.

        Never raises: an unreachable daemon, a timeout or a refusal give a
        :class:`Begun` that is not acknowledged (the refusal is logged when it arrives).
        """
        with self._lock:  # the training and the upload thread may both ask
            if self._begun is None:
                self._begun = self._wait()
            return self._begun

    def _wait(self) -> Begun:
        client = self._client
        fallback = self._path or self._fallback
        if not self._future.done():
            client._attempted.wait(client.begin_timeout)
            if not client.connected:
                return Begun(path=fallback, acknowledged=False)
        try:
            reply = self._future.result(timeout=client.begin_timeout)
        except concurrent.futures.TimeoutError:
            log.warning(
                "ckptd: begin for step %s not acknowledged within %ss",
                self._step,
                client.begin_timeout,
            )
            return Begun(path=fallback, acknowledged=False)
        except DaemonError:
            return Begun(path=fallback, acknowledged=False)
        if not reply.get("ok"):
            return Begun(fallback, False, msgspec.convert(reply["error"], p.ErrorInfo))
        path = str(reply["path"])
        if self._path is not None and path != self._path:
            log.warning(
                "ckptd: step %s was written into %s but the daemon expects %s; "
                "it will not be promoted",
                self._step,
                self._path,
                path,
            )
            return Begun(path=self._path, acknowledged=False)
        return Begun(path=path, acknowledged=True)


class CheckpointClient:
    """Connection from one training process to its node's daemon.

    Thread-safe. Create one per process and share it. Nothing here blocks the caller for
    longer than ``begin_timeout``; if the daemon is down, calls return at once, the client
    logs one warning, keeps trying to reconnect in the background, and re-sends every
    save it was told about once the daemon is back.

    Args:
        socket_path: The daemon's socket; default :func:`default_socket_path`.
        begin_timeout: Longest wait for a ``begin`` acknowledgement, in seconds.
        reconnect_max: Longest pause between reconnection attempts, in seconds.
    """

    def __init__(
        self,
        socket_path: str | None = None,
        *,
        begin_timeout: float = 2.0,
        reconnect_max: float = 2.0,
    ) -> None:
        self.socket_path = socket_path or default_socket_path()
        self.begin_timeout = begin_timeout
        self._reconnect_max = reconnect_max
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # guards _handles (touched from callers' threads)
        self._handles: set[SaveHandle] = set()
        # Touched only on the I/O thread: unacknowledged messages, open saves to re-send
        # after a reconnect, and each root's layout (read elsewhere with a plain, atomic
        # dict lookup).
        self._unacked: dict[int, _Outgoing] = {}
        self._saves: dict[tuple[str, int, int], int] = {}
        self._layouts: dict[str, tuple[str, str]] = {}  # root -> (directory, tmp prefix)
        self._outbox: queue.SimpleQueue[_Outgoing | _Barrier | None] = queue.SimpleQueue()
        self._writer: asyncio.StreamWriter | None = None
        self._connected = threading.Event()
        self._attempted = threading.Event()
        self._warned = False
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._acked = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="ckptd-client", daemon=True)
        self._thread.start()
        self._relay_thread = threading.Thread(
            target=self._relay, name="ckptd-client-relay", daemon=True
        )
        self._relay_thread.start()

    # -- training-thread API -----------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether the client currently holds a connection to the daemon."""
        return self._connected.is_set()

    def begin(self, root: str, step: int, rank: int, world_size: int) -> Begun:
        """Tell the daemon this rank is about to write ``step`` under ``root``, and wait.

        Waits for the acknowledgement up to ``begin_timeout`` (not at all while the
        daemon is unreachable). Whatever happens, the begin is remembered and re-sent
        after a reconnect.

        Returns:
            Where to write, and whether the daemon acknowledged.
        """
        return self.begin_nowait(root, step, rank, world_size).result()

    def begin_nowait(self, root: str, step: int, rank: int, world_size: int) -> PendingBegin:
        """Send ``begin`` and return at once; :meth:`PendingBegin.result` waits for it.

        The connection is one ordered stream, so the daemon sees this ``begin`` before
        any later ``done`` of the same step whether or not anyone waits for it.
        """
        future = self._submit(p.Begin(id=0, root=root, step=step, rank=rank, world_size=world_size))
        path = self.step_path(root, step)
        return PendingBegin(self, step, future, path, os.path.join(root, f"tmp_step_{step}"))

    def step_path(self, root: str, step: int) -> str | None:
        """Where the daemon has ``step`` of ``root`` written, if this client knows yet.

        Learned from the first acknowledged ``begin`` of the root; None before.
        """
        layout = self._layouts.get(root)
        return None if layout is None else os.path.join(layout[0], f"{layout[1]}{step}")

    def done(self, root: str, step: int, rank: int, files: Iterable[p.FileEntry] = ()) -> None:
        """Report that this rank's writes for ``step`` have all landed. Never blocks."""
        self._post(p.Done(id=0, root=root, step=step, rank=rank, files=list(files)), None)

    def fail(self, root: str, step: int, rank: int, reason: str) -> None:
        """Report that this rank's save of ``step`` failed. Never blocks."""
        self._post(p.Fail(id=0, root=root, step=step, rank=rank, reason=reason[:4000]), None)

    def save(
        self, root: str, step: int, rank: int, world_size: int, *, wait: bool = True
    ) -> SaveHandle:
        """Begin a save and return the handle its futures are added to.

        Call this before the save starts writing; add each future with
        :meth:`SaveHandle.add`, then :meth:`SaveHandle.seal`.

        Args:
            root: The checkpoint root.
            step: The step.
            rank: This rank.
            world_size: Number of ranks writing the step.
            wait: Wait for the daemon's acknowledgement before returning. With False,
                the caller overlaps the wait with its own work and reads
                :attr:`SaveHandle.begun` before its save call returns.
        """
        handle = SaveHandle(self, root, step, rank, self.begin_nowait(root, step, rank, world_size))
        with self._lock:
            self._handles.add(handle)
        if wait:
            _ = handle.begun  # waits for the acknowledgement
        return handle

    def wait_saves(self, timeout: float | None = None) -> bool:
        """Block until every save started through this client has reported done or fail.

        What a trainer calls before it exits (``close`` does it too): a process that
        exits with uploads in flight loses them, and the daemon fails the step once the
        rank's lease runs out.

        Args:
            timeout: Longest wait in seconds; None waits as long as the uploads take.

        Returns:
            Whether every save was reported in time.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            pending = list(self._handles)
        for handle in pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not handle.wait_local(left):
                return False
        return True

    def _forget(self, handle: SaveHandle) -> None:
        with self._lock:
            self._handles.discard(handle)

    def track(
        self,
        root: str,
        step: int,
        rank: int,
        world_size: int,
        futures: Any,
        *,
        dcp_dir: str | None = None,
        group_rank: int | None = None,
    ) -> SaveHandle:
        """Begin (if not yet begun) and track every future of one rank's save of a step.

        Args:
            root: The checkpoint root.
            step: The step.
            rank: This rank.
            world_size: Number of ranks writing the step.
            futures: A future, an ``AsyncSaveResponse``, or a list of them; ``done`` is
                sent once all of them succeeded, ``fail`` as soon as one fails.
            dcp_dir: DCP directory of the futures, relative to the tmp dir, to report
                the shard files from the save's metadata.
            group_rank: This rank in the checkpoint process group (default ``rank``).

        The ``begin`` is sent, not awaited: the save call ``futures`` came from has
        already returned, so there is nothing left for an acknowledgement to gate, and
        the daemon reads this connection in order. A refusal is logged when it arrives.

        Returns:
            The sealed handle.
        """
        handle = self.save(root, step, rank, world_size, wait=False)
        for future in futures if isinstance(futures, list | tuple) else [futures]:
            handle.add(future, dcp_dir=dcp_dir, group_rank=group_rank)
        handle.seal()
        return handle

    # -- blocking queries (tools and tests; not for the training loop) -------------------

    def call(self, request: p.Request, timeout: float = 10.0) -> dict[str, Any]:
        """Send one request and wait for its reply.

        Returns:
            The reply object.

        Raises:
            DaemonError: the daemon refused, or did not answer within ``timeout``.
        """
        future = self._submit(request)
        try:
            reply = future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            code = "timeout" if self.connected else "unreachable"
            raise DaemonError(code, f"no reply from {self.socket_path} within {timeout}s") from None
        if not reply.get("ok"):
            error = reply.get("error") or {}
            raise DaemonError(str(error.get("code")), str(error.get("message")))
        return reply

    def wait(self, root: str, step: int, timeout: float) -> p.WaitReply:
        """Block until ``step`` is promoted or failed, or ``timeout`` passes.

        Raises:
            DaemonError: the daemon refused, or could not be reached.
        """
        reply = self.call(p.Wait(id=0, root=root, step=step, timeout=timeout), timeout + 10.0)
        return msgspec.convert(reply, p.WaitReply)

    def ping(self, timeout: float = 2.0) -> bool:
        """Whether the daemon answers within ``timeout`` seconds."""
        try:
            self.call(p.Ping(id=0), timeout)
        except DaemonError:
            return False
        return True

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until the daemon acknowledged every ``begin``/``done``/``fail`` sent so far.

        For shutdown paths and tests; the training loop never needs it.

        Returns:
            Whether everything was acknowledged within ``timeout`` seconds.
        """
        if self._closed or not self._thread.is_alive():
            return not self._unacked
        barrier: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._outbox.put(_Barrier(barrier))  # behind everything queued so far
        try:
            barrier.result(timeout)
        except concurrent.futures.TimeoutError:
            barrier.cancel()
            return False
        return True

    def close(self, timeout: float | None = None) -> None:
        """Finish reporting, then close the connection and stop the background threads.

        Waits for every unsettled save (see :meth:`wait_saves`), then, while the daemon
        is reachable, for its acknowledgements (at most 5 s).

        Args:
            timeout: Longest wait for in-flight uploads, in seconds; None: no limit.
        """
        if self._closed:
            return
        if not self.wait_saves(timeout):
            log.warning("ckptd: closing with uploads still in flight after %ss", timeout)
        if self._connected.is_set():
            self.flush(5.0)
        self._closed = True
        self._outbox.put(None)
        self._relay_thread.join(timeout=5.0)
        self._loop.call_soon_threadsafe(self._shutdown)
        self._thread.join(timeout=5.0)

    def __enter__(self) -> CheckpointClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -------------------------------------------------------------------------

    def _submit(self, request: p.Request) -> concurrent.futures.Future[dict[str, Any]]:
        future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        self._post(request, future)
        return future

    def _post(
        self, request: p.Request, future: concurrent.futures.Future[dict[str, Any]] | None
    ) -> None:
        # Runs on the caller's thread: no encoding and nothing that releases the GIL. The
        # put wakes the relay thread (if it sleeps), which hands the message to the loop.
        if self._closed:
            if future is not None:
                future.set_exception(DaemonError("closed", "the client is closed"))
            else:
                log.warning("ckptd: %s after close() is not sent", type(request).__name__)
            return
        self._outbox.put(_Outgoing(request, future))

    def _relay(self) -> None:
        # One wake-up of the loop per burst of messages, paid by this thread.
        while True:
            item = self._outbox.get()
            batch: list[_Outgoing | _Barrier] = []
            while item is not None:
                batch.append(item)
                try:
                    item = self._outbox.get_nowait()
                except queue.Empty:
                    break
            if batch:
                try:
                    self._loop.call_soon_threadsafe(self._send_batch, batch)
                except RuntimeError:  # the loop is gone: nothing more can be sent
                    return
            if item is None:
                return

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._main = self._loop.create_task(self._connect_forever())
        try:
            self._loop.run_until_complete(self._main)
        except asyncio.CancelledError:
            pass
        finally:
            self._loop.close()

    def _shutdown(self) -> None:
        self._main.cancel()

    async def _drained(self, barrier: concurrent.futures.Future[None]) -> None:
        while any(isinstance(o.message, p.Begin | p.Done | p.Fail) for o in self._unacked.values()):
            self._acked = asyncio.Event()
            await self._acked.wait()
        if not barrier.done():
            barrier.set_result(None)

    def _send_batch(self, batch: list[_Outgoing | _Barrier]) -> None:
        lines: list[bytes] = []
        for item in batch:
            if isinstance(item, _Barrier):
                self._loop.create_task(self._drained(item.future))
                continue
            message = item.message = msgspec.structs.replace(item.message, id=next(self._ids))
            if isinstance(message, p.Begin):
                # An open save from now on: re-sent after a reconnect. (Recorded here, not
                # by the caller, so a begin still on its way here is never sent twice.)
                self._saves.setdefault(
                    (message.root, message.step, message.rank), message.world_size
                )
            item.line = p.encode(message)
            self._unacked[item.message.id] = item
            lines.append(item.line)
        while len(self._unacked) > _MAX_UNACKED:
            dropped = self._unacked.pop(next(iter(self._unacked)))
            if dropped.future is not None and not dropped.future.done():
                dropped.future.set_exception(DaemonError("dropped", "too many unacknowledged"))
        if self._writer is not None and lines:
            self._writer.write(b"".join(lines))

    async def _connect_forever(self) -> None:
        backoff = _BACKOFF_START
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(
                    self.socket_path, limit=p.MAX_LINE
                )
            except OSError as exc:
                self._attempted.set()
                self._fail_queries()
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "ckptd daemon unreachable at %s (%s); training continues, checkpoints "
                        "will not be promoted until it is back",
                        self.socket_path,
                        exc.strerror or exc,
                    )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._reconnect_max)
                continue
            backoff = _BACKOFF_START
            if self._warned:
                log.warning("ckptd daemon reachable again at %s", self.socket_path)
                self._warned = False
            self._writer = writer
            self._resend(writer)
            self._connected.set()
            self._attempted.set()
            try:
                await self._read(reader)
            finally:
                self._connected.clear()
                self._writer = None
                writer.close()

    def _resend(self, writer: asyncio.StreamWriter) -> None:
        # Saves in flight first, so a restarted daemon learns of them before their done.
        open_saves = dict(self._saves)
        queued = {
            (m.root, m.step, m.rank)
            for o in self._unacked.values()
            if isinstance(m := o.message, p.Begin)
        }
        written: set[int] = set()
        for (root, step, rank), world_size in open_saves.items():
            if (root, step, rank) not in queued:
                msg = p.Begin(
                    id=next(self._ids),
                    root=root,
                    step=step,
                    rank=rank,
                    world_size=world_size,
                    resent=True,
                )
                again = _Outgoing(msg, None, p.encode(msg))
                self._unacked[msg.id] = again
                written.add(msg.id)
                writer.write(again.line)
        for rid in sorted(self._unacked.keys() - written):
            writer.write(self._unacked[rid].line)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                line = await reader.readline()
            except (OSError, ValueError):
                return
            if not line:
                return
            try:
                reply = msgspec.json.decode(line)
            except msgspec.DecodeError:
                continue
            if isinstance(reply, dict) and "id" in reply:
                self._on_reply(reply)

    def _on_reply(self, reply: dict[str, Any]) -> None:
        rid = reply.get("id")
        if not isinstance(rid, int) or (outgoing := self._unacked.get(rid)) is None:
            return
        message = outgoing.message
        error = reply.get("error") or {}
        if error.get("code") == p.ErrorCode.UNAVAILABLE and isinstance(
            message, p.Begin | p.Done | p.Fail
        ):
            # Not acknowledged (the daemon could not make it durable): send it again.
            self._loop.call_later(_RETRY_UNAVAILABLE, self._resend_one, rid)
            return
        del self._unacked[rid]
        self._acked.set()
        if isinstance(message, p.Begin | p.Done | p.Fail) and (
            not reply.get("ok") or not isinstance(message, p.Begin)
        ):
            # Settled, or refused: nothing left to re-send after a reconnect.
            self._saves.pop((message.root, message.step, message.rank), None)
        if isinstance(message, p.Begin) and reply.get("ok"):
            self._learn_layout(message, reply.get("path"))
        if not reply.get("ok") and isinstance(message, p.Begin | p.Done | p.Fail):
            log.warning(
                "ckptd refused %s for step %s of %s (%s): %s; it will not be promoted",
                type(message).__name__.lower(),
                message.step,
                message.root,
                error.get("code"),
                error.get("message"),
            )
        if outgoing.future is not None and not outgoing.future.done():
            outgoing.future.set_result(reply)

    def _learn_layout(self, begin: p.Begin, path: object) -> None:
        # Where this root's steps go, so later begins need not wait to know the path.
        if not isinstance(path, str):
            return
        directory, name = os.path.split(path)
        suffix = str(begin.step)
        layout = (directory, name[: -len(suffix)])
        if name.endswith(suffix):  # learned once; again if the daemon's layout changed
            self._layouts[begin.root] = layout

    def _resend_one(self, rid: int) -> None:
        outgoing = self._unacked.get(rid)
        if outgoing is not None and self._writer is not None:
            self._writer.write(outgoing.line)

    def _fail_queries(self) -> None:
        # Queries (status, wait, ping) are not re-sent: fail them now, keep saves.
        for rid, outgoing in list(self._unacked.items()):
            if not isinstance(outgoing.message, p.Begin | p.Done | p.Fail):
                del self._unacked[rid]
                if outgoing.future is not None and not outgoing.future.done():
                    outgoing.future.set_exception(
                        DaemonError("unreachable", f"ckptd unreachable at {self.socket_path}")
                    )

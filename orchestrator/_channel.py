"""The client's I/O thread: one connection to the daemon, kept up, losing nothing.

A background thread runs a small asyncio loop that owns the socket, reconnects with
backoff and re-sends what the daemon has not acknowledged. Callers only append a message
to a queue: a relay thread wakes the loop, so the caller never waits for another
thread's turn (a wake-up through the loop's self-pipe releases the GIL to the woken
thread, which costs the caller tens of microseconds).

Each ``begin`` carries its save's :class:`SaveRecord`. That save's ``done`` and ``fail``
wait here, on the I/O thread and never on the caller's, until the ``begin`` is
answered: they then name the attempt it joined, and a refused save's are not sent at
all (the daemon never admitted the rank, so a ``fail`` would land on whichever save
holds the step). After a reconnect, the open saves' begins are re-sent with their
attempt before everything else that was not acknowledged.

A save's record is not forgotten when its ``done`` (or ``fail``) is acknowledged: the
last :data:`KEEP_SETTLED` of them, and any ended in the last :data:`KEEP_SETTLED_S`
seconds (at most :data:`KEEP_SETTLED_MAX`), are kept, and after a reconnect each is re-sent too, a
``begin`` naming its attempt and then, unless the daemon answers that the step is
already promoted or refuses it, the ``done`` again. A daemon with its journal already
knows them (both are idempotent); one that restarted on an empty state directory (a
requeue's prolog, a pod's emptyDir) learns every rank's part of the saves in flight
from the ranks themselves, as the root is the truth for everything else.

Replies are read as lines of at most ``max_reply`` bytes; a longer one fails only the
call it answers (its id is read from the line's head) and the connection lives on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import queue
import threading
import time
from typing import Any, Final

import msgspec

from . import protocol as p
from ._errors import DaemonError
from ._layout import Layouts
from ._wire import Barrier, Outgoing, ReplyLines, SaveRecord, TooLong, reply_id

__all__ = ["KEEP_SETTLED", "KEEP_SETTLED_MAX", "KEEP_SETTLED_S", "Channel"]

log = logging.getLogger("orchestrator")

_MAX_UNACKED: Final = 100_000
_RETRY_UNAVAILABLE: Final = 0.5
_BACKOFF_START: Final = 0.05
_CHUNK: Final = 1 << 16
KEEP_SETTLED: Final = 16
"""Saves whose ``done``/``fail`` was acknowledged that are always re-sent after a reconnect.

A rank has one or two saves in flight at a time; sixteen covers any save still being
verified or promoted, with room for a daemon that is slow to settle them."""
KEEP_SETTLED_S: Final = 600.0
"""Beyond :data:`KEEP_SETTLED`, ended saves are kept this many seconds (a job that saves
every few seconds may have a backlog of promotions), up to :data:`KEEP_SETTLED_MAX`."""
KEEP_SETTLED_MAX: Final = 1024


class Channel:
    """The connection to the daemon and the two threads that keep it (see the module).

    Args:
        socket_path: The daemon's socket.
        layouts: Where the client records each root's layout from acknowledged begins.
        reconnect_max: Longest pause between reconnection attempts, in seconds.
        max_reply: Longest reply line accepted, in bytes.
    """

    def __init__(
        self, socket_path: str, layouts: Layouts, *, reconnect_max: float, max_reply: int
    ) -> None:
        self.socket_path = socket_path
        self.layouts = layouts
        self.connected = threading.Event()
        self.attempted = threading.Event()  # set once a first connection was tried
        self.closed = False
        self._reconnect_max = reconnect_max
        self._max_reply = max_reply
        self._ids = itertools.count(1)
        # Touched only on the I/O thread.
        self._unacked: dict[int, Outgoing] = {}
        self._saves: dict[tuple[str, int, int], SaveRecord] = {}  # re-sent after reconnects
        self._refused: dict[tuple[str, int, int], SaveRecord] = {}  # until begun again
        # Ended here, maybe not settled there: re-sent after reconnects (oldest first out).
        self._settled: dict[tuple[str, int, int], SaveRecord] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._warned = False
        self._outbox: queue.SimpleQueue[Outgoing | Barrier | None] = queue.SimpleQueue()
        self._loop = asyncio.new_event_loop()
        self._acked = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="ckptd-client", daemon=True)
        self._thread.start()
        self._relay_thread = threading.Thread(
            target=self._relay, name="ckptd-client-relay", daemon=True
        )
        self._relay_thread.start()

    # -- callers' threads ------------------------------------------------------------------

    def post(
        self,
        request: p.Request,
        future: concurrent.futures.Future[dict[str, Any]] | None = None,
        record: SaveRecord | None = None,
    ) -> None:
        """Queue one message; ``record`` is the save a begin, done or fail belongs to."""
        # Runs on the caller's thread: no encoding and nothing that releases the GIL. The
        # put wakes the relay thread (if it sleeps), which hands the message to the loop.
        if self.closed:
            if future is not None:
                future.set_exception(DaemonError("closed", "the client is closed"))
            else:
                log.warning("ckptd: %s after close() is not sent", type(request).__name__)
            return
        self._outbox.put(Outgoing(request, future, record))

    def barrier(self, future: concurrent.futures.Future[None]) -> bool:
        """Resolve ``future`` once all queued so far is acknowledged; False if closed."""
        if self.closed or not self._thread.is_alive():
            return False
        self._outbox.put(Barrier(future))  # behind everything queued so far
        return True

    def close(self) -> None:
        """Stop the threads (at most 5 s each); nothing queued afterwards is sent."""
        self.closed = True
        self._outbox.put(None)
        self._relay_thread.join(timeout=5.0)
        with contextlib.suppress(RuntimeError):  # the loop already ended
            self._loop.call_soon_threadsafe(self._shutdown)
        self._thread.join(timeout=5.0)

    # -- the relay and the loop ----------------------------------------------------------

    def _relay(self) -> None:
        # One wake-up of the loop per burst of messages, paid by this thread.
        while True:
            item = self._outbox.get()
            batch: list[Outgoing | Barrier] = []
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
            with contextlib.suppress(asyncio.CancelledError):
                self._loop.run_until_complete(self._main)
        finally:
            # End what close() gave up on (a barrier), or the closed loop reports it destroyed.
            for task in (left := asyncio.all_tasks(self._loop)):
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            self._loop.close()

    def _shutdown(self) -> None:
        self._main.cancel()

    async def _drained(self, barrier: concurrent.futures.Future[None]) -> None:
        while any(isinstance(o.message, p.Begin | p.Done | p.Fail) for o in self._unacked.values()):
            await self._acked.wait()
        if not barrier.done():
            barrier.set_result(None)

    def _send_batch(self, batch: list[Outgoing | Barrier]) -> None:
        lines: list[bytes] = []
        for item in batch:
            if isinstance(item, Barrier):
                self._loop.create_task(self._drained(item.future))
                continue
            message, record = item.message, item.record
            if isinstance(message, p.Begin) and record is not None:
                # An open save from now on: re-sent after a reconnect. (Recorded here, not
                # by the caller, so a begin still on its way here is never sent twice.)
                self._saves[record.key] = record
                self._refused.pop(record.key, None)
                self._settled.pop(record.key, None)
            elif isinstance(message, p.Done | p.Fail):
                if record is None:  # a bare done/fail: the key's latest begin
                    key = (message.root, message.step, message.rank)
                    record = item.record = self._saves.get(key) or self._refused.get(key)
                if record is not None and record.answer == "pending":
                    record.held.append(item)  # sent once the begin is answered
                    continue
                if record is not None and record.answer == "refused":
                    continue
            lines.append(self._enqueue(item))
        while len(self._unacked) > _MAX_UNACKED:
            dropped = self._unacked.pop(next(iter(self._unacked)))
            self._unanswerable(dropped, DaemonError("dropped", "too many unacknowledged"))
        if self._writer is not None and lines:
            self._writer.write(b"".join(lines))

    def _enqueue(self, item: Outgoing) -> bytes:
        message = item.message
        record = item.record
        if isinstance(message, p.Done | p.Fail) and record is not None and record.attempt:
            message = msgspec.structs.replace(message, attempt=record.attempt)
        item.message = message = msgspec.structs.replace(message, id=next(self._ids))
        item.line = p.encode(message)
        self._unacked[message.id] = item
        return item.line

    def _release(self, record: SaveRecord, refusal: DaemonError | None = None) -> None:
        # The begin is answered: its save's held done/fail go now, or never if refused
        # (a caller waiting on one is told the begin's refusal).
        held, record.held = record.held, []
        if record.answer == "refused":
            for item in held:
                if refusal is not None and item.future is not None and not item.future.done():
                    item.future.set_exception(refusal)
            return
        lines = [self._enqueue(item) for item in held]
        if self._writer is not None and lines:
            self._writer.write(b"".join(lines))

    async def _connect_forever(self) -> None:
        backoff = _BACKOFF_START
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(self.socket_path)
            except OSError as exc:
                self.attempted.set()
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
            self.connected.set()
            self.attempted.set()
            try:
                await self._read(reader)
            finally:
                self.connected.clear()
                self._writer = None
                writer.close()

    def _resend(self, writer: asyncio.StreamWriter) -> None:
        # Saves in flight first, so a restarted daemon learns of them before their done.
        # Every save's done/fail then waits for this daemon's answer to its begin: one
        # that lost its state knows the save only once that begin took the attempt over
        # (a done ahead of it, or behind a begin answered "retry", would be refused).
        queued = {id(o.record) for o in self._unacked.values() if isinstance(o.message, p.Begin)}
        written: set[int] = set()
        for key, record in list(self._settled.items()):
            # Its done/fail goes once the begin is answered (unless already promoted).
            del self._settled[key]
            if key in self._saves or record.settled is None:
                continue  # begun again since: that save is the one to re-send
            record.answer, record.replayed = "pending", True
            record.held = [Outgoing(record.settled.message, None, record)]
            self._saves[key] = record
        sent: dict[int, list[Outgoing]] = {}  # each open save's done/fail sent before
        for rid in sorted(self._unacked):
            outgoing = self._unacked[rid]
            owner = outgoing.record
            if (
                isinstance(outgoing.message, p.Done | p.Fail)
                and owner is not None
                and self._saves.get(owner.key) is owner
            ):
                del self._unacked[rid]
                sent.setdefault(id(owner), []).append(outgoing)
        for record in list(self._saves.values()):
            record.held = [*sent.get(id(record), ()), *record.held]
            record.answer = "pending"
            if id(record) in queued:
                continue
            msg = p.Begin(
                id=next(self._ids),
                root=record.root,
                step=record.step,
                rank=record.rank,
                world_size=record.world_size,
                resent=True,
                attempt=record.attempt,
                local_world_size=record.local_world_size,
                run=record.run,
            )
            again = Outgoing(msg, None, record, p.encode(msg))
            self._unacked[msg.id] = again
            written.add(msg.id)
            writer.write(again.line)
        for rid in sorted(self._unacked.keys() - written):
            writer.write(self._unacked[rid].line)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        lines = ReplyLines(self._max_reply)
        while True:
            try:
                data = await reader.read(_CHUNK)
            except OSError:
                return
            if not data:
                return
            for line in lines.feed(data):
                if isinstance(line, TooLong):
                    self._on_too_long(line.head)
                    continue
                try:
                    reply = msgspec.json.decode(line)
                except msgspec.DecodeError:
                    continue
                if isinstance(reply, dict) and "id" in reply:
                    self._on_reply(reply)

    def _on_too_long(self, head: bytes) -> None:
        rid = reply_id(head)
        outgoing = None if rid is None else self._unacked.pop(rid, None)
        if outgoing is None:
            log.warning("ckptd: discarded a reply longer than %s bytes", self._max_reply)
            return
        op = type(outgoing.message).__name__.lower()
        log.warning(
            "ckptd: the reply to %s was longer than %s bytes; discarded", op, self._max_reply
        )
        message = f"the reply to {op} is longer than the {self._max_reply} bytes accepted"
        self._unanswerable(outgoing, DaemonError("reply_too_long", message))
        self._wake_drained()

    def _unanswerable(self, outgoing: Outgoing, error: DaemonError) -> None:
        if outgoing.future is not None and not outgoing.future.done():
            outgoing.future.set_exception(error)
        record = outgoing.record
        if isinstance(outgoing.message, p.Begin) and record is not None:
            if record.answer == "pending":
                record.answer = "lost"
            self._release(record)

    def _wake_drained(self) -> None:
        acked, self._acked = self._acked, asyncio.Event()
        acked.set()

    def _on_reply(self, reply: dict[str, Any]) -> None:
        rid = reply.get("id")
        if not isinstance(rid, int) or (outgoing := self._unacked.get(rid)) is None:
            return
        message, record = outgoing.message, outgoing.record
        ok = bool(reply.get("ok"))
        error = reply.get("error") or {}
        if error.get("code") == p.ErrorCode.UNAVAILABLE and isinstance(
            message, p.Begin | p.Done | p.Fail
        ):
            # Not acknowledged (the daemon could not make it durable): send it again.
            self._loop.call_later(_RETRY_UNAVAILABLE, self._resend_one, rid)
            return
        del self._unacked[rid]
        if isinstance(message, p.Begin | p.Done | p.Fail):
            if not ok and not (record is not None and record.replayed):
                log.warning(
                    "ckptd refused %s for step %s of %s (%s): %s; it will not be promoted",
                    type(message).__name__.lower(),
                    message.step,
                    message.root,
                    error.get("code"),
                    error.get("message"),
                )
            if record is not None and (not ok or not isinstance(message, p.Begin)):
                # Ended, or refused: no longer open. An ended one is kept among the recent.
                if self._saves.get(record.key) is record:
                    del self._saves[record.key]
                    if ok:
                        self._keep_settled(record, outgoing)
            if isinstance(message, p.Begin) and record is not None:
                self._answered(record, message, reply)
        if outgoing.future is not None and not outgoing.future.done():
            outgoing.future.set_result(reply)
        self._wake_drained()

    def _keep_settled(self, record: SaveRecord, outgoing: Outgoing) -> None:
        now = time.monotonic()
        record.settled, record.replayed, record.ended = outgoing, False, now
        self._settled.pop(record.key, None)
        self._settled[record.key] = record
        while len(self._settled) > KEEP_SETTLED:
            oldest = self._settled[next(iter(self._settled))]
            if len(self._settled) <= KEEP_SETTLED_MAX and oldest.ended > now - KEEP_SETTLED_S:
                break
            del self._settled[oldest.key]

    def _answered(self, record: SaveRecord, begin: p.Begin, reply: dict[str, Any]) -> None:
        if record.replayed and (not reply.get("ok") or reply.get("state") == "promoted"):
            # The daemon knows this save settled (or will never take it): nothing to add.
            record.answer, record.held = "refused", []
            if self._saves.get(record.key) is record:
                del self._saves[record.key]
            return
        if reply.get("ok"):
            record.answer = "acknowledged"
            attempt = reply.get("attempt")
            if isinstance(attempt, str) and attempt:
                record.attempt = attempt
            path = reply.get("path")
            if isinstance(path, str):
                self.layouts.learn(begin.root, begin.step, path)
        else:
            record.answer = "refused"
            self._refused[record.key] = record
            error = reply.get("error") or {}
            refusal = DaemonError(str(error.get("code")), str(error.get("message")))
            self._release(record, refusal)
            return
        self._release(record)

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

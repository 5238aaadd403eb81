"""One client connection: bounded lines in, typed requests answered in order.

Requests are answered one after another, so a rank's ``begin`` is always applied before
its ``done``. ``wait`` is the exception: it is answered from its own task once the step
settles (at most :data:`MAX_WAITS` per connection). ``subscribe`` turns on a stream of
event lines alongside the replies. When the client closes its sending side, pending
waits are still answered before the connection closes. A connection that cannot be
written to is closed without disturbing anything else.
"""

from __future__ import annotations

from typing import Any, Final

import anyio
import msgspec
from anyio.abc import SocketAttribute, SocketStream, TaskGroup

from orchestrator import protocol as p

from ..base._errors import RequestError
from ..host._host import Serving
from ._framing import TOO_LONG, LineSocket, StalledLine

__all__ = ["MAX_WAITS", "Connection"]

MAX_WAITS: Final = 256
"""``wait`` requests pending at once on one connection."""

_LINGER: Final = 1.0
"""Seconds a closing connection may take to hand its last replies to the client."""


class Connection:
    """Serves one client of ``daemon`` over ``stream``."""

    def __init__(self, daemon: Serving, conn_id: int, stream: SocketStream) -> None:
        self.id = conn_id
        self._daemon = daemon
        self._stream = stream
        self._io: LineSocket | None = None
        self._waits = 0
        self._subscribed = False
        self._closed = False
        self._scope = anyio.CancelScope()

    async def run(self) -> None:
        """Read and answer requests until the client goes away or the daemon stops."""
        # The loop's transport serves the socket from here on (anyio's stream only
        # closes it): no system call to wait for a request, none to queue a reply.
        raw = self._stream.extra(SocketAttribute.raw_socket)
        io = self._io = await LineSocket.attach(raw, p.MAX_LINE, self._daemon.config.stall_timeout)
        try:
            with self._scope:
                async with anyio.create_task_group() as streams:
                    async with anyio.create_task_group() as waits:
                        try:
                            async for line in io.lines():
                                reply = await self._answer(line, waits, streams)
                                if reply is not None:
                                    await self.send(reply)
                        except StalledLine as exc:
                            # Half a line and silence: drop it, so it costs nothing else.
                            self._daemon.events.emit(
                                "client.dropped", "warning", conn=self.id, reason=str(exc)
                            )
                            self._scope.cancel()
                    # End of input: the pending waits above are answered first.
                    streams.cancel_scope.cancel()
            if not self._closed:
                await io.aclose(_LINGER)
        finally:
            io.close()

    async def send(self, message: msgspec.Struct | dict[str, Any]) -> None:
        """Write one line; if the client is gone, close the whole connection."""
        io = self._io
        if self._closed or io is None:
            return
        # One write call per line: lines from concurrent senders never interleave.
        io.write(p.encode(message))
        await io.drain()  # only while the client is not reading
        if io.lost:
            self._closed = True
            self._scope.cancel()

    async def _answer(
        self, line: bytes, waits: TaskGroup, streams: TaskGroup
    ) -> msgspec.Struct | None:
        request_id: int | None = None
        try:
            if line is TOO_LONG:
                raise RequestError(
                    p.ErrorCode.LINE_TOO_LONG, f"line longer than {p.MAX_LINE} bytes discarded"
                )
            try:
                request = p.decode_request(line)
            except p.ProtocolError as exc:
                request_id = exc.request_id
                raise RequestError(exc.code, str(exc)) from None
            request_id = request.id
            if isinstance(request, p.Wait):
                self._start_wait(request, waits)
                return None
            if isinstance(request, p.Subscribe):
                if self._subscribed:
                    raise RequestError(p.ErrorCode.INVALID_STATE, "already subscribed")
                self._subscribed = True
                stream = self._daemon.events.subscribe(self._dropped)
                await self.send(p.Ack(id=request.id))
                streams.start_soon(self._forward, stream)
                return None
            return await self._daemon.dispatch(self.id, request)
        except RequestError as exc:
            if exc.effects or self._daemon.ledger_changed():
                try:  # the refusal changed the ledger (a save found expired): commit it
                    await self._daemon.commit(exc.effects)
                except RequestError:
                    pass  # reported as journal.failed
            self._daemon.events.emit(
                "request.rejected",
                "warning",
                conn=self.id,
                id=request_id,
                code=exc.code,
                message=str(exc),
            )
            return _error(request_id, exc.code, str(exc))
        except Exception as exc:  # connection boundary: log it, answer, keep serving
            self._daemon.events.emit(
                "daemon.internal_error", "error", conn=self.id, error=repr(exc)
            )
            return _error(request_id, p.ErrorCode.INTERNAL, f"internal error: {exc!r}")

    def _start_wait(self, request: p.Wait, waits: TaskGroup) -> None:
        if self._waits >= MAX_WAITS:
            raise RequestError(
                p.ErrorCode.TOO_BUSY, f"more than {MAX_WAITS} waits pending on this connection"
            )
        root = self._daemon.configured(request.root)  # refused here, in order, if unknown
        self._waits += 1

        async def wait() -> None:
            try:
                await self.send(await self._daemon.settled(request, root))
            finally:
                self._waits -= 1

        waits.start_soon(wait)

    async def _forward(self, stream: Any) -> None:
        try:
            async for event in stream:
                await self.send(event)
        finally:
            self._daemon.events.unsubscribe(stream)

    def _dropped(self) -> None:
        # This subscriber fell too far behind. Hang up rather than let its backlog grow,
        # so a follower such as `ckptd tail` notices instead of silently missing events.
        self._closed = True
        self._scope.cancel()
        self._daemon.events.emit(
            "subscriber.dropped", "warning", conn=self.id, reason="fell behind the event stream"
        )


def _error(request_id: int | None, code: p.ErrorCode, message: str) -> p.ErrorReply:
    return p.ErrorReply(id=request_id, error=p.ErrorInfo(code=code.value, message=message))

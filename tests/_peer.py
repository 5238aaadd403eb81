"""A scripted peer on a real Unix socket that answers the client as a daemon with attempts.

The daemon side of attempts (an id in every ``begin`` reply) lands separately from the
client's; until then this peer lets the tests read exactly what the real client puts on
the wire: which ``done``/``fail`` name which attempt, when they are sent relative to the
``begin``'s answer, and what is re-sent after a reconnect. It speaks the protocol's
lines (replies shaped as :mod:`orchestrator.protocol` defines them); every request is
recorded as the decoded JSON object, in the order it was read.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from pathlib import Path
from typing import Any


class ScriptedDaemon:
    """Answers ``begin`` with ``attempt`` (or refuses it), acknowledges everything else.

    Args:
        path: Where to listen.
        root: The root whose ``tmp_step_N`` the ``begin`` replies name.
        attempt: The id given in ``begin`` replies ("" as a daemon before attempts).
    """

    def __init__(self, path: Path, root: Path, attempt: str = "att-1") -> None:
        self.root = root
        self.attempt = attempt
        self.refusal: tuple[str, str] | None = None  # (code, message) for every begin
        self.requests: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self.connections = 0
        self._answer_begins = threading.Event()
        self._answer_begins.set()
        self._held: list[tuple[socket.socket, dict[str, Any]]] = []
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(8)
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def hold_begins(self) -> None:
        """Read on, but answer no ``begin`` until :meth:`answer_begins`."""
        self._answer_begins.clear()

    def answer_begins(self) -> None:
        """Answer the held ``begin``s, and every later one at once."""
        with self._lock:
            self._answer_begins.set()
            held, self._held = self._held, []
        for conn, request in held:
            self._reply(conn, request)

    def hang_up(self) -> None:
        """Close every connection, as a daemon that restarts does."""
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def next_request(self, op: str, timeout: float = 30.0, **match: Any) -> dict[str, Any]:
        """The next recorded request with ``op`` (and the given fields), in order."""
        for request in self.seen:
            if _matches(request, op, match) and not request.get("_taken"):
                request["_taken"] = True
                return request
        deadline = time.monotonic() + timeout
        while True:
            try:
                request = self.requests.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                ops = [r["op"] for r in self.seen]
                raise AssertionError(f"no {op} {match} within {timeout}s; saw {ops}") from None
            self.seen.append(request)
            if _matches(request, op, match):
                request["_taken"] = True
                return request

    def drain(self) -> list[str]:
        """The ops of every request recorded so far, in order, without waiting."""
        while True:
            try:
                self.seen.append(self.requests.get_nowait())
            except queue.Empty:
                return [r["op"] for r in self.seen]

    def close(self) -> None:
        """Stop listening and hang up."""
        self._listener.close()
        self.hang_up()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn.makefile("rb") as lines:
            try:
                for line in lines:
                    request = json.loads(line)
                    self.requests.put(request)
                    with self._lock:
                        hold = request["op"] == "begin" and not self._answer_begins.is_set()
                        if hold:
                            self._held.append((conn, request))
                    if not hold:
                        self._reply(conn, request)
            except OSError:
                return

    def _reply(self, conn: socket.socket, request: dict[str, Any]) -> None:
        reply: dict[str, Any] = {"id": request["id"], "ok": True}
        if request["op"] == "begin":
            if self.refusal is not None:
                code, message = self.refusal
                reply.update(ok=False, error={"code": code, "message": message})
            else:
                path = str(self.root / f"tmp_step_{request['step']}")
                reply.update(path=path, state="open", attempt=self.attempt)
        elif request["op"] == "ping":
            reply.update(version="scripted", protocol=1)
        try:
            conn.sendall(json.dumps(reply).encode() + b"\n")
        except OSError:
            pass


def _matches(request: dict[str, Any], op: str, match: dict[str, Any]) -> bool:
    return request["op"] == op and all(request.get(k) == v for k, v in match.items())

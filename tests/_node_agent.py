"""A file agent that runs inside a simulated node's mount namespace.

``tests/_nodes.py`` starts one per node (``nsenter -t <bindfs pid> -m -- python
tests/_node_agent.py``) so that the test process, which lives outside every node's
namespace, can look at the shared directory and write into it *through that node's
mount*, with that mount's caching, as a process on that node would. It reads one JSON
request per line on stdin and answers one JSON line on stdout:

- ``{"op": "write", "path": P, "size": N}`` (or ``"data": TEXT``): create or replace the
  file, fsync it and its directory; answers ``{"ok": true, "size": N}``.
- ``{"op": "exists", "path": P}``: ``{"ok": true, "exists": bool}`` (a ``stat``, which
  the mount may answer from its cache).
- ``{"op": "open", "path": P}``: ``{"ok": true, "exists": bool}`` by ``open()``, which the
  mount may also answer from its cache for a name it looked up recently.
- ``{"op": "stat", "path": P}``: ``{"ok": true, "size": N, "ino": I, "mtime_ns": T}``
  (``size`` null for a missing file), as the mount's attribute cache answers.
- ``{"op": "list", "path": P}``: ``{"ok": true, "names": [...]}`` (sorted), or
  ``"names": null`` for a missing directory.
- ``{"op": "read", "path": P}``: ``{"ok": true, "text": str | null}``.
- ``{"op": "mkdir", "path": P}``: ``mkdir -p``.
- ``{"op": "rename_noreplace", "src": A, "dst": B}``: ``renameat2(RENAME_NOREPLACE)``;
  ``{"ok": true, "errno": 0 | E, "error": name}``.

Any other failure is answered ``{"ok": false, "error": "..."}``; the agent goes on.
:class:`NodeFs` is the test's end of it.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(request: dict[str, Any]) -> dict[str, Any]:
    path = request["path"]
    data = request["data"].encode() if "data" in request else b"\0" * int(request["size"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    _fsync_dir(os.path.dirname(path))
    return {"ok": True, "size": len(data)}


def _open(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    os.close(fd)
    return True


def _list(path: str) -> list[str] | None:
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


def _rename_noreplace(src: str, dst: str) -> dict[str, Any]:
    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.renameat2(
        _AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE
    )
    code = ctypes.get_errno() if result != 0 else 0
    return {"ok": True, "errno": code, "error": errno.errorcode.get(code, "")}


def handle(request: dict[str, Any]) -> dict[str, Any]:
    """The answer to one request."""
    op = request["op"]
    if op == "write":
        return _write(request)
    if op == "exists":
        return {"ok": True, "exists": os.path.lexists(request["path"])}
    if op == "open":
        return {"ok": True, "exists": _open(request["path"])}
    if op == "stat":
        try:
            st = os.stat(request["path"])
        except FileNotFoundError:
            return {"ok": True, "size": None, "ino": None, "mtime_ns": None}
        return {"ok": True, "size": st.st_size, "ino": st.st_ino, "mtime_ns": st.st_mtime_ns}
    if op == "list":
        return {"ok": True, "names": _list(request["path"])}
    if op == "read":
        return {"ok": True, "text": _read(request["path"])}
    if op == "mkdir":
        os.makedirs(request["path"], exist_ok=True)
        return {"ok": True}
    if op == "rename_noreplace":
        return _rename_noreplace(request["src"], request["dst"])
    return {"ok": False, "error": f"unknown op {op!r}"}


class NodeFs:
    """The shared directory as one node sees it: a file agent inside its namespace."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self._lock = threading.Lock()
        ready = self._readline()
        assert ready.get("ready"), ready

    def _readline(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the node's file agent exited")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """One request to the agent; its answer (``ok`` false raises)."""
        assert self.proc.stdin is not None
        with self._lock:
            self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.proc.stdin.flush()
            answer = self._readline()
        if not answer.get("ok"):
            raise OSError(f"{op} {fields}: {answer.get('error')}")
        return answer

    def write(self, path: Path, size: int = 64, data: str | None = None) -> int:
        """Write (and fsync) a file through this node's mount; returns its size."""
        fields: dict[str, Any] = {"data": data} if data is not None else {"size": size}
        size_written: int = self.call("write", path=str(path), **fields)["size"]
        return size_written

    def exists(self, path: Path) -> bool:
        """Whether this node's mount says ``path`` exists (``lstat``, cache and all)."""
        return bool(self.call("exists", path=str(path))["exists"])

    def opens(self, path: Path) -> bool:
        """Whether ``open(path)`` succeeds through this node's mount."""
        return bool(self.call("open", path=str(path))["exists"])

    def size(self, path: Path) -> int | None:
        """The size ``stat`` gives through this node's mount (None if it is missing)."""
        size: int | None = self.call("stat", path=str(path))["size"]
        return size

    def listdir(self, path: Path) -> list[str] | None:
        """The names in ``path`` through this node's mount (None if it is missing)."""
        names: list[str] | None = self.call("list", path=str(path))["names"]
        return names

    def read(self, path: Path) -> str | None:
        """The text of ``path`` through this node's mount (None if it is missing)."""
        text: str | None = self.call("read", path=str(path))["text"]
        return text

    def mkdir(self, path: Path) -> None:
        """``mkdir -p`` through this node's mount."""
        self.call("mkdir", path=str(path))

    def rename_noreplace(self, src: Path, dst: Path) -> str:
        """``renameat2(src, dst, RENAME_NOREPLACE)``: ``""`` on success, else the errno name."""
        error: str = self.call("rename_noreplace", src=str(src), dst=str(dst))["error"]
        return error

    def close(self) -> None:
        """End the agent."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def main() -> None:
    """Answer requests from stdin until it closes."""
    sys.stdout.write(json.dumps({"ok": True, "ready": True, "pid": os.getpid()}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = handle(json.loads(line))
        except (OSError, KeyError, ValueError) as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

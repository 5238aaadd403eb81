"""``multiprocessing``'s spawn, for a forked rank: the new process is forked by its zygote.

torch's process-based async checkpointing (``AsyncCheckpointerType.PROCESS``, which
nemo_automodel's Checkpointer always uses) starts its upload process with
``multiprocessing.get_context("spawn")``: a fresh interpreter that imports torch again
(about 2.5 s of CPU, fifty times in a run of the suite). In a rank forked from a zygote
(``tests/_zygote.py``), :func:`install` makes that spawn ask the rank's zygote, which
imported torch once, to fork the new process instead. What the process then runs is
unchanged: multiprocessing's own spawn entry point, reading the same preparation data
and pickled process object over the same pipe, with the same file descriptor numbers
(the pipes and the connection DCP hands its upload process), the rank's environment,
working directory, stdout and stderr, and the rank's mount namespace. Its pid is its
own (signals reach it as they would), and it outlives a killed rank, as a spawned
process does.

What differs: its parent is the zygote, not the rank, so the rank learns its exit
status from the zygote over a socket, as a test learns a forked rank's
(:class:`ZygotePopen`). ``CKPTD_TEST_FORK=0`` turns this off with the rest of the
zygote.
"""

from __future__ import annotations

import array
import fcntl
import io
import json
import multiprocessing.context
import os
import select
import signal
import socket
import sys
import traceback
from multiprocessing import popen_spawn_posix, reduction, resource_tracker, spawn, util
from typing import Any

SOCKET_VAR = "_CKPTD_TEST_ZYGOTE"
"""Set in a forked rank: its zygote's socket, where spawns go."""


# -- the rank's side -----------------------------------------------------------------------


class ZygotePopen(popen_spawn_posix.Popen):
    """A spawned process that the rank's zygote forked; its status comes from the zygote."""

    _fds: list[int]
    _conn: socket.socket | None = None
    _buffer = b""

    def _launch(self, process_obj: Any) -> None:
        tracker_fd = resource_tracker.getfd()
        assert tracker_fd is not None  # started on POSIX
        self._fds.append(tracker_fd)
        prep_data = spawn.get_preparation_data(process_obj._name)
        fp = io.BytesIO()
        multiprocessing.context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, fp)
            reduction.dump(process_obj, fp)
        finally:
            multiprocessing.context.set_spawning_popen(None)
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        try:
            self._fds.extend([child_r, child_w])
            self._conn, self.pid = _request(self._fds, tracker_fd, child_r)
            self.sentinel = parent_r
            with open(parent_w, "wb", closefd=False) as f:
                f.write(fp.getbuffer())
        finally:
            close_fds = getattr(util, "close_fds")  # noqa: B009  # untyped in typeshed
            self.finalizer = util.Finalize(self, close_fds, (parent_r, parent_w))
            os.close(child_r)
            os.close(child_w)

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        """The exit code once the zygote has reaped the process (blocking without WNOHANG)."""
        if self.returncode is None and self._conn is not None:
            while b"\n" not in self._buffer:
                if flag & os.WNOHANG and not select.select([self._conn], [], [], 0)[0]:
                    return None
                chunk = self._conn.recv(4096)
                if not chunk:  # the zygote went away: the process with it
                    self._buffer += b'{"status": -9}\n'
                    break
                self._buffer += chunk
            line, _, self._buffer = self._buffer.partition(b"\n")
            self.returncode = int(json.loads(line)["status"])
            self._conn.close()
        return self.returncode


def _request(fds: list[int], tracker_fd: int, pipe_handle: int) -> tuple[socket.socket, int]:
    """Ask the zygote to fork the spawned process; its connection and pid."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(os.environ[SOCKET_VAR])
        request = {
            "spawn": {"fds": fds, "tracker_fd": tracker_fd, "pipe_handle": pipe_handle},
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "mount_ns": os.getpid(),
            "parent": os.getpid(),
        }
        passed = array.array("i", [*fds, 1, 2])
        message = [json.dumps(request).encode() + b"\n"]
        conn.sendmsg(message, [(socket.SOL_SOCKET, socket.SCM_RIGHTS, passed)])
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = conn.recv(1)
            if not chunk:
                raise OSError("the zygote did not fork the spawned process")
            reply += chunk
        return conn, int(json.loads(reply)["pid"])
    except BaseException:
        conn.close()
        raise


def install() -> None:
    """In a forked rank: start spawned processes through the zygote from now on."""
    if SOCKET_VAR in os.environ:
        multiprocessing.context.SpawnProcess._Popen = staticmethod(ZygotePopen)  # type: ignore[method-assign]


# -- the zygote's side ---------------------------------------------------------------------


def become(request: dict[str, Any], fds: list[int]) -> int:
    """In the zygote's new child: take the rank's descriptors and run spawn's entry point.

    ``fds`` are the rank's descriptors as received (numbered anew), in the order of
    ``request["spawn"]["fds"]``, then the rank's stdout and stderr.

    Returns:
        The process's exit code.
    """
    spec = request["spawn"]
    targets = [*spec["fds"], 1, 2]
    # Out of the way first: a received descriptor may hold a number another one needs.
    floor = max([*targets, *fds]) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, floor) for fd in fds]
    for fd, target in zip(moved, targets, strict=True):
        os.dup2(fd, target)
    keep = {0, *targets}
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd in os.listdir("/proc/self/fd"):
        if int(fd) not in keep:
            try:
                os.close(int(fd))
            except OSError:
                pass  # the listing's own descriptor
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), line_buffering=True)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.set_wakeup_fd(-1)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    # As spawn's entry point does: the rank's resource tracker, by its descriptor.
    setattr(getattr(resource_tracker, "_resource_tracker"), "_fd", spec["tracker_fd"])  # noqa: B009, B010
    pipe_handle = int(spec["pipe_handle"])
    try:
        code = spawn._main(pipe_handle, os.dup(pipe_handle))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    return int(code)

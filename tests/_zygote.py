"""Rank processes forked from a server that imported torch once, instead of each importing it.

A rank of the suite's gloo jobs spends most of its CPU importing ``torch`` (about 2.5 s)
and, for the automodel jobs, ``nemo_automodel`` (about 6 s); a ``ckptd serve`` started
by a test, importing the daemon (about 0.35 s, hundreds of times). A :class:`Zygote` is a
process that imports them once and then forks one child per rank on request. Each child
is a real, separate process: its own pid, environment, working directory and stdout
pipe, running the rank's script as ``__main__``; the test signals it and reads its exit
status as it would a ``subprocess.Popen``'s (:class:`ForkedProcess` is one).

The server is single-threaded (a selector over its socket and one pidfd per child), so
nothing else runs when it forks. It refuses to fork once the preload started a thread,
and ``CKPTD_TEST_FORK=0`` turns it off: ranks are then started with ``exec`` as before.
"""

from __future__ import annotations

import array
import atexit
import ctypes
import io
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, NoReturn

from tests import _zygote_launch, _zygote_spawn

REPO = Path(__file__).resolve().parent.parent

_OBJECT_STORE: Final = ("s3fs", "torch.distributed.checkpoint._fsspec_filesystem")
"""What a rank saving to an ``s3://`` root imports (about 0.55 s of CPU): DCP's fsspec
writer over s3fs. Neither starts a thread; preloaded where the ``s3`` extra is installed."""

PRELOADS: Mapping[str, tuple[str, ...]] = {
    "torch": ("torch", "torch.distributed", "torch.distributed.checkpoint", *_OBJECT_STORE),
    "automodel": (
        "torch",
        "torch.distributed",
        "torch.distributed.checkpoint",
        "nemo_automodel.components.checkpoint.checkpointing",
        *_OBJECT_STORE,
    ),
    # transformers' Trainer jobs (tests/_hf_worker.py, under torchrun or alone): importing
    # it takes about 7 s.
    "transformers": (
        "torch",
        "torch.distributed",
        "torch.distributed.checkpoint",
        "torch.distributed.run",
        "orchestrator.transformers._trainer",
        "transformers.models.gpt2.modeling_gpt2",
    ),
    # ``ckptd serve`` (tests/conftest.py's DaemonProcess): the suite starts hundreds.
    "daemon": ("daemon.cli", "daemon.server._server", "uvloop", "daemon.store._s3client"),
}
"""What each kind of zygote imports before it forks."""


_forked_cpu = 0.0
_forked_cpu_lock = threading.Lock()


def forked_cpu() -> float:
    """CPU seconds (user + system) of every child of this process's zygotes reaped so far.

    Each child's own and its reaped descendants' (an upload process a rank started), as
    ``wait4`` reports them to the zygote: the child's parent, which alone can see them.
    """
    with _forked_cpu_lock:
        return _forked_cpu


def _count_cpu(seconds: float) -> None:
    global _forked_cpu
    with _forked_cpu_lock:
        _forked_cpu += seconds


def enabled() -> bool:
    """Whether ranks are forked from a zygote (``CKPTD_TEST_FORK=0``: never)."""
    return os.environ.get("CKPTD_TEST_FORK", "1") != "0" and hasattr(os, "pidfd_open")


# -- the test's side -----------------------------------------------------------------------


class ForkedProcess(subprocess.Popen[bytes]):
    """A child of a :class:`Zygote`, used as the ``subprocess.Popen`` it stands for.

    Its exit status comes over its own connection to the zygote (the zygote, not this
    process, is its parent and reaps it); signals go to its pid as to any process.
    """

    def __init__(
        self, args: Sequence[str], conn: socket.socket, stdout: io.BufferedReader | None
    ) -> None:
        # Popen.__init__ would start a process: set the attributes its methods use.
        self.args = list(args)
        self.stdin = None
        self.stdout = stdout
        self.stderr = None
        self.returncode: int | Any = None
        self.text_mode = False
        self.encoding = None
        self.errors = None
        self.universal_newlines = False
        self.pipesize = -1
        self._waitpid_lock = threading.Lock()
        self._input = None
        self._communication_started = False
        self._sigint_wait_secs = 0.25
        self._closed_child_pipe_fds = True
        self._child_created = True
        self._conn = conn
        self._buffer = b""
        reply = self._read_line(None)
        if reply is None or "pid" not in reply:
            raise OSError(f"the zygote did not start {args!r}: {reply}")
        self.pid = int(reply["pid"])

    def __del__(self) -> None:
        # Popen's own __del__ would poll a child that is not this process's to reap.
        conn = getattr(self, "_conn", None)
        if conn is not None:
            conn.close()

    def _read_line(self, timeout: float | None) -> dict[str, Any] | None:
        """The zygote's next message; None if none came within ``timeout``."""
        self._conn.settimeout(timeout)
        while b"\n" not in self._buffer:
            try:
                chunk = self._conn.recv(4096)
            except (TimeoutError, BlockingIOError):
                return None
            if not chunk:
                return {"status": -signal.SIGKILL, "lost": True}  # the zygote went away
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        message: dict[str, Any] = json.loads(line)
        return message

    def _status(self, timeout: float | None) -> int | None:
        while self.returncode is None:
            reply = self._read_line(timeout)
            if reply is None:
                break
            if "status" in reply:
                self.returncode = int(reply["status"])
                _count_cpu(float(reply.get("cpu", 0.0)))
                self._conn.close()
        return self.returncode

    def wait_stopped(self, timeout: float) -> bool:
        """Wait until the child has stopped (``SIGSTOP`` taken by every thread).

        What ``waitid(WSTOPPED)`` tells a parent; the zygote, the parent, asks for it.

        Returns:
            True once it is stopped; False if it exited first or ``timeout`` passed.
        """
        with self._waitpid_lock:
            if self.returncode is not None:
                return False
            self._conn.sendall(b'{"op": "stopped"}\n')
            while True:
                reply = self._read_line(timeout)
                if reply is None:
                    return False
                if "status" in reply:
                    self.returncode = int(reply["status"])
                    _count_cpu(float(reply.get("cpu", 0.0)))
                    self._conn.close()
                    return False
                if reply.get("stopped"):
                    return True

    def _internal_poll(self, _deadstate: object = None, *args: Any, **kwargs: Any) -> int | None:
        with self._waitpid_lock:
            return self._status(0.0)

    def _wait(self, timeout: float | None) -> int:
        with self._waitpid_lock:
            code = self._status(timeout)
        if code is None:
            assert timeout is not None
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code


class Zygote:
    """A server process that imported ``PRELOADS[kind]`` and forks ranks on request."""

    def __init__(self, kind: str) -> None:
        self._dir = tempfile.mkdtemp(prefix="ck-zyg-", dir="/tmp")
        self.socket_path = os.path.join(self._dir, "z.sock")
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        # pyarrow (transformers imports datasets) starts jemalloc's background thread.
        env["JE_ARROW_MALLOC_CONF"] = "background_thread:false"
        cmd = [sys.executable, "-m", "tests._zygote", self.socket_path, kind]
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=REPO
        )
        assert self._proc.stdout is not None
        ready = self._proc.stdout.readline()
        self.usable = ready.strip() == b"ready"
        """False when the preload started threads: forking would be unsafe then."""
        atexit.register(self.close)

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str | os.PathLike[str],
        mount_ns: int | None = None,
    ) -> ForkedProcess:
        """Fork ``python argv...`` with ``env`` in ``cwd``; stdout and stderr piped.

        ``mount_ns``: a pid whose mount namespace the child enters first, as ``nsenter
        -t PID -m`` would (a simulated node's, ``tests/_nodes.py``).
        """
        read, write = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.socket_path)
            request = json.dumps(
                {"argv": list(argv), "env": dict(env), "cwd": str(cwd), "mount_ns": mount_ns}
            )
            fds = array.array("i", [write])
            conn.sendmsg([request.encode() + b"\n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        except BaseException:
            conn.close()
            os.close(read)
            raise
        finally:
            os.close(write)
        return ForkedProcess(argv, conn, os.fdopen(read, "rb"))

    def close(self) -> None:
        """Stop the server (its children run on until they end)."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                stream.close()
        try:
            os.unlink(self.socket_path)
            os.rmdir(self._dir)
        except OSError:
            pass


_zygotes: dict[str, Zygote] = {}
_lock = threading.Lock()


def zygote(kind: str) -> Zygote | None:
    """This process's zygote of ``kind``, started on first use; None where unusable."""
    if not enabled():
        return None
    with _lock:
        if kind not in _zygotes:
            _zygotes[kind] = Zygote(kind)
        found = _zygotes[kind]
    return found if found.usable else None


# -- the zygote's side ---------------------------------------------------------------------


def _serve(path: str, kind: str) -> None:
    for name in PRELOADS[kind]:
        try:
            __import__(name)
        except ImportError:
            if name not in _OBJECT_STORE:
                raise
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        sys.stdout.write("threads\n")  # forking now could copy a held lock: refuse
        sys.stdout.flush()
        sys.stdin.read()
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin, selectors.EVENT_READ, "parent")
    # A child's stop is seen by its parent only through waitid: SIGCHLD wakes the loop.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector.register(wake_r, selectors.EVENT_READ, "sigchld")
    children: dict[int, _Child] = {}
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        for key, _ in selector.select():
            if key.data == "parent":
                return  # the test process ended (its end of our stdin closed)
            if key.data == "accept":
                conn, _ = listener.accept()
                child = _fork(conn, listener, selector, path)
                children[child.pid] = child
            elif key.data == "sigchld":
                os.read(wake_r, 4096)
            elif isinstance(key.data, tuple):  # a request on a child's connection
                child = key.data[1]
                if not child.read_request():
                    selector.unregister(child.sock)
            else:
                child = key.data
                selector.unregister(key.fileobj)
                if child.asking:
                    selector.unregister(child.sock)
                del children[child.pid]
                child.reap()
                requester = children.get(child.spawned_by or 0)
                if requester is not None:  # an upload process a rank spawned, a
                    requester.extra_cpu += child.cpu  # torchrun's rank: counted as theirs
        for child in children.values():
            child.answer_stop()


class _Child:
    """A forked rank: its pid, the pidfd that says when it ended, who waits for it."""

    def __init__(self, sock: socket.socket, pid: int, spawned_by: int | None = None) -> None:
        self.sock = sock
        self.pid = pid
        self.spawned_by = spawned_by
        """The forked process that asked for this one: the rank whose ``multiprocessing``
        spawn it is (``tests/_zygote_spawn.py``), the torchrun whose rank it is
        (``tests/_zygote_launch.py``); its CPU is counted with theirs."""
        self.cpu = 0.0
        self.extra_cpu = 0.0
        """CPU of the processes it spawned through the zygote, reaped before it."""
        self.pidfd = os.pidfd_open(pid)
        self.asking = True  # its connection is in the selector
        self.wants_stop = False

    def read_request(self) -> bool:
        """Take a request from the test (``stopped``); False once it closed its end."""
        try:
            data = self.sock.recv(4096)
        except OSError:
            data = b""
        if not data:
            self.asking = False
            return False
        self.wants_stop = self.wants_stop or b"stopped" in data
        return True

    def answer_stop(self) -> None:
        """Tell a test waiting for this child's stop, once it has stopped."""
        if not self.wants_stop:
            return
        flags = os.WSTOPPED | os.WEXITED | os.WNOHANG | os.WNOWAIT
        try:
            seen = os.waitid(os.P_PID, self.pid, flags)
        except ChildProcessError:
            return
        if seen is not None and seen.si_code == os.CLD_STOPPED:
            self.wants_stop = False
            self._send({"stopped": True})

    def reap(self) -> None:
        """Reap the ended child and send its exit status and CPU time."""
        os.close(self.pidfd)
        _, status, usage = os.wait4(self.pid, 0)
        self.cpu = usage.ru_utime + usage.ru_stime + self.extra_cpu
        self._send({"status": os.waitstatus_to_exitcode(status), "cpu": round(self.cpu, 3)})
        self.sock.close()

    def _send(self, message: dict[str, Any]) -> None:
        try:
            self.sock.sendall(json.dumps(message).encode() + b"\n")
        except OSError:
            pass  # the test process closed its end


def _fork(
    conn: socket.socket, listener: socket.socket, selector: selectors.BaseSelector, path: str
) -> _Child:
    data, fds, _, _ = socket.recv_fds(conn, 1024 * 1024, 256)
    request = json.loads(data)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        selector.close()
        listener.close()
        conn.close()
        if "spawn" in request:  # a forked rank's multiprocessing spawn
            _become_spawned(request, fds)
        _child(request, fds, path)
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    child = _Child(conn, pid, request.get("parent"))
    selector.register(child.pidfd, selectors.EVENT_READ, child)
    selector.register(conn, selectors.EVENT_READ, ("conn", child))
    return child


def _become_spawned(request: dict[str, Any], fds: list[int]) -> None:
    """Become a process a rank spawned (``tests/_zygote_spawn.py``), in its namespace."""
    code = 1
    try:
        _enter_mount_namespace(int(request["mount_ns"]))
        code = _zygote_spawn.become(request, fds)
    except BaseException:
        traceback.print_exc()
    _end(code)


def _child(request: dict[str, Any], fds: list[int], path: str) -> None:
    """Become the rank: its stdio, environment and directory, then run its ``argv``.

    ``fds``: the pipe its stdout and stderr go to, or (``request["stdio"]``) its
    requester's stdout and stderr (a torchrun's rank, ``tests/_zygote_launch.py``).
    """
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        out, err = fds[:2] if request.get("stdio") else (fds[0], fds[0])
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the zygote's sockets, other ranks'
        if request.get("setsid"):
            os.setsid()  # as torchrun starts a rank: its own process group, for killpg
        # As a fresh interpreter has them (SIGPIPE stays ignored, as Python sets it).
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.set_wakeup_fd(-1)
        if request.get("mount_ns") is not None:
            _enter_mount_namespace(int(request["mount_ns"]))
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[_zygote_spawn.SOCKET_VAR] = path
        _zygote_spawn.install()
        os.chdir(request["cwd"])
        argv = list(request["argv"])
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        while argv and argv[0] in ("-u", "-B"):
            unbuffered = argv.pop(0) == "-u" or unbuffered
        if _zygote_launch.is_launcher(argv):
            _zygote_launch.install()
        sys.stdin = open(0, encoding="utf-8", closefd=False)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            stream = io.TextIOWrapper(
                open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False),
                encoding="utf-8",
                errors="backslashreplace" if name == "stderr" else "strict",
                line_buffering=name == "stderr",
                write_through=unbuffered,
            )
            setattr(sys, name, stream)
        code = _run(argv)
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads, as at exit
        atexit._run_exitfuncs()
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        traceback.print_exc()
    _end(code)


def _end(code: int) -> NoReturn:
    """End a forked child with ``code``, its output flushed (no interpreter teardown)."""
    for out_stream in (sys.stdout, sys.stderr):
        try:
            out_stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


_CLONE_NEWNS = 0x00020000


def _enter_mount_namespace(pid: int) -> None:
    """``setns(2)`` into ``pid``'s mount namespace (this child has one thread, as it must)."""
    if os.stat(f"/proc/{pid}/ns/mnt").st_ino == os.stat("/proc/self/ns/mnt").st_ino:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, _CLONE_NEWNS) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into the mount namespace of {pid}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _run(argv: list[str]) -> int:
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    return 0


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    sys.stderr.write(f"{exc.code}\n")
    return 1


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2])

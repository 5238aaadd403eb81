"""Simulated nodes on one machine: a private mount namespace each, one shared directory.

A node is a private mount namespace holding its own bindfs mount of one shared
``BACKING`` directory, at the same ``MOUNT`` path on every node::

    unshare -m --propagation private -- bindfs -f -o entry_timeout=1,... BACKING MOUNT

The foreground bindfs process holds the namespace, and its pid is the namespace's
handle: the node's daemon, its ranks and its file agent (``tests/_node_agent.py``) run
inside with ``nsenter -t <pid> -m -- CMD``. Each mount caches lookups and attributes
for about a second, like an NFS client: a file created through one node's mount stays
invisible through another's for about that long, inotify on one mount does not see
writes made through another, and ``renameat2(RENAME_NOREPLACE)`` fails with ``EINVAL``.
Unix sockets under ``/tmp`` and gloo over loopback work across the namespaces, so each
node's daemon gets its own short socket path and state directory under ``/tmp``.

The test process itself stays outside every namespace: it reads the shared directory
uncached at ``Cluster.backing`` and through one node's mount with ``SimNode.fs``.
Protocol-level ranks (``tests/_node_jobs.py``) speak the wire protocol to their node's
daemon and write their files through their node's mount.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests._fuse import CACHING, in_mount_table
from tests._node_agent import NodeFs
from tests._system import require_root, require_tool
from tests._zygote import zygote
from tests.conftest import REPO, DaemonProcess, LineClient

__all__ = [
    "Cluster",
    "SimNode",
    "cluster",
    "clusters",
    "make_cluster",
    "wait_until",
]

AGENT = REPO / "tests" / "_node_agent.py"

Settings = Mapping[str, "int | float | str | bool"]


def wait_until(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    """Call ``check`` until it returns something truthy; fail after ``timeout`` seconds.

    For state the harness can only observe by looking (a remote mount's view of a file,
    a process's mount table): each look is cheap, the deadline is what the test asserts.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout}s: {what} (last: {result!r})")
        time.sleep(interval)


def _await_mount(proc: subprocess.Popen[bytes], mount: Path, timeout: float = 10.0) -> None:
    """Return once ``mount`` is in the mount table of ``proc``'s namespace."""
    deadline = time.monotonic() + timeout
    while not in_mount_table(mount, proc.pid):
        left = deadline - time.monotonic()
        if proc.poll() is not None or left <= 0:
            proc.kill()
            err = proc.communicate()[1].decode(errors="replace")
            raise RuntimeError(f"bindfs did not mount {mount} in its namespace: {err.strip()}")
        # The kernel signals a change of the namespace's mount table to pollers of its
        # mountinfo (POLLPRI). The file is opened anew each round: until unshare has
        # run, /proc/PID/mountinfo is the parent's namespace, which never changes.
        try:
            with open(f"/proc/{proc.pid}/mountinfo", "rb") as table:
                poller = select.poll()
                poller.register(table, select.POLLPRI | select.POLLERR)
                poller.poll(min(left, 0.05) * 1000)
        except FileNotFoundError:
            continue


def _toml_value(value: int | float | str | bool) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, str) else repr(value)


class SimNode:
    """One simulated node: a mount namespace with the shared directory at ``mount``.

    Args:
        name: The node's name (``ckptd serve --node``).
        backing: The shared directory.
        mount: Where every node sees it.
        home: A short private directory under /tmp for the node's socket and state.
        options: bindfs ``-o`` options (default: about a second of caching).
    """

    def __init__(
        self, name: str, backing: Path, mount: Path, home: Path, options: str = CACHING
    ) -> None:
        self.name = name
        self.mount = mount
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        self.socket = home / "d.sock"
        self.state_dir = home / "state"
        self.daemon: DaemonProcess | None = None
        self._daemon_args: tuple[list[Path], list[str], dict[str, str]] | None = None
        self._procs: list[subprocess.Popen[Any]] = []
        self.frozen = False
        cmd = ["unshare", "-m", "--propagation", "private", "--", "bindfs", "-f"]
        cmd += [*(["-o", options] if options else []), str(backing), str(mount)]
        # unshare execs bindfs in the new namespace: this pid is bindfs's.
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _await_mount(self.proc, mount)
        agent = subprocess.Popen(
            [*self.enter(), sys.executable, "-u", str(AGENT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.fs = NodeFs(agent)
        """Files through this node's mount."""

    @property
    def pid(self) -> int:
        """The bindfs process's pid: the handle of the node's namespace."""
        return self.proc.pid

    def freeze(self) -> None:
        """Hang the node's mount (SIGSTOP bindfs): every call on it blocks until :meth:`thaw`."""
        os.kill(self.pid, signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        """Let the node's mount answer again."""
        os.kill(self.pid, signal.SIGCONT)
        self.frozen = False

    def enter(self) -> list[str]:
        """The command prefix that runs a command inside this node's namespace."""
        return ["nsenter", "-t", str(self.pid), "-m", "--"]

    def run(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` inside the node to completion (text output captured)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 60)
        kwargs.setdefault("cwd", REPO)
        return subprocess.run([*self.enter(), *cmd], check=False, **kwargs)

    def popen(
        self, cmd: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen[bytes]:
        """Start ``cmd`` inside the node (killed, if still running, when the node ends).

        A Python program whose output is piped (stderr with stdout) is forked from the
        torch zygote into the node's namespace (``tests/_zygote.py``), as its ranks are
        elsewhere, rather than importing torch afresh.
        """
        kwargs.setdefault("cwd", REPO)
        full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        piped = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
        forked = zygote("torch") if cmd[0] == sys.executable else None
        if forked is not None and {k: v for k, v in kwargs.items() if k != "cwd"} == piped:
            proc: subprocess.Popen[bytes] = forked.spawn(
                cmd[1:], full_env, kwargs["cwd"], mount_ns=self.pid
            )
        else:
            proc = subprocess.Popen([*self.enter(), *cmd], env=full_env, **kwargs)
        self._procs.append(proc)
        return proc

    def start_daemon(
        self,
        roots: Sequence[Path],
        *extra: str,
        settings: Settings | None = None,
        root_settings: Settings | None = None,
        env: Mapping[str, str] | None = None,
    ) -> DaemonProcess:
        """Start ``ckptd serve --node NAME`` inside the node and wait for ``daemon.ready``.

        Args:
            roots: Checkpoint roots (paths under the shared mount).
            extra: More ``serve`` flags.
            settings: Top-level TOML keys (``node_timeout``, ``lease``, ...).
            root_settings: Keys of every root's ``[[roots]]`` table (``watch``,
                ``poll_interval``); with them the roots are configured in the TOML file.
            env: More environment for the daemon.
        """
        args = list(extra)
        if "--node" not in args:
            args += ["--node", self.name]
        flag_roots = list(roots)
        if settings or root_settings:
            lines = [f"{k} = {_toml_value(v)}" for k, v in (settings or {}).items()]
            if root_settings:
                for r in roots:
                    lines += ["[[roots]]", f"path = {_toml_value(str(r))}"]
                    lines += [f"{k} = {_toml_value(v)}" for k, v in root_settings.items()]
                flag_roots = []
            config = self.home / "ckptd.toml"
            config.write_text("\n".join(lines) + "\n")
            args += ["--config", str(config)]
        self._daemon_args = (flag_roots, args, dict(env or {}))
        return self._spawn()

    def _spawn(self) -> DaemonProcess:
        assert self._daemon_args is not None
        roots, args, env = self._daemon_args
        daemon = DaemonProcess(
            self.socket,
            roots,
            *args,
            state_dir=self.state_dir,
            env=env,
            wrap=self.enter(),
            mount_ns=self.pid,
        )
        self.daemon = daemon
        return daemon.start()

    def kill_daemon(self, sig: int = signal.SIGKILL) -> int:
        """Signal the node's daemon and reap it; returns its exit code.

        On a frozen node a SIGKILL is sent first and the mount thawed before the reap: a
        killed process still waits for the calls bindfs had taken before it stopped (and
        for its open files' flushes as it exits), but starts none.
        """
        assert self.daemon is not None, f"{self.name} has no daemon"
        if self.frozen and sig == signal.SIGKILL and self.daemon.proc is not None:
            self.daemon.proc.send_signal(sig)
            self.thaw()
        code = self.daemon.stop(sig)
        self._close_daemon()
        return code

    def restart_daemon(self, *, wipe: bool = False) -> DaemonProcess:
        """Start the daemon again, as configured last, on the same state directory.

        ``wipe``: on an empty one instead, as a requeued job's node starts (its prolog
        wipes the state directory, a pod's ``emptyDir`` is new).
        """
        if self.daemon is not None and self.daemon.proc is not None:
            if self.daemon.proc.poll() is None:
                self.kill_daemon(signal.SIGTERM)
        if wipe:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        return self._spawn()

    def _close_daemon(self) -> None:
        if self.daemon is not None and self.daemon.proc is not None:
            if self.daemon.proc.stdout is not None:
                self.daemon.proc.stdout.close()

    def connect(self, timeout: float = 30.0) -> LineClient:
        """A raw protocol connection to this node's daemon."""
        return LineClient(self.socket, timeout)

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """One request to this node's daemon on a fresh connection; its reply."""
        with self.connect(timeout=max(60.0, float(fields.get("timeout", 0)) + 30.0)) as conn:
            return conn.request(op, **fields)

    def wait(self, root: Path, step: int, timeout: float = 30.0) -> dict[str, Any]:
        """This node's ``wait`` answer for the step."""
        return self.request("wait", root=str(root), step=step, timeout=timeout)

    def close(self) -> None:
        """End everything in the node, unmount, end bindfs."""
        if self.frozen:
            self.thaw()
        if self.daemon is not None:
            self.daemon.kill()
            self._close_daemon()
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        self.fs.close()
        subprocess.run(
            [*self.enter(), "fusermount", "-u", "-z", str(self.mount)],
            check=False,
            capture_output=True,
        )
        self.proc.terminate()
        try:  # communicate, not wait: it also closes the stderr pipe
            self.proc.communicate(timeout=10.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()


class Cluster:
    """``n`` simulated nodes over one shared directory.

    ``root`` is the checkpoint root as every node names it (under the shared mount);
    ``backing_root`` is the same directory read directly, uncached, by the test.
    """

    def __init__(self, base: Path, n: int, options: str = CACHING) -> None:
        self.base = base
        self.backing = base / "back"
        self.mount = base / "mnt"
        self.backing.mkdir()
        self.mount.mkdir()
        (self.backing / "run").mkdir()
        self.root = self.mount / "run"
        self.backing_root = self.backing / "run"
        self.nodes: list[SimNode] = []
        try:
            for i in range(n):
                node = SimNode(f"n{i}", self.backing, self.mount, base / f"n{i}", options)
                self.nodes.append(node)
        except BaseException:
            self.close()
            raise

    def __getitem__(self, index: int) -> SimNode:
        return self.nodes[index]

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[SimNode]:
        return iter(self.nodes)

    def start_daemons(self, *extra: str, **kwargs: Any) -> list[DaemonProcess]:
        """Start every node's daemon on ``root`` (same flags and settings for all)."""
        return [node.start_daemon([self.root], *extra, **kwargs) for node in self.nodes]

    def close(self) -> None:
        """End every node."""
        for node in reversed(self.nodes):
            node.close()


@contextmanager
def cluster(n: int, options: str = CACHING) -> Iterator[Cluster]:
    """``n`` simulated nodes for the block; everything is ended and removed after.

    Skips the test (fails it in CI) without bindfs, nsenter/unshare or root.
    """
    require_tool("bindfs")
    require_tool("unshare", "util-linux")
    require_tool("nsenter", "util-linux")
    require_root("mount namespaces and FUSE mounts")
    base = Path(tempfile.mkdtemp(prefix="ckn-", dir="/tmp"))
    try:
        made = Cluster(base, n, options)
        try:
            yield made
        finally:
            made.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)


@contextmanager
def clusters() -> Iterator[Callable[..., Cluster]]:
    """A factory of clusters (``make(n)``), every one ended after the block."""
    with ExitStack() as stack:
        yield lambda n, **kw: stack.enter_context(cluster(n, **kw))


@pytest.fixture
def make_cluster() -> Iterator[Callable[..., Cluster]]:
    """``make_cluster(n)``: ``n`` simulated nodes, ended after the test."""
    with clusters() as make:
        yield make

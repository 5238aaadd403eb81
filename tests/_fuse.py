"""Real FUSE mounts (bindfs) for tests of hung and caching filesystems.

``bindfs BACKING MOUNT`` serves ``BACKING`` at ``MOUNT`` through a FUSE server process.
Stopping that process with ``SIGSTOP`` makes every call on the mount block until
``SIGCONT``, as calls on a hung NFS server do; with short ``entry_timeout`` /
``attr_timeout`` options the mount caches lookups and attributes as NFS clients do.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests._system import in_ci, require_root, require_tool

__all__ = ["BindMount", "bindfs_mount", "in_mount_table", "waiting_requests"]

CACHING = "entry_timeout=1,attr_timeout=1,negative_timeout=1"
"""bindfs options that make a mount cache like an NFS client (for about a second)."""

FUSECTL = Path("/sys/fs/fuse/connections")
"""The fuse control filesystem: a directory per FUSE connection, with its counters."""


class BindMount:
    """A running ``bindfs -f`` process serving one mount."""

    def __init__(self, proc: subprocess.Popen[bytes], mount: Path) -> None:
        self.proc = proc
        self.mount = mount
        """Where the mount is; a test that renames a directory above it sets it anew
        (a mount moves with its parent), so that cleanup unmounts the right path."""
        self.stopped = False

    @property
    def pid(self) -> int:
        """The FUSE server's pid."""
        return self.proc.pid

    def stop(self) -> None:
        """Hang the filesystem: every call on the mount blocks until :meth:`cont`."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.stopped = True

    def cont(self) -> None:
        """Let the filesystem answer again."""
        os.kill(self.proc.pid, signal.SIGCONT)
        self.stopped = False


def _mounted(path: Path) -> bool:
    return in_mount_table(Path(os.path.realpath(path)))


def in_mount_table(path: Path, pid: int | str = "self") -> bool:
    """Whether ``path`` is a mount point in the mount namespace of process ``pid``."""
    target = os.fsencode(path)
    try:
        with open(f"/proc/{pid}/mountinfo", "rb") as fh:
            return any(line.split()[4] == target for line in fh if len(line.split()) > 4)
    except FileNotFoundError:  # the process has gone
        return False


@contextmanager
def bindfs_mount(backing: Path, mount: Path, options: str = "") -> Iterator[BindMount]:
    """Serve ``backing`` at ``mount`` through bindfs for the duration of the block.

    Skips the test (fails it in CI) without bindfs or root. On exit the server is
    continued if it was stopped, then the mount is removed, whatever the block did.
    """
    require_tool("bindfs")
    require_root("FUSE mounts")
    mount.mkdir(parents=True, exist_ok=True)
    cmd = ["bindfs", "-f", *(["-o", options] if options else []), str(backing), str(mount)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10.0
    # bindfs -f gives no readiness signal but the mount itself: the kernel signals every
    # change of the mount table to pollers of /proc/self/mountinfo (POLLPRI).
    with open("/proc/self/mountinfo", "rb") as table:
        poller = select.poll()
        poller.register(table, select.POLLPRI | select.POLLERR)
        while not _mounted(mount):
            left = deadline - time.monotonic()
            if proc.poll() is not None or left <= 0:
                proc.kill()
                err = proc.communicate()[1].decode(errors="replace")
                raise RuntimeError(f"bindfs did not mount {mount}: {err.strip()}")
            poller.poll(min(left, 0.5) * 1000)  # woken by the mount; bounded for an exit
    handle = BindMount(proc, mount)
    try:
        yield handle
    finally:
        if handle.stopped:
            handle.cont()
        cmd = ["fusermount", "-u", "-z", str(handle.mount)]
        subprocess.run(cmd, check=False, capture_output=True)
        proc.terminate()
        try:  # communicate, not wait: it also closes the stderr pipe
            proc.communicate(timeout=10.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def waiting_requests(mount: Path) -> Callable[[], int]:
    """A function returning how many calls on ``mount`` wait for its server right now.

    It reads the kernel's count (``/sys/fs/fuse/connections/<device>/waiting``): a call
    blocked on a stopped server is one. The fuse control filesystem is mounted there if
    it is not (systemd mounts it at boot; it is left mounted); where it cannot be, the
    test is skipped (failed in CI). Call this before stopping the server: it stats the
    mount.
    """
    device = os.stat(mount).st_dev
    waiting = FUSECTL / str((os.major(device) << 20) | os.minor(device)) / "waiting"
    if not os.path.ismount(FUSECTL):
        made = subprocess.run(
            ["mount", "-t", "fusectl", "fusectl", str(FUSECTL)], capture_output=True, text=True
        )
        if made.returncode != 0:
            reason = f"cannot mount the fuse control filesystem: {made.stderr.strip()}"
            if in_ci():
                pytest.fail(reason)
            pytest.skip(reason)
    assert waiting.exists(), f"{mount} has no connection in {FUSECTL}"
    return lambda: int(waiting.read_text())

"""A caching view of a directory in a private mount namespace, as one node mounts NFS.

``unshare -m --propagation private -- bindfs -f -o entry_timeout=1,... BACKING MOUNT``
mounts ``BACKING`` at ``MOUNT`` in a namespace of its own, caching lookups and
attributes for about a second as an NFS client does. The foreground bindfs process
holds the namespace; a process started under :attr:`NamespaceMount.enter`
(``nsenter -t <bindfs pid> -m --``) sees the mount, every other process sees the plain
directory ``MOUNT`` beneath it. Two such mounts of one directory at one path behave as
two machines' mounts of one file server: neither sees the other's writes until its
cache expires, and inotify on one misses the other's.

Needs root and bindfs (``apt-get install -y bindfs``).
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import time
from pathlib import Path

__all__ = ["CACHE_S", "CACHING", "PER_NODE_CACHING", "NamespaceMount", "available"]

CACHING = "entry_timeout=1,attr_timeout=1,negative_timeout=1"
"""bindfs options caching like an NFS client, for about a second."""
CACHE_S = 1.0
"""The cache time those options give."""
PER_NODE_CACHING = "entry_timeout=1,attr_timeout=1,negative_timeout=0"
"""The same, keeping no negative entries: many simulated nodes sharing one mount, each
looking less often than the cache time, as each would on a cache of its own."""


def available() -> str | None:
    """Why namespace mounts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (mount namespaces, FUSE)"
    for tool in ("bindfs", "unshare", "nsenter", "fusermount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


def _mounted(pid: int, mount: Path) -> bool:
    target = os.fsencode(mount)
    try:
        with open(f"/proc/{pid}/mountinfo", "rb") as fh:
            return any(len(f) > 4 and f[4] == target for f in (ln.split() for ln in fh))
    except FileNotFoundError:
        return False


class NamespaceMount:
    """``backing`` served at ``mount`` through bindfs, inside a mount namespace of its own."""

    def __init__(self, backing: Path, mount: Path, options: str = CACHING) -> None:
        self.mount = mount
        mount.mkdir(parents=True, exist_ok=True)
        cmd = ["unshare", "-m", "--propagation", "private", "--", "bindfs", "-f"]
        cmd += ["-o", options, str(backing), str(mount)]
        # unshare execs bindfs in the new namespace: this pid is bindfs's.
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10.0
        while not _mounted(self.proc.pid, mount):
            left = deadline - time.monotonic()
            if self.proc.poll() is not None or left <= 0:
                self.close()
                raise RuntimeError(f"bindfs did not mount {mount}")
            # Woken by the namespace's mount-table change (POLLPRI); the file is opened
            # anew each round, since before unshare runs it is the parent's namespace.
            with open(f"/proc/{self.proc.pid}/mountinfo", "rb") as table:
                poller = select.poll()
                poller.register(table, select.POLLPRI | select.POLLERR)
                poller.poll(min(left, 0.05) * 1000)

    @property
    def enter(self) -> list[str]:
        """The prefix that runs a command inside the namespace."""
        return ["nsenter", "-t", str(self.proc.pid), "-m", "--"]

    def close(self) -> None:
        """Unmount and end bindfs (end the processes inside first)."""
        if self.proc.poll() is None:
            subprocess.run(
                [*self.enter, "fusermount", "-u", "-z", str(self.mount)],
                check=False,
                capture_output=True,
            )
            self.proc.terminate()
        try:
            self.proc.communicate(timeout=10.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()

    def __enter__(self) -> NamespaceMount:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

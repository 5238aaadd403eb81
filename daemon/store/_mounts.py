"""Which filesystem a root lives on: local ones may be checked on the event loop.

A ``stat`` on a local filesystem returns in microseconds; on a network filesystem (NFS,
Lustre, a FUSE mount) it can hang for as long as the server is away, so there it runs in
a worker thread. The answer is taken once, when the daemon starts, from the mount table.
"""

from __future__ import annotations

import os
from typing import Final

__all__ = ["LOCAL_TYPES", "filesystem_type", "is_local", "mount_table"]

LOCAL_TYPES: Final = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "jfs", "reiserfs", "zfs", "bcachefs"}
    | {"tmpfs", "ramfs", "overlay", "vfat", "exfat", "ntfs3"}
)
"""Filesystems whose metadata calls never wait on another machine. Any other type
(``nfs``, ``lustre``, ``fuse.*``, ``cifs``, unknown) is treated as remote."""


def mount_table() -> str:
    """This process's mount table (``/proc/self/mounts``); empty if it cannot be read."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""  # then every path counts as remote


def filesystem_type(path: str, mounts: str | None = None) -> str | None:
    """The type of the filesystem ``path`` (already resolved) is on, or None if unknown.

    Args:
        path: An absolute path without symlinks (``RootConfig.real``); it need not exist.
        mounts: The mount table's text (``/proc/self/mounts`` format); read when None.
    """
    if mounts is None:
        mounts = mount_table()
    best, best_type = "", None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        # Spaces and tabs in mount points are written as octal escapes (\040, \011).
        point = fields[1].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
        inside = point == "/" or path == point or path.startswith(point.rstrip("/") + "/")
        # Later lines mount over earlier ones at the same point, hence >=.
        if inside and len(point) >= len(best):
            best, best_type = point, fields[2]
    return best_type


def is_local(path: str, mounts: str | None = None) -> bool:
    """Whether ``path`` is on a filesystem in :data:`LOCAL_TYPES`."""
    return filesystem_type(os.path.normpath(path), mounts) in LOCAL_TYPES

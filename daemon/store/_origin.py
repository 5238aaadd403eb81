"""A directory's origin: what a rename keeps and a copy never has.

A promoted checkpoint's manifest records the origin of the directory it was written in
(``tmp_step_N``, renamed to ``step_N``): its inode number and, where the filesystem
reports one, its birth time. ``rename`` keeps both; ``cp -a``, ``rsync -a`` and ``tar``
keep the manifest, the modes and the times they can set, but give the copy a new inode
born when it was made. A ``step_N`` whose origin is not its manifest's is therefore a
copy (a checkpoint restored from a backup), not a checkpoint the daemon promoted there,
and needs no journal to be told (the state directory may be new).

The inode number alone is not enough: ext4 hands a freed inode number to the next file
made, so a copy restored after its original was deleted often gets the original's
number. The birth time (``statx``'s ``STATX_BTIME``, on ext4, XFS, Btrfs, tmpfs and
others) tells them apart; where a filesystem has none it is 0 and only the inode
number is compared.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from typing import Final

import msgspec

__all__ = ["Origin", "origin"]

_AT_FDCWD: Final = -100
_AT_SYMLINK_NOFOLLOW: Final = 0x100
_STATX_INO: Final = 0x100
_STATX_BTIME: Final = 0x800
_STATX_SIZE: Final = 256
"""``struct statx`` is 256 bytes: mask at 0, inode at 32, birth time (s, ns) at 80."""

_statx = getattr(ctypes.CDLL(None, use_errno=True), "statx", None)


class Origin(msgspec.Struct, frozen=True, kw_only=True):
    """The identity of a directory that survives a rename and no copy."""

    ino: int
    """Its inode number."""
    born_ns: int = 0
    """Its birth time in nanoseconds since the epoch; 0: the filesystem reports none."""

    def same(self, other: Origin) -> bool:
        """Whether ``other`` is this directory's origin (birth times where both have one)."""
        if self.ino != other.ino:
            return False
        return not (self.born_ns and other.born_ns) or self.born_ns == other.born_ns


def origin(path: str) -> Origin:
    """The origin of ``path`` itself (a symlink is not followed). Blocking I/O.

    Raises:
        OSError: it cannot be stat'ed.
    """
    if _statx is None:  # a C library older than glibc 2.28: the inode number only
        return Origin(ino=os.lstat(path).st_ino)
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    mask = _STATX_INO | _STATX_BTIME
    if _statx(_AT_FDCWD, os.fsencode(path), _AT_SYMLINK_NOFOLLOW, mask, buf) != 0:
        err = ctypes.get_errno()
        if err != errno.ENOSYS:  # a kernel older than 4.11: the inode number only
            raise OSError(err, os.strerror(err), path)
        return Origin(ino=os.lstat(path).st_ino)
    (got,) = struct.unpack_from("=I", buf, 0)
    (ino,) = struct.unpack_from("=Q", buf, 32)
    sec, nsec = struct.unpack_from("=qI", buf, 80)
    born = sec * 1_000_000_000 + nsec if got & _STATX_BTIME else 0
    return Origin(ino=ino, born_ns=born)

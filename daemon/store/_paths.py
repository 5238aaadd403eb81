"""Confinement of request paths to the configured roots."""

from __future__ import annotations

import os
import stat

from orchestrator.protocol import ErrorCode

from ..base._errors import RequestError
from ..config._config import RootConfig

__all__ = ["check_relative", "check_tmp_dir"]


def check_relative(path: str) -> str:
    """Return ``path`` normalised if it stays inside the directory it is relative to.

    Lexical only; symlinks are resolved when the files are verified.

    Raises:
        RequestError: ``path`` is absolute, has a ``..`` component or a NUL byte.
    """
    if "\0" in path:
        raise RequestError(ErrorCode.PATH_ESCAPE, f"{path!r} contains a NUL byte")
    if os.path.isabs(path):
        raise RequestError(ErrorCode.PATH_ESCAPE, f"{path!r} must be relative to the step dir")
    if ".." in path.split("/"):
        raise RequestError(ErrorCode.PATH_ESCAPE, f"{path!r} must not contain '..'")
    normal = os.path.normpath(path)
    if normal == ".":
        raise RequestError(ErrorCode.PATH_ESCAPE, f"{path!r} names the step dir, not a file")
    return normal


def check_tmp_dir(root: RootConfig, step: int) -> None:
    """Refuse a new save whose directories are already unusable. Blocking I/O.

    Raises:
        RequestError: ``step_N`` already exists (``already_promoted``), or ``tmp_step_N``
            is a symlink (``path_escape``) or not a directory (``invalid_state``).
    """
    final = root.final_dir(step)
    if os.path.lexists(final):
        raise RequestError(ErrorCode.ALREADY_PROMOTED, f"{final} already exists")
    tmp = root.tmp_dir(step)
    try:
        mode = os.lstat(tmp).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise RequestError(
            ErrorCode.PATH_ESCAPE,
            f"{tmp} is a symlink (to {os.readlink(tmp)!r}); the daemon renames only real "
            "directories inside its roots",
        )
    if not stat.S_ISDIR(mode):
        raise RequestError(ErrorCode.INVALID_STATE, f"{tmp} exists and is not a directory")

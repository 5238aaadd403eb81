"""Naming a step's directory without the daemon, and creating it for the trainer.

The client names ``ROOT/<tmp_prefix>N`` without a round trip whenever it can, in this
order:

1. the layout of the root learned from its first acknowledged ``begin`` (the daemon's
   own word: the directory its reply named);
2. ``ROOT/.ckptd-layout.json`` (:data:`~orchestrator.protocol.LAYOUT_FILE`), which the
   daemon writes into every configured root when it starts, so a step can be named
   while the daemon is unreachable;
3. the default prefix, ``tmp_step_``.

:func:`make_step_dir` creates the directory on the calling thread, so a trainer can
write into ``SaveHandle.path`` as soon as the save call returns (NeMo-RL writes
``training_info.json`` there), daemon or no daemon. It costs one ``mkdir`` when the root
exists (``bench/client_cost.py`` measures it).
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Final

import msgspec

from . import protocol as p
from ._objstore import is_object_url

__all__ = ["DEFAULT_TMP_PREFIX", "Layouts", "make_step_dir", "read_layout", "read_layout_file"]

log = logging.getLogger("orchestrator")

DEFAULT_TMP_PREFIX: Final = "tmp_step_"
_layout_decoder: Final = msgspec.json.Decoder(p.RootInfo)


def read_layout_file(root: str) -> tuple[str, str] | None:
    """Where ``ROOT/.ckptd-layout.json`` says steps are written, if it is there and sane.

    Returns:
        The directory holding the steps being written (the root's fast tier, its
        staging directory, or the root) and the ``tmp_prefix``; None as for
        :func:`read_layout`.
    """
    info = read_layout(root)
    if info is None:
        return None
    return info.fast or info.staging or root, info.tmp_prefix


def read_layout(root: str) -> p.RootInfo | None:
    """What ``ROOT/.ckptd-layout.json`` says, if it is there and sane.

    Args:
        root: The checkpoint root.

    Returns:
        The root's layout (``staging``, ``fast``: where its steps are written when
        not in the root), or None when the file is missing, unreadable, not a
        :class:`~orchestrator.protocol.RootInfo`, names a prefix that is not a plain
        name (empty, or holding ``/`` or NUL), or a directory that is not absolute.
    """
    try:
        with open(os.path.join(root, p.LAYOUT_FILE), "rb") as fh:
            info = _layout_decoder.decode(fh.read(64 * 1024))
    except (OSError, msgspec.DecodeError):
        return None
    prefix = info.tmp_prefix
    if not prefix or "/" in prefix or "\0" in prefix or prefix in (".", ".."):
        return None
    if info.staging and not os.path.isabs(info.staging):
        return None
    if info.fast and not os.path.isabs(info.fast):
        return None
    return info


def make_step_dir(path: str) -> list[str]:
    """Create a step's directory if it does not exist yet; never raises.

    One ``mkdir`` (the daemon or DCP may create it at the same moment: that is fine);
    the root too if it is missing. A directory that cannot be created is logged: the
    save's own writes will fail and report it. An object store has no directories:
    nothing is made there.

    Returns:
        The directories this call created, deepest first (so that a save the daemon
        refuses can leave nothing behind: ``orchestrator._strict.remove_made``).
    """
    if is_object_url(path):
        return []
    try:
        os.mkdir(path)
        return [path]
    except FileExistsError:
        return []
    except FileNotFoundError:
        missing = []
        parent = path
        while parent and not os.path.isdir(parent):
            missing.append(parent)
            up = os.path.dirname(parent)
            if up == parent:
                break
            parent = up
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            log.warning("ckptd: cannot create %s: %s", path, exc)
            return []
        return missing
    except OSError as exc:
        log.warning("ckptd: cannot create %s: %s", path, exc)
        return []


class Layouts:
    """Where each root's steps go, as far as this client knows (see the module)."""

    def __init__(self) -> None:
        # Written on the I/O thread, read elsewhere with a plain (atomic) dict lookup.
        self._learned: dict[str, tuple[str, str]] = {}  # root -> (directory, tmp prefix)
        # Written by callers' threads; a race only reads the same file twice.
        self._files: dict[str, tuple[str, str]] = {}  # root -> (directory, tmp prefix)

    def learned(self, root: str, step: int) -> str | None:
        """The step's directory as the daemon named the root's, if it did yet."""
        layout = self._learned.get(root)
        return None if layout is None else os.path.join(layout[0], f"{layout[1]}{step}")

    def known(self, root: str, step: int) -> str | None:
        """The step's directory, learned or from the root's layout file; None if neither.

        Always None on an object store: there each attempt writes under its own prefix,
        which only the daemon's ``begin`` reply names.
        """
        if is_object_url(root):
            return None
        path = self.learned(root, step)
        if path is not None:
            return path
        found = self._files.get(root)
        if found is None:
            found = read_layout_file(root)
            if found is None:
                return None
            self._files[root] = found
        return os.path.join(found[0], f"{found[1]}{step}")

    @staticmethod
    def default(root: str, step: int) -> str:
        """The step's directory under the default prefix.

        On an object store, a prefix of its own that no attempt has (never promoted).
        """
        if is_object_url(root):
            return f"{root}/step_{step}/unacknowledged-{uuid.uuid4().hex[:16]}"
        return os.path.join(root, f"{DEFAULT_TMP_PREFIX}{step}")

    def learn(self, root: str, step: int, path: str) -> None:
        """Record the directory an acknowledged ``begin`` of ``step`` named."""
        directory, name = os.path.split(path)
        suffix = str(step)
        if name.endswith(suffix):  # learned once; again if the daemon's layout changed
            self._learned[root] = (directory, name[: -len(suffix)])

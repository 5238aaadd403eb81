"""Loud mistakes: a refused save raises in the trainer under ``strict``, and leaves nothing.

A daemon that refuses a ``begin`` (a root it does not serve, a step already promoted,
another run's attempt) means the save will never be promoted. Without ``strict`` the
client logs that once and training goes on, as before. With it (``strict=True`` on the
client, or ``CKPTD_STRICT=1`` in the environment for ``orchestrator.async_save`` and a
client created without the argument) the refusal raises :class:`SaveRefused` in the
trainer: at once from a call that waits for the answer, and otherwise (the answer came
after the call returned) from the client's next save call, ``wait_saves`` or ``close``.

Whatever ``strict`` says, a refused save leaves no directory behind: the directories
the client created for it (:func:`~orchestrator._layout.make_step_dir`) are removed
again if they are still empty, and a root given as a relative path is made absolute
before anything is sent (the daemon knows roots only by their absolute paths).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from ._errors import SaveRefused
from ._objstore import is_object_url
from ._tracking import SaveHandle
from .protocol import ErrorInfo

__all__ = ["STRICT_ENV", "Refusals", "absolute_root", "remove_made", "strict_from_env"]

STRICT_ENV: Final = "CKPTD_STRICT"
"""The environment variable that makes clients strict when not told otherwise."""
_TRUE: Final = frozenset({"1", "true", "yes", "on"})


def strict_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``CKPTD_STRICT`` asks for strict clients (``1``, ``true``, ``yes``, ``on``)."""
    value = (os.environ if env is None else env).get(STRICT_ENV, "")
    return value.strip().lower() in _TRUE


def absolute_root(root: str) -> str:
    """``root`` as the daemon names it: absolute and normalised (an object store's as is)."""
    if is_object_url(root):
        return root
    return os.path.abspath(root)


def remove_made(made: Sequence[str]) -> None:
    """Remove the directories a refused save's client created, deepest first.

    Only while each is empty: a file written into one meanwhile (a trainer's own, before
    the refusal arrived) keeps it and every directory above it. Never raises.
    """
    for path in made:
        try:
            os.rmdir(path)
        except OSError:
            return


class Refusals:
    """The refusals a client has yet to raise in the trainer (each is raised once).

    Args:
        strict: Whether refusals raise at all; without it nothing here does anything.
    """

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self._lock = threading.Lock()
        self._late: list[SaveHandle] = []
        self._raised: weakref.WeakSet[SaveHandle] = weakref.WeakSet()  # raised already

    def watch(self, handle: SaveHandle, when_refused: Callable[[Callable[[], None]], None]) -> None:
        """Remember ``handle``'s refusal when it arrives (``when_refused(callback)``)."""
        if self.strict:
            when_refused(lambda: self._arrived(handle))

    def _arrived(self, handle: SaveHandle) -> None:
        with self._lock:
            if handle not in self._raised:
                self._late.append(handle)

    def raise_for(self, handle: SaveHandle) -> None:
        """Under ``strict``, raise if the daemon refused ``handle``'s ``begin``.

        Waits for the answer as :attr:`SaveHandle.refusal` does (at most the client's
        ``begin_timeout``, not at all while the daemon is unreachable).

        Raises:
            SaveRefused: the ``begin`` was refused (once per save).
        """
        if not self.strict:
            return
        refusal = handle.refusal
        if refusal is None:
            return
        with self._lock:
            if handle in self._raised:
                return
            self._raised.add(handle)
            self._late = [h for h in self._late if h is not handle]
        raise refused(handle, refusal)

    def raise_late(self) -> None:
        """Under ``strict``, raise the first refusal that arrived after its call returned.

        Raises:
            SaveRefused: a save's ``begin`` was refused since the last check.
        """
        if not self._late:  # a plain read: the I/O thread only ever appends
            return
        with self._lock:
            late, self._late = self._late, []
            for h in late:
                self._raised.add(h)
        first = late[0]
        refusal = first.begun.error
        if refusal is not None:
            raise refused(first, refusal)


def refused(handle: SaveHandle, refusal: ErrorInfo) -> SaveRefused:
    """The exception for ``handle``'s refused ``begin``."""
    return SaveRefused(
        refusal.code, refusal.message, root=handle.root, step=handle.step, rank=handle.rank
    )

"""``health``: can the daemon do its job? Asked by probes, answered without a checkpoint root.

A daemon is healthy when its event loop answers (the reply comes from it) and its journal
can be written: no journal write has been running past ``fs_stall_after``, the last one
did not fail (or writing the changes it left queued works now), and the state directory
is writable and not full. That last check is a
``statvfs``, an ``access`` of the journal file and a probe write in its directory (a
filesystem the kernel made read-only after an I/O error may show neither), in a thread
of its own, at most one at a time; a check that has not returned within
:data:`PROBE_WAIT` (a hung state disk) makes the daemon unhealthy. No checkpoint root is
looked at: a slow or hung checkpoint filesystem delays only its own root's requests
(``root.stalled``), and restarting the daemon would not make it faster.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Awaitable, Sequence
from typing import Any, Final, Protocol

import anyio
import anyio.from_thread
import anyio.lowlevel

from orchestrator import protocol as p

from ..base._errors import RequestError
from ..config._config import Config
from ..store._durable import probe_write

__all__ = ["PROBE_WAIT", "HealthCheck", "state_dir_problem"]

PROBE_WAIT: Final = 2.0
"""Seconds ``health`` waits for the state-directory check."""


class _Lane(Protocol):
    def busy_for(self) -> float: ...


class _Journal(Protocol):
    @property
    def path(self) -> str: ...

    @property
    def lane(self) -> _Lane: ...


class Checked(Protocol):
    """What the check reads (``daemon.server._server.Daemon``)."""

    @property
    def config(self) -> Config: ...

    @property
    def journal(self) -> _Journal | None: ...

    @property
    def journal_error(self) -> str | None: ...

    def commit(self, effects: Sequence[Any]) -> Awaitable[None]: ...


def state_dir_problem(journal_path: str) -> str | None:
    """What stops ``journal_path`` being appended to, or None. Blocking I/O.

    Looks only at the journal file and the filesystem holding it.
    """
    try:
        st = os.statvfs(os.path.dirname(journal_path) or ".")
    except OSError as exc:
        return f"cannot stat the state directory: {exc.strerror or exc}"
    if st.f_flag & os.ST_RDONLY:
        return "the state directory's filesystem is mounted read-only"
    if st.f_bfree == 0 or (st.f_bavail == 0 and os.geteuid() != 0):
        return "the state directory's filesystem is full"
    if not os.access(journal_path, os.W_OK):
        return f"the journal {journal_path} is not writable"
    try:
        probe_write(os.path.dirname(journal_path) or ".")
    except OSError as exc:
        return f"the state directory cannot be written: {exc.strerror or exc}"
    return None


class HealthCheck:
    """Answers ``health`` for one daemon.

    Args:
        daemon: The daemon checked.
    """

    def __init__(self, daemon: Checked) -> None:
        self._daemon = daemon
        self._probe: anyio.Event | None = None  # set when the check under way returns
        self._found: str | None = None

    async def problem(self) -> str | None:
        """Why the daemon is not healthy, or None."""
        daemon = self._daemon
        journal = daemon.journal
        if journal is None:
            return None  # in-memory state: nothing to write
        blocked = journal.lane.busy_for()
        if blocked >= daemon.config.fs_stall_after:
            return f"a journal write has not returned for {blocked:.1f}s ({journal.path})"
        if daemon.journal_error is not None:
            # Changes whose write failed are still queued: write them now. Once that
            # works (space was freed), the daemon is healthy again without waiting for
            # the next request to retry them.
            try:
                await daemon.commit([])
            except RequestError:
                pass
            if daemon.journal_error is not None:
                return f"the last journal write failed: {daemon.journal_error} ({journal.path})"
        return await self._state_dir(journal.path)

    async def _state_dir(self, path: str) -> str | None:
        running = self._probe
        if running is None:
            running = self._probe = anyio.Event()
            self._start(path, running)
        with anyio.move_on_after(PROBE_WAIT):
            await running.wait()
            return self._found
        return f"checking the state directory has not returned within {PROBE_WAIT:g}s"

    def _start(self, path: str, done: anyio.Event) -> None:
        """Run :func:`state_dir_problem` in a daemon thread; report back on the event loop.

        Not a worker of anyio's pool, and never waited for: a check stuck on a hung disk
        holds this one thread, and every later ``health`` finds it still running.
        """
        token = anyio.lowlevel.current_token()

        def finish(found: str | None) -> None:
            self._found = found
            self._probe = None
            done.set()

        def work() -> None:
            found = state_dir_problem(path)
            try:
                anyio.from_thread.run_sync(finish, found, token=token)
            except RuntimeError:
                pass  # the event loop is gone

        threading.Thread(target=work, name="ckptd-health", daemon=True).start()

    async def reply(self, request_id: int, version: str) -> p.HealthReply:
        """The reply to ``health``."""
        problem = await self.problem()
        return p.HealthReply(
            id=request_id, version=version, healthy=problem is None, problem=problem
        )

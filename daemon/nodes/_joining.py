"""Agreeing on the attempt: which attempt a spanning save's first ``begin`` on a node joins.

A mixin of :class:`daemon.nodes._coordinator.Nodes`: only the leader (the daemon serving
rank 0) prepares ``tmp_step_N``; every other node's first ``begin`` waits for the
leader's attempt marker there, of this run, and joins that attempt.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio

from orchestrator import protocol as p

from ..base._errors import RequestError
from ..config._config import RootConfig
from ..host._host import Coordinating
from ..ledger._saves import SaveKey, SaveRecord
from ..store._storage import Storage

__all__ = ["Joining"]


class Joining:
    """The attempt a node's ranks join (a mixin of ``Nodes``)."""

    _daemon: Coordinating
    _begun: dict[SaveKey, anyio.Event]
    _run: Callable[..., Awaitable[object]]

    if TYPE_CHECKING:  # what Nodes provides (no stubs at runtime: no MRO shadowing)

        async def _learn(
            self, root: RootConfig, save: SaveRecord, *, full: bool = True
        ) -> bool: ...

    @property
    def _storage(self) -> Storage:
        return self._daemon.storage

    async def outlived(self, root: RootConfig, save: SaveRecord) -> None:
        """A ``begin`` of a later run on a node that does not lead ``save``: wait for the leader.

        The leader decides that ``save``'s attempt (of the dead run) is superseded: it
        writes the failure's verdict and sets the directory aside. This node learns it
        from the shared directory (the verdict, or another attempt's marker in
        ``tmp_step_N``), and returns once its own record of the attempt has ended.

        Raises:
            RequestError: (``unavailable``) nothing said so within ``node_timeout``.
        """
        daemon, key, attempt = self._daemon, save.key, save.attempt
        deadline = daemon.clock() + daemon.config.node_timeout
        while (now := daemon.ledger.get(key)) is not None and now.attempt == attempt:
            if now.state is not p.SaveState.OPEN or await self._learn(root, now):
                return
            left = deadline - daemon.clock()
            if left <= 0:
                raise RequestError(
                    p.ErrorCode.UNAVAILABLE,
                    f"step {key.step} spans nodes, and attempt {attempt} of run "
                    f"{save.run or '(unnamed)'} is still open here: the leader (the daemon "
                    f"serving rank 0) did not set it aside within node_timeout "
                    f"{daemon.config.node_timeout:g}s; retry",
                )
            event = self._begun.setdefault(key, anyio.Event())
            with anyio.move_on_after(min(root.poll_interval, left)):
                await event.wait()

    def begun(self, key: SaveKey) -> None:
        """A ``begin`` created or joined ``key`` here: wake the begins waiting for it."""
        event = self._begun.pop(key, None)
        if event is not None:
            event.set()

    async def attempt_for(
        self, root: RootConfig, key: SaveKey, world_size: int, run: str | None = None
    ) -> str | None:
        """The attempt a spanning save's first ``begin`` on this node joins.

        Waits until the leader's attempt marker is in ``tmp_step_N`` (its attempt is
        returned) or a ``begin`` on this node created the save meanwhile (None). A marker
        of an attempt known to have ended is no one's to join, and neither is one of
        another run than ``run`` (when the begin names one): that directory is a stale
        run's, which the leader sets aside before it marks its own.

        Raises:
            RequestError: (``unavailable``) no attempt marker within ``node_timeout``.
        """
        daemon = self._daemon
        deadline = daemon.clock() + daemon.config.node_timeout
        tmp = root.tmp_dir(key.step)
        while True:
            save = daemon.ledger.get(key)
            if save is not None and save.state is p.SaveState.OPEN:
                return None
            marker = await self._run(root, self._storage.read_attempt, tmp)
            if (
                isinstance(marker, p.AttemptMarker)
                and marker.world_size == world_size
                and (not run or marker.run == run)
            ):
                ended = save is not None and save.attempt == marker.attempt
                if not ended:
                    verdict = await self._run(
                        root, self._storage.read_verdict, root, key.step, marker.attempt
                    )
                    if verdict is None:
                        return marker.attempt
            left = deadline - daemon.clock()
            if left <= 0:
                stale = ""
                if isinstance(marker, p.AttemptMarker) and run and marker.run != run:
                    stale = f" (the marker there is run {marker.run or '(unnamed)'}'s, not {run}'s)"
                raise RequestError(
                    p.ErrorCode.UNAVAILABLE,
                    f"step {key.step} spans nodes, and the leader (the daemon serving rank 0) "
                    f"wrote no attempt marker of this run into {tmp} within node_timeout "
                    f"{daemon.config.node_timeout:g}s{stale}; retry",
                )
            event = self._begun.setdefault(key, anyio.Event())
            with anyio.move_on_after(min(root.poll_interval, left)):
                await event.wait()

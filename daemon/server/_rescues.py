"""``ckptd promote``, and recovery's promotion of orphans whose ranks' word is on the root.

Both promote a ``tmp_step_N`` the ledger may not know, from what the root holds: the
attempt its marker names, the files its node markers report (every rank's, for a step
that spans nodes or one a daemon that lost its journal left), else a complete DCP
checkpoint (an operator's word, for ``ckptd promote`` only).
"""

from __future__ import annotations

import posixpath
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, cast

import anyio

from orchestrator import protocol as p

from ..base._errors import RequestError, VerificationError
from ..base._events import Events
from ..config._config import RootConfig
from ..host._host import Host
from ..ledger._ledger import Effect, Ledger, SaveKey
from ..nodes._rescue import rescue_markers
from ..store._lanes import Lanes
from ..store._storage import Storage

__all__ = ["Rescues"]


class Rescues:
    """Promotions on an operator's word or the root's (a mixin of ``Daemon``)."""

    ledger: Ledger
    events: Events
    lanes: Lanes
    storage: Storage
    root_locks: dict[str, anyio.Lock]
    clock: Callable[[], float]

    if TYPE_CHECKING:  # what the daemon provides (no stubs at runtime: no MRO shadowing)

        def commit(self, effects: Sequence[Effect]) -> Awaitable[None]: ...

        async def settled(self, request: p.Wait, root: RootConfig) -> p.WaitReply: ...

    async def _rescue(
        self, request_id: int, root: RootConfig, step: int, *, wait_s: float
    ) -> p.WaitReply:
        """``ckptd promote``: verify what can be verified, then promote, or refuse."""
        key = SaveKey(root.path, step)
        save = self.ledger.get(key)
        if save is not None and save.state is p.SaveState.PROMOTED:
            raise RequestError(p.ErrorCode.ALREADY_PROMOTED, f"step {step} is already promoted")
        reported = {} if save is None else save.reported_files()
        world_size = 0 if save is None else save.world_size
        async with self.root_locks[root.path]:
            # A failed attempt's set-aside files are judged, and promoted, where they lie
            # in the trash: they never return to tmp_step_N, where a new attempt writes.
            source = None
            if save is not None and save.state is p.SaveState.FAILED and save.set_aside:
                kept = self.storage.directory
                if await self.lanes.run(root.path, kept, save.set_aside, abandon=True):
                    source = save.set_aside
            tmp = source or root.tmp_dir(step)
            marker = await self.lanes.run(root.path, self.storage.read_attempt, tmp, abandon=True)
            attempt = save.attempt if save is not None else ""
            if save is None and marker is not None:
                attempt = marker.attempt  # a step no journal knows: its directory says whose
            # A step that spans nodes is promoted from its node markers, if they cover it.
            nodes = await rescue_markers(cast(Host, self), root, step, attempt, save, tmp)
            if nodes is not None:
                world_size = nodes.world_size
                reported = {**reported, **nodes.files()}
            try:
                manifest = await self.lanes.run(
                    root.path,
                    self.storage.scan_save,
                    root,
                    step,
                    world_size,
                    reported,
                    attempt,
                    source,
                    abandon=True,
                )
            except VerificationError as exc:
                raise RequestError(p.ErrorCode.UNVERIFIABLE, str(exc)) from None
        # Node markers vouch for every rank; else only a global .metadata does (DCP
        # writes it once every rank's shards landed). Per-rank __R.metadata cannot: a
        # rank that wrote nothing leaves no trace of itself.
        proven = any(
            posixpath.normpath(f"{d}/.metadata") in manifest.files for d in manifest.dcp_dirs
        )
        if not proven and nodes is None:
            raise RequestError(
                p.ErrorCode.UNVERIFIABLE,
                f"{tmp} holds no DCP directory (*.distcp with .metadata): "
                "nothing on disk proves the step complete",
            )
        spanning = 0 if nodes is None else nodes.world_size
        effects = self.ledger.rescue(key, self.clock(), attempt=attempt, world_size=spanning)
        if nodes is not None:
            for m in nodes.markers:
                files = m.ranks()
                self.ledger.remote_done(key, m.node, attempt, len(files), files, self.clock())
        await self.commit(effects)
        wait = p.Wait(id=request_id, root=root.path, step=step, timeout=wait_s)
        return await self.settled(wait, root)

    async def finish_orphan(self, root: RootConfig, step: int) -> None:
        """Promote ``tmp_step_N``, which no journal knows, from its node markers.

        For recovery, once :func:`daemon.nodes._rescue.done_on_root` says every rank's
        word is on the root: a daemon that lost its state directory finishes the step
        as one with its journal would (DESIGN invariant 10), through the same checks as
        ``ckptd promote``. A step they cannot verify stays an orphan, and says why.
        """
        self.events.emit("save.adopted", root=root.path, step=step, path=root.tmp_dir(step))
        try:
            await self._rescue(0, root, step, wait_s=0)
        except RequestError as exc:
            self.events.emit(
                "save.unverifiable", "warning", root=root.path, step=step, reason=str(exc)
            )

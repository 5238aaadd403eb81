"""A ``begin`` of a later run of the same launch takes the step from the dead run at once.

torchelastic restarts a job's workers only after stopping all of them, and Slurm
requeues a job only once it ended: a ``begin`` whose run is the same launch with more
restarts (``orchestrator.protocol.run_supersedes``) proves every rank of the earlier
run dead. Their open attempt of the step would only fail once their leases ran out, and
the restarted job's save of the step would be refused (``run_conflict``) until then. So
before such a ``begin`` is decided, the dead attempt fails, "superseded by run ...", and
is set aside, as every failed attempt is; the ``begin`` then starts the step over.

Who decides is who always decides (docs/multinode.md): on one node its daemon; for a
step that spans nodes the leader (the daemon serving global rank 0), which writes the
failure's verdict and sets the directory aside. Every other node's ``begin`` waits until
it learns that from the shared directory (the verdict, or another attempt's marker in
``tmp_step_N``), then joins the leader's new attempt. What decides is on the root and in
the ``begin`` (each attempt's marker records its run), so a daemon on an empty state
directory decides the same: its ``begin`` starts a new attempt, which sets the other
run's directory aside (``daemon/store/_attempts.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from ..config._config import RootConfig
from ..ledger._ledger import Effect, Ledger, SaveKey
from ..nodes._coordinator import Nodes
from ._owners import AttemptDirs

__all__ = ["Superseding"]


class Superseding:
    """Superseding a dead run's open attempt (a mixin of ``Daemon``'s request handling)."""

    ledger: Ledger
    nodes: Nodes
    attempt_dirs: AttemptDirs
    clock: Callable[[], float]

    if TYPE_CHECKING:  # what the daemon provides (no stubs at runtime: no MRO shadowing)

        def commit(self, effects: Sequence[Effect]) -> Awaitable[None]: ...

        def settling(self, key: SaveKey) -> bool: ...

        async def _wait_for(self, key: SaveKey) -> None: ...

    async def _supersede(self, root: RootConfig, key: SaveKey, run: str | None) -> None:
        """Before a ``begin`` of ``run`` is decided: end the attempt it proves dead, if any.

        Returns once the dead attempt's failure is durable and its directory set aside
        (its verdict written, for a step that spans nodes), or, on a node that does not
        lead the step, once this node learned that from the leader; the ``begin`` then
        starts the step over. Returns at once when no open attempt is superseded.

        Raises:
            RequestError: the failure could not be journaled (``unavailable``), or a
                node that does not lead the step did not learn the leader's verdict
                within ``node_timeout`` (``unavailable``).
        """
        dead = self.ledger.superseded_by(key, run)
        if dead is None or run is None:
            return
        if not self.ledger.may_supersede(key):
            await self.nodes.outlived(root, dead)
            return
        await self.commit(self.ledger.supersede(key, run, self.clock()))
        # The new attempt's directory is prepared only once the dead one's is out of
        # the way and its failure written where the other nodes look.
        while self.settling(key) or self.attempt_dirs.reporting(key) or self.nodes.reporting(key):
            await self._wait_for(key)

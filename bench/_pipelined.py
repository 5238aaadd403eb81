"""A bench-only prototype of the recommended client change: ``begin`` not awaited.

The production :meth:`orchestrator.CheckpointClient.begin` blocks the training thread
until the daemon has journaled the ``begin`` (a write and an ``fsync``). This subclass
sends the same ``begin`` and returns at once with the path the daemon would have
answered (the default ``tmp_step_N`` layout). Ordering is unchanged: the connection is a
single ordered stream, so the daemon still sees every ``begin`` before its ``done``, and
a step is still promoted only once every rank has begun and is done. The benchmarks run
it side by side with the real client to show what the change would buy; nothing in
``daemon/`` or ``orchestrator/`` uses it.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from typing import Any

from orchestrator import Begun, CheckpointClient
from orchestrator import protocol as p

__all__ = ["PipelinedClient"]

log = logging.getLogger("orchestrator")


def _log_refusal(future: Future[dict[str, Any]]) -> None:
    if future.cancelled() or future.exception() is not None:
        return
    reply = future.result()
    if not reply.get("ok"):
        log.warning("ckptd refused a begin; that step will not be promoted: %s", reply)


class PipelinedClient(CheckpointClient):
    """:class:`CheckpointClient` whose ``begin`` is sent, not awaited (prototype)."""

    def begin(self, root: str, step: int, rank: int, world_size: int) -> Begun:
        """Send ``begin`` and return at once; a refusal is logged when it arrives."""
        with self._lock:
            self._saves.setdefault((root, step, rank), world_size)
        future = self._submit(p.Begin(id=0, root=root, step=step, rank=rank, world_size=world_size))
        future.add_done_callback(_log_refusal)
        return Begun(path=os.path.join(root, f"tmp_step_{step}"), acknowledged=True)

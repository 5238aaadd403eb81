"""What the driver's ``CheckpointManager`` asks the daemon, for one checkpoint root.

The driver is not a rank: its workers begin and report each step. The driver asks the
daemon whether a step is free to begin, waits for a step's verdict, reads the ``latest``
and ``best`` pointers and the root's retention verdicts, and asks for a retention pass.
Every call is a blocking query on the client's connection, made from the driver's
finalization thread or from the calls NeMo-RL already blocks in (``finalize_pending``,
``get_*_checkpoint_path``), never from a rank's save.
"""

from __future__ import annotations

import logging
import os
from typing import Final

from .. import protocol as p
from .._client import CheckpointClient
from .._errors import DaemonError
from ..protocol import default_socket_path

__all__ = ["DaemonRoot", "StepFailed", "probe"]

logger = logging.getLogger("orchestrator.nemo_rl")

_WAIT_CHUNK: Final = 300.0
"""Seconds of one ``wait`` request; a verdict is waited for over as many as it takes."""
_PROBE_TIMEOUT: Final = 2.0


class StepFailed(RuntimeError):
    """The daemon failed a step: it is never promoted (the message says why)."""


def probe(client: CheckpointClient | None) -> CheckpointClient | None:
    """A client connected to a daemon that answers now, or None."""
    if client is not None:
        return client if client.ping(_PROBE_TIMEOUT) else None
    path = default_socket_path()
    if not os.path.exists(path):
        return None
    client = CheckpointClient(path)
    if client.ping(_PROBE_TIMEOUT):
        return client
    client.close(timeout=0)
    return None


class DaemonRoot:
    """One root's queries.

    Args:
        client: A client whose daemon serves ``root``.
        root: The checkpoint root, absolute.
    """

    def __init__(self, client: CheckpointClient, root: str) -> None:
        self.client = client
        self.root = root

    def known(self, step: int) -> p.WaitReply:
        """The step's state now (``pending`` without an attempt: no rank began it)."""
        return self.client.wait(self.root, step, 0.0)

    def settle(self, step: int) -> p.WaitReply:
        """Wait for ``step``'s verdict (promoted or failed), however long it takes.

        While the daemon is unreachable the wait is retried (the workers' clients
        re-send their reports when it is back), with one warning.
        """
        warned = False
        while True:
            try:
                reply = self.client.wait(self.root, step, _WAIT_CHUNK)
            except DaemonError as exc:
                if exc.code not in ("unreachable", "timeout"):
                    raise
                if not warned:
                    warned = True
                    logger.warning(
                        "ckptd: no answer from %s while waiting for step %s of %s: %s; "
                        "waiting until the daemon is back",
                        self.client.socket_path,
                        step,
                        self.root,
                        exc,
                    )
                continue
            if reply.state != "pending":
                return reply

    def verdict(self, step: int) -> None:
        """Wait for ``step``'s verdict; return once it is promoted.

        Raises:
            StepFailed: the daemon failed it.
        """
        reply = self.settle(step)
        if reply.state == "failed":
            raise StepFailed(f"ckptd failed step {step} of {self.root}: {reply.reason}")

    def latest(self) -> int | None:
        """The step ``latest`` names, or None when there is none."""
        try:
            reply = self.client.call(p.Latest(id=0, root=self.root))
        except DaemonError as exc:
            if exc.code == "not_found":
                return None
            raise
        step = reply.get("step")
        return step if isinstance(step, int) else None

    def restore(self, run: str, timeout: float = 60.0) -> p.RestoreReply:
        """The step the daemons decided run ``run`` resumes from, and where (a fast tier).

        Asked as the job's driver (``driver``): rank 0 of a world of 1, the step's own
        world size counting.
        """
        import msgspec

        request = p.Restore(
            id=0, root=self.root, rank=0, world_size=1, run=run, timeout=timeout, driver=True
        )
        return msgspec.convert(self.client.call(request, timeout + 10.0), p.RestoreReply)

    def retention(self, *, apply: bool) -> p.RetentionReply:
        """The root's retention verdicts (and, with ``apply``, a pass run now)."""
        import msgspec

        reply = self.client.call(p.Retention(id=0, root=self.root, apply=apply), 60.0)
        return msgspec.convert(reply, p.RetentionReply)

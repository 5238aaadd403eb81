"""The daemon's operations as methods: one per op, over the client's channel.

Calls from the training thread only queue a message for the client's I/O thread
(``_channel.py``): ``done`` and ``fail`` cost microseconds. An awaited ``begin`` waits
for the daemon at most ``begin_timeout`` seconds (not at all while the daemon is known to
be down), and :class:`PendingBegin` lets another thread (DCP's upload) do that waiting
instead of the training thread. The queries (``call`` and those built on it) block, for
tools and tests. :class:`~orchestrator.CheckpointClient` (``_client.py``) adds the saves'
handles on top of these.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from . import _nodes
from . import protocol as p
from ._channel import Channel
from ._errors import DaemonError, SaveRefused
from ._layout import Layouts, make_step_dir
from ._pending import Begun, PendingBegin
from ._run import run_identity
from ._strict import Refusals, absolute_root, strict_from_env
from ._tracking import SaveHandle
from ._wire import SaveRecord
from .protocol import default_socket_path

log = logging.getLogger("orchestrator")

__all__ = ["OpsClient"]


class OpsClient:
    """The connection to the daemon and one method per op, under :class:`CheckpointClient`.

    Thread-safe. The saves' handles, and waiting for them and closing, are the client's.

    Args:
        socket_path: The daemon's socket; default :func:`default_socket_path`.
        begin_timeout: Longest wait for a ``begin`` acknowledgement, in seconds.
        reconnect_max: Longest pause between reconnection attempts, in seconds.
        max_reply: Longest reply line accepted, in bytes.
        run: The run of the job (see :class:`CheckpointClient`).
        strict: Raise refusals in the trainer (see :class:`CheckpointClient`); None:
            ``CKPTD_STRICT`` decides.
    """

    def __init__(
        self,
        socket_path: str | None = None,
        *,
        begin_timeout: float = 2.0,
        reconnect_max: float = 2.0,
        max_reply: int = p.MAX_REPLY,
        run: str | None = None,
        strict: bool | None = None,
    ) -> None:
        self.strict = strict_from_env() if strict is None else strict
        """Whether a refused ``begin`` raises :class:`SaveRefused` (``orchestrator._strict``)."""
        self._refusals = Refusals(self.strict)
        self.run = run_identity(run)
        """The run every ``begin`` names (``orchestrator._run``); None: unnamed."""
        self._unnamed_warned = False
        self.socket_path = socket_path or default_socket_path()
        self.begin_timeout = begin_timeout
        self._layouts = Layouts()
        self._node_env = _nodes.read_environment()
        self._channel = Channel(
            self.socket_path, self._layouts, reconnect_max=reconnect_max, max_reply=max_reply
        )

    # -- training-thread API -----------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether the client currently holds a connection to the daemon."""
        return self._channel.connected.is_set()

    def begin(
        self,
        root: str,
        step: int,
        rank: int,
        world_size: int,
        *,
        local_world_size: int | None = None,
    ) -> Begun:
        """Tell the daemon this rank is about to write ``step`` under ``root``, and wait.

        Waits for the acknowledgement up to ``begin_timeout`` (not at all while the
        daemon is unreachable). Whatever happens, the begin is remembered and re-sent
        after a reconnect. Unless the daemon refused, the step's directory exists when
        this returns. ``local_world_size`` is as for :meth:`begin_nowait`.

        Returns:
            Where to write, whether the daemon acknowledged, and the attempt joined.

        Raises:
            ValueError: ``local_world_size``, or the environment it is read from, does
                not fit ``world_size`` (nothing is sent).
            SaveRefused: the daemon refused, and the client is ``strict``.
        """
        root = absolute_root(root)
        begun = self.begin_nowait(
            root, step, rank, world_size, local_world_size=local_world_size
        ).result()
        if begun.error is None:
            make_step_dir(begun.path)
        elif self.strict:
            error = begun.error
            raise SaveRefused(error.code, error.message, root=root, step=step, rank=rank)
        return begun

    def begin_nowait(
        self,
        root: str,
        step: int,
        rank: int,
        world_size: int,
        *,
        local_world_size: int | None = None,
    ) -> PendingBegin:
        """Send ``begin`` and return at once; :meth:`PendingBegin.result` waits for it.

        The connection is one ordered stream, so the daemon sees this ``begin`` before
        any later ``done`` of the same step whether or not anyone waits for it. The
        directory is not created here (:meth:`save` and :meth:`begin` do).

        Args:
            root: The checkpoint root.
            step: The step.
            rank: This rank.
            world_size: Number of ranks writing the step, over all nodes.
            local_world_size: How many of them write on this node. Default: torchrun's
                ``LOCAL_WORLD_SIZE``, else Slurm's ``SLURM_NTASKS_PER_NODE`` (or an
                unambiguous ``SLURM_TASKS_PER_NODE``), as they were when the client was
                created; else unsaid: ``world_size``, one node. An explicit value wins
                over the environment. Every re-sent ``begin`` of the save carries the
                same value.

        Raises:
            ValueError: ``local_world_size`` is not an ``int`` from 1 to
                ``world_size``, or the environment names a count that does not fit
                (the message names the variable). Nothing is sent.
        """
        root = absolute_root(root)
        local = self.resolve_local_world_size(world_size, local_world_size)
        if self.run is None and local is not None and local < world_size:
            self._warn_unnamed()
        record = SaveRecord(root, step, rank, world_size, local, run=self.run)
        future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        begin = p.Begin(
            id=0,
            root=root,
            step=step,
            rank=rank,
            world_size=world_size,
            local_world_size=local,
            run=self.run,
        )
        self._channel.post(begin, future, record)
        known = self._layouts.known(root, step)
        fallback = self._layouts.default(root, step)
        return PendingBegin(self._channel, record, future, known, fallback, self.begin_timeout)

    def raise_if_refused(self, handle: SaveHandle) -> None:
        """Under ``strict``, raise if the daemon refused ``handle``'s ``begin``.

        Waits for the answer at most ``begin_timeout`` (not at all while the daemon is
        unreachable); a refusal arriving later is raised by the next save call or
        ``close``. Without ``strict``, returns at once. Each refusal is raised once.

        Raises:
            SaveRefused: the ``begin`` was refused, naming the code, root, step and fix.
        """
        self._refusals.raise_for(handle)

    def _warn_unnamed(self) -> None:
        if not self._unnamed_warned:
            self._unnamed_warned = True
            log.warning(
                "ckptd: this job's run is unnamed (no run=, TORCHELASTIC_RUN_ID or "
                "SLURM_JOB_ID): a step spanning nodes that a requeued run saves again on "
                "daemons that lost their state may be joined to this run's attempt"
            )

    def resolve_local_world_size(
        self, world_size: int, local_world_size: int | None = None
    ) -> int | None:
        """What this client's ``begin`` says of this node's ranks, for ``world_size``.

        ``local_world_size`` if given, else what the environment said when the client
        was created (see :meth:`begin_nowait`), else None (one node).

        Raises:
            ValueError: the value does not fit ``world_size``, naming the argument or
                the variable it came from.
        """
        return _nodes.local_world_size(world_size, local_world_size, self._node_env)

    def step_path(self, root: str, step: int) -> str | None:
        """Where ``step`` of ``root`` is written, if this client can name it without asking.

        From the root's first acknowledged ``begin``, else from the root's layout file
        (:data:`~orchestrator.protocol.LAYOUT_FILE`, written by the daemon); None before
        either is known.
        """
        return self._layouts.known(absolute_root(root), step)

    def done(
        self,
        root: str,
        step: int,
        rank: int,
        files: Iterable[p.FileEntry] = (),
        *,
        metrics: Mapping[str, float] | None = None,
    ) -> None:
        """Report that this rank's writes for ``step`` have all landed. Never blocks.

        Sent once the rank's ``begin`` of the step is answered, naming its attempt;
        not at all if that ``begin`` was refused. ``metrics`` (name to number) go
        with it: the step's once it is promoted, for the root's retention policy.
        """
        done = p.Done(
            id=0,
            root=absolute_root(root),
            step=step,
            rank=rank,
            files=list(files),
            metrics=dict(metrics) if metrics else None,
        )
        self._channel.post(done)

    def fail(self, root: str, step: int, rank: int, reason: str) -> None:
        """Report that this rank's save of ``step`` failed. Never blocks.

        Sent as :meth:`done` is: after the ``begin`` is answered, never for a refused one.
        """
        self._channel.post(
            p.Fail(id=0, root=absolute_root(root), step=step, rank=rank, reason=reason[:4000])
        )

    # -- blocking queries (tools and tests; not for the training loop) -------------------

    def call(self, request: p.Request, timeout: float = 10.0) -> dict[str, Any]:
        """Send one request and wait for its reply.

        Returns:
            The reply object.

        Raises:
            DaemonError: the daemon refused, did not answer within ``timeout``, or
                answered with a line longer than ``max_reply`` (``reply_too_long``).
        """
        future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        self._channel.post(request, future)
        try:
            reply = future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            code = "timeout" if self.connected else "unreachable"
            raise DaemonError(code, f"no reply from {self.socket_path} within {timeout}s") from None
        if not reply.get("ok"):
            error = reply.get("error") or {}
            raise DaemonError(str(error.get("code")), str(error.get("message")))
        return reply

    def score(
        self, root: str, step: int, metrics: Mapping[str, float], timeout: float = 10.0
    ) -> None:
        """Record metrics of promoted ``step`` (an evaluation job scoring it). Blocks.

        Raises:
            DaemonError: refused (``not_found``: no such promoted step; ``invalid_field``)
                or no answer within ``timeout``.
        """
        self.call(
            p.Score(id=0, root=absolute_root(root), step=step, metrics=dict(metrics)), timeout
        )

    def pin(self, root: str, step: int, *, pinned: bool = True, timeout: float = 10.0) -> None:
        """Pin ``step`` (never retired until unpinned), or unpin it. Blocks.

        Raises:
            DaemonError: refused (``not_found``) or no answer within ``timeout``.
        """
        request = p.Pin if pinned else p.Unpin
        self.call(request(id=0, root=absolute_root(root), step=step), timeout)

    def hold(self, root: str, step: int, ttl: float, timeout: float = 10.0) -> None:
        """Keep promoted ``step`` for ``ttl`` seconds from now, whatever the policy. Blocks.

        For a reader such as an evaluation job: hold the checkpoint before reading it,
        renew the hold while reading takes longer, release it (``ttl=0``) when done.
        A hold survives a restart of the daemon.

        Raises:
            DaemonError: refused (``not_found``: not a promoted step; ``invalid_state``:
                being retired right now) or no answer within ``timeout``.
        """
        self.call(p.Hold(id=0, root=absolute_root(root), step=step, ttl=ttl), timeout)

    def wait(self, root: str, step: int, timeout: float) -> p.WaitReply:
        """Block until ``step`` is promoted or failed, or ``timeout`` passes.

        Raises:
            DaemonError: the daemon refused, or could not be reached.
        """
        reply = self.call(
            p.Wait(id=0, root=absolute_root(root), step=step, timeout=timeout), timeout + 10.0
        )
        return msgspec.convert(reply, p.WaitReply)

    def restore(
        self,
        root: str,
        rank: int,
        world_size: int,
        *,
        local_world_size: int | None = None,
        timeout: float = 60.0,
    ) -> p.RestoreReply:
        """Ask which step this rank of a restarting job loads, and from which tier. Blocks.

        Every rank of the run gets the same step (docs/tiers.md).

        Raises:
            DaemonError: the daemon refused, or could not be reached.
        """
        local = self.resolve_local_world_size(world_size, local_world_size)
        request = p.Restore(
            id=0, root=absolute_root(root), rank=rank, world_size=world_size,
            local_world_size=local, run=self.run, timeout=timeout,
        )  # fmt: skip
        return msgspec.convert(self.call(request, timeout + 10.0), p.RestoreReply)

    def ping(self, timeout: float = 2.0) -> bool:
        """Whether the daemon answers within ``timeout`` seconds."""
        try:
            self.call(p.Ping(id=0), timeout)
        except DaemonError:
            return False
        return True

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until the daemon acknowledged every ``begin``/``done``/``fail`` sent so far.

        For shutdown paths and tests; the training loop never needs it.

        Returns:
            Whether everything was acknowledged within ``timeout`` seconds.
        """
        barrier: concurrent.futures.Future[None] = concurrent.futures.Future()
        if not self._channel.barrier(barrier):
            return False
        try:
            barrier.result(timeout)
        except concurrent.futures.TimeoutError:
            barrier.cancel()
            return False
        return True

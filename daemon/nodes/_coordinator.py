"""The I/O side of saves that span nodes: attempts agreed, markers written and read.

:class:`Nodes` carries out, for one daemon, what :mod:`daemon.ledger._spanning` decides:

- a node that has not seen global rank 0 takes the attempt the leader wrote into
  ``tmp_step_N`` (:meth:`Nodes.attempt_for`), so every node's ranks join one attempt;
- once this node's ranks are done it checks their files and writes its marker
  (:class:`~daemon.ledger._saves.MarkNode`);
- the leader then watches the shared directory for the other nodes' markers, every
  other node for the outcome (:class:`~daemon.ledger._saves.Watch`): with watchfiles on a local
  filesystem, by polling on a shared one, where inotify cannot see other machines'
  writes;
- a failure is written where the other nodes look (:class:`~daemon.ledger._saves.NodeFailed`)
  before it is reported here.

Every blocking call runs in the root's lane, so a hung mount delays only its root.
"""

from __future__ import annotations

import errno
import math
from collections.abc import Awaitable, Callable, Collection, Coroutine
from contextlib import AbstractAsyncContextManager
from functools import partial
from typing import Any, Final

import anyio
from anyio.abc import TaskGroup

from orchestrator import protocol as p

from ..base._errors import RequestError
from ..base._faults import crash_point
from ..config._config import RootConfig
from ..host._holds import Holds
from ..host._host import Coordinating
from ..ledger._saves import Effect, MarkNode, NodeFailed, SaveKey, SaveRecord, Watch
from ..store import _markers
from ..store._markers import Seen, marker_for
from ._joining import Joining
from ._waker import Waker, stretched, watching

__all__ = ["FULL_EVERY", "RENAMED_TRUST", "Nodes"]

RENAMED_TRUST: Final = 30.0
"""Seconds a renamed ``step_N`` of our attempt must stand before it is believed promoted
without the leader's verdict (the leader fsyncs the root within milliseconds)."""

FULL_EVERY: Final = 50.0
"""A waiting node's full look comes at most every ``FULL_EVERY * nodes / poll_budget``
seconds: it costs about five lookups to the verdict's one, so a tenth of the budget."""


class Nodes(Joining):
    """Coordination of spanning saves through the shared filesystem, for one daemon.

    Args:
        daemon: Whose ledger, config, lanes and events to use.
        run: Runs a blocking call for a root in its lane (``await run(root, fn, *args)``).
        local_roots: Roots on a local filesystem (watched with inotify under ``auto``).
    """

    def __init__(
        self,
        daemon: Coordinating,
        *,
        run: Callable[..., Awaitable[object]],
        local_roots: Collection[str],
    ) -> None:
        self._daemon = daemon
        self._run = run
        self._local = set(local_roots)
        self.group: TaskGroup | None = None
        """Where markers are written and watched; set by ``serve``."""
        self._watching: set[SaveKey] = set()
        self._begun: dict[SaveKey, anyio.Event] = {}  # begins waiting for an attempt
        self._locks: dict[SaveKey, anyio.Lock] = {}
        self._done_written: set[tuple[SaveKey, str]] = set()
        self._pending: Holds[SaveKey] = Holds()
        self.promote: Callable[[SaveKey], None] | None = None
        """Starts a promotion again (a leader whose rival claim went away)."""
        self._watches: Holds[anyio.CancelScope] = Holds()
        """Each background task's scope, from when it is spawned until it ends."""
        self._wakers: dict[SaveKey, Waker] = {}
        self._renamed: dict[SaveKey, float] = {}  # when step_N was first seen unconfirmed
        self._closed = False

    @property
    def node(self) -> str:
        """This node's name."""
        return self._daemon.config.node

    def reporting(self, key: SaveKey) -> bool:
        """Whether ``key``'s failure is still being written out, so not yet reported."""
        return key in self._pending

    def watch(self, save: SaveRecord) -> None:
        """Watch the shared directory for ``save`` from the moment this node joins it.

        The leader takes other nodes' markers (a failure fails the step while its own
        ranks still write); every other node watches for the outcome, so a node whose
        ranks hang still learns the leader's verdict.
        """
        if save.spans and save.state is p.SaveState.OPEN:
            self.start(Watch(save.key))

    def announce(self, root: RootConfig, save: SaveRecord) -> None:
        """Say in the shared directory that this node writes ``save`` (best effort)."""
        token = (save.key, save.attempt)
        if self.group is None or token in self._done_written:
            return
        self._done_written.add(token)  # once per attempt; the done marker replaces it
        self._spawn(self._write_writing, root, save.key, save.attempt)

    async def _write_writing(self, root: RootConfig, key: SaveKey, attempt: str) -> None:
        save = self._daemon.ledger.get(key)
        if save is None or save.attempt != attempt or save.marked:
            return
        marker = marker_for(save, self.node, "writing")
        async with self._lock(key):
            if save.marked or save.locally_done():
                return
            try:
                write = partial(self._storage.write_marker, durable=False)
                await self._run(root, write, root, key.step, marker)
            except OSError:
                pass  # only names this node in the leader's timeout message

    # -- effects -------------------------------------------------------------------------

    def start(self, effect: MarkNode | Watch | NodeFailed) -> None:
        """Carry out one spanning-save effect in the background."""
        if self.group is None:  # recovery before serving: the effects come again
            if isinstance(effect, NodeFailed):
                self._daemon.apply(effect.then)
            return
        if isinstance(effect, MarkNode):
            self._spawn(self._mark, effect.key)
        elif isinstance(effect, Watch):
            waker = self._wakers.get(effect.key)
            if waker is not None:
                waker.poke()  # this node's marker landed: the watcher looks again at once
            if effect.key not in self._watching and not self._closed:
                self._watching.add(effect.key)
                self._spawn(self._watch, effect.key)
        else:
            self._pending.hold(effect.key)
            self._spawn(self._failed, effect)

    def _spawn(self, fn: Callable[..., Coroutine[Any, Any, None]], *args: object) -> None:
        """Run ``fn(*args)`` in the background; a bug in it never takes the daemon down.

        Its scope is counted from now, not from when it first runs: :meth:`close` cancels
        a task spawned but not yet started as well, and :meth:`idle` waits for it.
        """
        assert self.group is not None
        scope = anyio.CancelScope()
        if self._closed:
            scope.cancel()  # its shielded part (a marker, a failure) still runs
        self._watches.hold(scope)
        self.group.start_soon(self._guarded, scope, fn, *args)

    async def _guarded(
        self, scope: anyio.CancelScope, fn: Callable[..., Coroutine[Any, Any, None]], *args: object
    ) -> None:
        try:
            with scope:
                await fn(*args)
        except Exception as exc:  # a task boundary: report, never crash the daemon
            where = getattr(fn, "__name__", "nodes")
            self._daemon.events.emit("daemon.internal_error", "error", where=where, error=repr(exc))
        finally:
            self._watches.release(scope)

    async def _mark(self, key: SaveKey) -> None:
        daemon = self._daemon
        save = daemon.ledger.get(key)
        if save is None or save.state is not p.SaveState.OPEN or save.marked:
            return
        root = daemon.configured(key.root)
        files = {r: save.ranks[r].files for r in save.local_ranks()}
        with anyio.CancelScope(shield=True):
            # After a restart the step may be settled already (our marker landed
            # before the crash): learn that rather than judge a directory that moved.
            # The verdict alone is read, one lookup: every node of a large job comes
            # here at once. A directory that moved with no verdict fails the check of
            # the files below, and that failure looks at everything first.
            if await self._learn(root, save, full=False):
                return
            try:
                problems = await self._run(root, self._storage.check_files, root, key.step, files)
            except OSError as exc:
                problems = [f"files could not be checked: {exc.strerror or exc}"]
            assert isinstance(problems, list)
            if problems:
                reason = f"node {self.node}: " + "; ".join(problems[:8])
                await self._fail_here(root, save, reason)
                return
            marker = marker_for(save, self.node, "done", flushed=True)
            try:
                async with self._lock(key):
                    await self._run(root, self._storage.write_marker, root, key.step, marker)
                crash_point("after_node_marker")
            except OSError as exc:
                if exc.errno == errno.ESTALE:  # the directory moved on: learn where to
                    await self.follow(root, save)
                    return
                reason = f"node {self.node}: marker not written: {exc.strerror or exc}"
                await self._fail_here(root, save, reason)
                return
            await self._commit(daemon.ledger.node_marked(key, daemon.clock()))

    def follow_later(self, key: SaveKey) -> None:
        """Learn ``key``'s outcome from the shared directory (another node promotes it)."""
        save = self._daemon.ledger.get(key)
        if self.group is not None and save is not None and not self._closed:
            root = self._daemon.configured(key.root)
            self._spawn(self.follow, root, save)

    @property
    def busy(self) -> bool:
        """Whether a failure is being written out or, once closed, a task still runs."""
        return bool(self._pending) or (self._closed and bool(self._watches))

    async def idle(self) -> None:
        """Return once no node failure is being written out (each reports when done).

        Once :meth:`close` was called, also once every task it cancelled has ended: a
        look at the shared directory under way finishes (shielded), and its commit
        needs the journal, which stops only after this returns.
        """
        await self._pending.idle()
        if self._closed:
            await self._watches.idle()

    def close(self) -> None:
        """Stop every watch (shutdown): a restart watches again from the journal."""
        self._closed = True
        for scope in self._watches:
            scope.cancel()

    async def _fail_here(self, root: RootConfig, save: SaveRecord, reason: str) -> None:
        """Fail ``save`` for a problem met here, unless the leader's verdict explains it.

        A directory the leader set aside makes this node's files vanish: the verdict
        (the step's real outcome) is reported then, not the symptom; this node may see
        the directory gone a cache time before it sees the verdict, and waits for it.
        """
        if await self._learn(root, save):
            return
        tmp = root.tmp_dir(save.key.step)
        found = await self._run(root, self._storage.read_attempt, tmp)
        if not isinstance(found, p.AttemptMarker) or found.attempt != save.attempt:
            await self.follow(root, save)  # the directory moved on: the leader acted
            return
        daemon = self._daemon
        await self._commit(daemon.ledger.rejected(save.key, reason, daemon.clock()))

    async def _watch(self, key: SaveKey) -> None:
        try:
            save = self._daemon.ledger.get(key)
            if save is None:
                return
            root = self._daemon.configured(key.root)
            if not (save.leader and save.state is p.SaveState.OPEN):
                await self.follow(root, save)
            # A node turns out to lead once global rank 0 begins on it.
            if save.leader and save.state is p.SaveState.OPEN:
                await self._gather(root, save)
        finally:
            self._watching.discard(key)

    async def _gather(self, root: RootConfig, save: SaveRecord) -> None:
        """The leader: take the other nodes' markers until the save leaves OPEN."""
        daemon, key, attempt = self._daemon, save.key, save.attempt
        seen: Seen = {}
        async with self._waker(root, root.tmp_dir(key.step), key) as wake:
            while self._open(key, attempt):
                found = await self._run(root, self._storage.read_markers, root, key.step, seen)
                assert isinstance(found, list)
                effects: list[Effect] = []
                now = daemon.clock()
                for marker in found:
                    if marker.node == self.node or marker.attempt != attempt:
                        continue  # our own, or a zombie's
                    if marker.state == "done":
                        effects += daemon.ledger.remote_done(
                            key,
                            marker.node,
                            attempt,
                            marker.local_world_size,
                            marker.ranks(),
                            now,
                            flushed=marker.flushed,
                        )
                    elif marker.state == "failed":
                        effects += daemon.ledger.remote_failed(
                            key, marker.node, attempt, marker.reason or "failed", now
                        )
                    else:
                        effects += daemon.ledger.remote_writing(
                            key, marker.node, attempt, marker.local_world_size, now
                        )
                if effects or daemon.ledger.pending_records():
                    await self._commit(effects)
                await wake(not save.marked)  # own ranks still writing: look less often

    async def follow(self, root: RootConfig, save: SaveRecord) -> None:
        """Every other node (or a leader that lost the claim): wait for the outcome.

        Each look reads the leader's verdict (one lookup while there is none); a full
        look, which also reads ``step_N`` and ``tmp_step_N`` for what a leader that
        could not write its verdict left, comes every :data:`FULL_EVERY` looks' worth of
        time on a large job, so that it costs a tenth of the job's ``poll_budget``.
        """
        daemon, key, attempt = self._daemon, save.key, save.attempt
        stretch = stretched(root, -(-save.world_size // max(save.local_world_size, 1)))
        full_every, last_full = FULL_EVERY * stretch, -math.inf
        async with self._waker(root, root.path, key, stretch) as wake:
            while (now := daemon.ledger.get(key)) is not None and now.attempt == attempt:
                if now.state not in (p.SaveState.OPEN, p.SaveState.VERIFYING):
                    return
                if now.leader and now.state is p.SaveState.OPEN:
                    return  # global rank 0 began here: this node leads, and gathers
                full = daemon.clock() - last_full >= full_every
                if full:
                    last_full = daemon.clock()
                if await self._learn(root, now, full=full):
                    return
                if now.state is p.SaveState.VERIFYING and self.promote is not None:
                    # A leader that yielded to another node's claim: if that node gave
                    # up (its claim is gone, the directory still ours), promote it here.
                    if not await self._run(root, self._storage.claimed, root, key.step):
                        self.promote(key)
                        return
                await wake(now.state is p.SaveState.OPEN and not now.marked)

    async def _learn(self, root: RootConfig, save: SaveRecord, *, full: bool = True) -> bool:
        """Take the outcome of ``save``'s attempt if the shared directory has it.

        ``full``: look beyond the leader's verdict (``_markers.read_outcome``).
        """
        daemon, key, attempt = self._daemon, save.key, save.attempt
        read = partial(self._storage.read_outcome, full=full)
        outcome = await self._run(root, read, root, key.step, attempt)
        if not isinstance(outcome, _markers.Outcome):
            return False
        if outcome.state == "renamed":
            # Renamed, but not yet said durable: a leader that cannot write its verdict
            # is believed once the checkpoint has stood for RENAMED_TRUST.
            first = self._renamed.setdefault(key, daemon.clock())
            if daemon.clock() - first < RENAMED_TRUST:
                return False
        detail = outcome.detail
        if outcome.state == "superseded":
            detail = (
                f"the leader set attempt {attempt} aside; attempt {detail} owns the step's "
                "directory now"
            )
        promoted = outcome.state in ("promoted", "renamed")
        self._renamed.pop(key, None)
        effects = daemon.ledger.learned(
            key, attempt, promoted=promoted, detail=detail, now=daemon.clock()
        )
        await self._commit(effects)
        return True

    async def _failed(self, effect: NodeFailed) -> None:
        daemon, key = self._daemon, effect.key
        try:
            with anyio.CancelScope(shield=True):
                root = daemon.configured(key.root)
                save = daemon.ledger.get(key)
                if effect.announce and save is not None:
                    marker = marker_for(save, self.node, "failed", reason=effect.reason)
                    try:
                        async with self._lock(key):
                            await self._run(
                                root, self._storage.write_marker, root, key.step, marker
                            )
                    except OSError as exc:
                        self._marker_failed(key, effect.attempt, exc)
                if effect.leader:
                    await self.write_verdict(root, key, effect.attempt, effect.reason)
                    await daemon.attempt_dirs.set_aside(key, effect.attempt)
        finally:
            self._pending.release(key)
            daemon.apply(effect.then)

    async def write_verdict(
        self, root: RootConfig, key: SaveKey, attempt: str, reason: str
    ) -> None:
        """The leader: durably say, where every node looks, that ``attempt`` failed."""
        try:
            await self._run(
                root, self._storage.write_verdict, root, key.step, attempt, self.node, reason
            )
        except OSError as exc:
            self._marker_failed(key, attempt, exc)

    # -- helpers -------------------------------------------------------------------------

    def _marker_failed(self, key: SaveKey, attempt: str, exc: OSError) -> None:
        self._daemon.events.emit(
            "node.marker_failed",
            "error",
            root=key.root,
            step=key.step,
            attempt=attempt,
            error=exc.strerror or str(exc),
        )

    def _lock(self, key: SaveKey) -> anyio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = anyio.Lock()
        return lock

    def forget(self, key: SaveKey) -> None:
        """The save settled: drop what was kept for it."""
        self._locks.pop(key, None)
        self._renamed.pop(key, None)
        for token in [t for t in self._done_written if t[0] == key]:
            self._done_written.discard(token)

    def _open(self, key: SaveKey, attempt: str) -> bool:
        save = self._daemon.ledger.get(key)
        return save is not None and save.attempt == attempt and save.state is p.SaveState.OPEN

    async def _commit(self, effects: list[Effect]) -> None:
        try:
            await self._daemon.commit(effects)
        except RequestError:
            pass  # reported as journal.failed; retried on the next look or after a restart

    def _waker(
        self, root: RootConfig, path: str, key: SaveKey, stretch: float = 0.0
    ) -> AbstractAsyncContextManager[Callable[[bool], Awaitable[None]]]:
        """A :class:`Waker` for ``key``'s watcher, which a ``Watch`` effect can poke."""
        return watching(root, path, key, self._wakers, self._local, self.group, stretch)

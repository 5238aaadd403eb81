"""Saves into a root's fast tier: begin, done, the part sealed, the local promotion.

A root with a fast tier (:class:`daemon.config._tiers.FastTier`) answers ``begin`` with
the node-local ``FAST/tmp_step_N``; its saves never enter the durable ledger. When all
of this node's ranks are done, the node's part is checked and checksummed
(:func:`daemon.store._tier.seal`, once, in a worker thread: the training loop never
waits on it), and then:

- on one node, promoted locally at once;
- across nodes, published as ``parts/step_N/NODE.json`` in the durable root's
  coordination directory (:mod:`daemon.store._tiercoord`); each node promotes its own
  part locally once the parts of the run there cover every rank.

Then the tier's retention runs, and the drain (:mod:`daemon.server._drain`) hears of the
step. The fast tier's state is its directories: a daemon restarted finds sealed parts
and promotes them as above (:meth:`TierSaves.recover`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import anyio
import msgspec
from anyio.abc import TaskGroup

from orchestrator import protocol as p
from orchestrator.protocol import FileEntry

from ..base._errors import RequestError, VerificationError
from ..base._events import Events
from ..config._config import Config
from ..config._root import RootConfig
from ..ledger._ledger import Effect, Ledger
from ..store import _tier, _tiercoord
from ..store._lanes import Lanes
from ..store._storage import Storage
from ..store._tier import Part, TierFullError

__all__ = ["TierHost", "TierSaves", "run_key"]


class TierHost(Protocol):
    """What the fast tiers' parts need of the daemon."""

    config: Config
    events: Events
    lanes: Lanes
    storage: Storage
    ledger: Ledger
    clock: Callable[[], float]
    stopping: bool

    def configured(self, path: str) -> RootConfig: ...

    def internal_conn(self) -> int: ...

    async def begin_internal(self, conn: int, request: p.Begin) -> p.BeginReply: ...

    async def dispatch(self, conn: int, request: p.Request) -> msgspec.Struct: ...

    async def settled(
        self, request: p.Wait, root: RootConfig, *, durable: bool = False
    ) -> p.WaitReply: ...

    def apply(self, effects: Sequence[Effect]) -> None: ...


def run_key(run: str | None) -> str:
    """The run a tier save belongs to ("" when the ranks name none)."""
    return run or ""


def _attempt(run: str, step: int) -> str:
    return "tier-" + hashlib.sha256(f"{run}\0{step}".encode()).hexdigest()[:16]


@dataclass
class _Save:
    root: str
    step: int
    run: str
    world_size: int
    local_world_size: int
    attempt: str
    begun: set[int] = field(default_factory=set)
    done: dict[int, tuple[FileEntry, ...]] = field(default_factory=dict)
    state: str = "open"  # preparing, open, sealing, waiting, promoted, failed
    reason: str = ""
    path: str = ""
    bytes: int = 0
    settled: anyio.Event = field(default_factory=anyio.Event)
    prepared: anyio.Event = field(default_factory=anyio.Event)
    """Set once the first begin made the directory ready (or could not: ``refusal``)."""
    refusal: RequestError | None = None


class TierSaves:
    """This daemon's saves into fast tiers.

    Args:
        daemon: The daemon (configuration, events, lanes, metrics).
    """

    def __init__(self, daemon: TierHost) -> None:
        self._daemon = daemon
        self._saves: dict[tuple[str, int], _Save] = {}
        self.limiter = anyio.CapacityLimiter(4)
        """Worker threads for fast-tier calls (never the durable root's lanes)."""
        self.group: TaskGroup | None = None
        self.stopping = False
        self.generation = 0
        """Local promotions so far (a restore decision is reused only while unchanged)."""
        self.promoted: Callable[[RootConfig, int, Part, bool], None] | None = None
        """Called after each local promotion (the drain's hook): root, step, this
        node's part, and whether this node serves rank 0 of the step."""

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a fast-tier worker thread."""
        return await anyio.to_thread.run_sync(partial(fn, *args), limiter=self.limiter)

    def local_newest(self) -> list[tuple[str, int]]:
        """(root, step) of the saves this daemon promoted locally since it started."""
        return [(s.root, s.step) for s in self._saves.values() if s.state == "promoted"]

    # -- requests ----------------------------------------------------------------------

    async def begin(self, conn: int, request: p.Begin, root: RootConfig) -> p.BeginReply:
        """A rank begins a save into ``root``'s fast tier: its directory, made ready."""
        assert root.fast is not None
        if self.stopping or self._daemon.stopping:
            raise RequestError(p.ErrorCode.SHUTTING_DOWN, "the daemon is stopping")
        run = run_key(request.run)
        key = (root.path, request.step)
        save = self._saves.get(key)
        while save is not None and save.state == "preparing":
            # The ranks' begins arrive together: the first prepares the directory in a
            # worker thread, the others join its save once it is ready.
            await save.prepared.wait()
            if save.refusal is not None and save.run == run:
                raise save.refusal
            save = self._saves.get(key)
        lws = request.local_world_size or request.world_size
        if save is not None and save.run == run and save.state in ("open", "sealing", "waiting"):
            if request.rank in save.done:
                raise RequestError(p.ErrorCode.INVALID_STATE, f"rank {request.rank} is done")
            save.begun.add(request.rank)
            return p.BeginReply(
                id=request.id, path=save.path, state=p.SaveState.OPEN, attempt=save.attempt
            )
        if save is not None and save.state == "promoted" and save.run == run:
            return p.BeginReply(
                id=request.id, path=save.path, state=p.SaveState.PROMOTED, attempt=save.attempt
            )
        tier = _tier.tier_root(root)
        need = await self._need(root, tier)
        fresh = save is not None and save.run == run and save.state == "failed"
        previous = save
        save = _Save(
            root=root.path,
            step=request.step,
            run=run,
            world_size=request.world_size,
            local_world_size=lws,
            attempt=_attempt(run, request.step),
            state="preparing",
        )
        save.begun.add(request.rank)
        self._saves[key] = save  # before the thread: the other ranks' begins join it
        try:
            prepare = partial(_tier.prepare, tier, request.step, run, need, fresh=fresh)
            save.path = await self.run(prepare)
            save.state = "open"
        except BaseException as exc:
            save.refusal = self._refusal(root, tier, request.step, exc)
            if previous is None:
                del self._saves[key]
            else:
                self._saves[key] = previous
            if isinstance(exc, OSError):
                raise save.refusal from None
            raise
        finally:
            save.prepared.set()
        self._daemon.events.emit(
            "tier.begun", root=root.path, step=request.step, path=save.path, run=run or None
        )
        return p.BeginReply(
            id=request.id, path=save.path, state=p.SaveState.OPEN, attempt=save.attempt
        )

    def _refusal(
        self, root: RootConfig, tier: RootConfig, step: int, exc: BaseException
    ) -> RequestError:
        """What the begins waiting for a step's directory are told when it was not made."""
        if isinstance(exc, TierFullError):
            self._daemon.events.emit(
                "tier.full", "error", root=root.path, step=step, fast=tier.path,
                error=exc.strerror,
            )  # fmt: skip
            return RequestError(p.ErrorCode.INVALID_STATE, str(exc.strerror))
        if isinstance(exc, OSError):
            return RequestError(
                p.ErrorCode.INVALID_STATE, f"fast tier {tier.path}: {exc.strerror or exc}"
            )
        return RequestError(p.ErrorCode.SHUTTING_DOWN, f"step {step}'s begin was interrupted")

    async def _need(self, root: RootConfig, tier: RootConfig) -> int:
        """Bytes a new save needs free: the last local part's size, or ``min_free_mb``."""
        assert root.fast is not None
        last = 0
        for save in self._saves.values():
            if save.root == root.path and save.state == "promoted":
                last = max(last, save.bytes)
        return max(int(root.fast.min_free_mb * 1e6), last)

    def done(self, request: p.Done, root: RootConfig) -> p.Ack:
        """A rank's writes landed; the last of this node's starts the seal."""
        save = self._get(root, request.step, request.rank)
        if save.state == "failed":
            raise RequestError(p.ErrorCode.STEP_FAILED, f"step {save.step}: {save.reason}")
        save.done[request.rank] = tuple(request.files)
        if save.state == "open" and len(save.done) >= save.local_world_size:
            save.state = "sealing"
            assert self.group is not None
            self.group.start_soon(self._seal, save)
        return p.Ack(id=request.id)

    def fail(self, request: p.Fail, root: RootConfig) -> p.Ack:
        """A rank's save failed: the step is never promoted in the fast tier."""
        save = self._get(root, request.step, request.rank)
        self._failed(save, f"rank {request.rank} failed: {request.reason}")
        return p.Ack(id=request.id)

    def _get(self, root: RootConfig, step: int, rank: int) -> _Save:
        save = self._saves.get((root.path, step))
        if save is None or rank not in save.begun:
            raise RequestError(p.ErrorCode.NOT_BEGUN, f"rank {rank} never began step {step}")
        return save

    def _failed(self, save: _Save, reason: str) -> None:
        if save.state in ("failed", "promoted"):
            return
        save.state, save.reason = "failed", reason
        save.settled.set()
        self._daemon.events.emit(
            "tier.failed", "error", root=save.root, step=save.step, reason=reason
        )
        if self.group is not None:
            self.group.start_soon(self._failed_io, save, reason)

    async def _failed_io(self, save: _Save, reason: str) -> None:
        """Free the failed save's space, and tell the other nodes of a spanning one.

        The fast tier keeps no failed save: its space is the scarce thing (the ranks'
        ``fail`` and the event say why). The other nodes of the run stop waiting for
        this node's part at once, instead of at their ``node_timeout``.
        """
        daemon = self._daemon
        try:
            root = daemon.configured(save.root)
        except RequestError:
            return
        if root.fast is None:
            return
        tier = _tier.tier_root(root)
        current = self._saves.get((save.root, save.step))
        if current is save:  # not begun again meanwhile
            try:
                await self.run(partial(_tier.remove_step, tier, save.step, promoted=False))
            except OSError:
                pass
        if save.local_world_size < save.world_size:
            rel = f"parts/{root.final_prefix}{save.step}/{daemon.config.node}.failed"
            fact = msgspec.json.encode({"run": save.run, "reason": reason})
            try:
                await daemon.lanes.run(root.path, _tiercoord.write_fact, root, rel, fact)
            except OSError:
                pass  # the others fail at their node_timeout

    async def settled(self, request: p.Wait, root: RootConfig) -> p.WaitReply | None:
        """``wait`` on a fast-tier save (its local promotion); None: not one of ours."""
        save = self._saves.get((root.path, request.step))
        if save is None:
            return None
        with anyio.move_on_after(request.timeout):
            await save.settled.wait()
        attempt = save.attempt
        if save.state == "promoted":
            return p.WaitReply(id=request.id, state="promoted", path=save.path, attempt=attempt)
        if save.state == "failed":
            return p.WaitReply(id=request.id, state="failed", reason=save.reason, attempt=attempt)
        return p.WaitReply(id=request.id, state="pending", attempt=attempt)

    # -- sealing and the local promotion -----------------------------------------------

    async def _seal(self, save: _Save) -> None:
        daemon = self._daemon
        root = daemon.configured(save.root)
        tier = _tier.tier_root(root)
        seal = partial(
            _tier.seal,
            tier,
            save.step,
            node=daemon.config.node,
            run=save.run,
            world_size=save.world_size,
            reported=dict(save.done),
        )
        try:
            part: Part = await self.run(seal)
        except (VerificationError, OSError) as exc:
            self._failed(save, f"verification failed: {exc}")
            return
        daemon.events.emit(
            "tier.sealed", root=save.root, step=save.step, bytes=part.bytes, hash_s=part.hash_s,
            files=len(part.files()),
        )  # fmt: skip
        await self.publish_and_promote(root, part)
        if save.state != "failed":
            save.state = "promoted"
            save.path = tier.final_dir(save.step)
            save.bytes = part.bytes
            save.settled.set()

    async def publish_and_promote(self, root: RootConfig, part: Part) -> bool:
        """Publish a sealed part (across nodes), wait for the others', promote locally."""
        assert root.fast is not None
        daemon = self._daemon
        tier = _tier.tier_root(root)
        start = daemon.clock()
        save = self._saves.get((root.path, part.step))
        spans = len(part.ranks) < part.world_size
        nodes = 1
        if spans:
            rel = f"parts/{root.final_prefix}{part.step}/{daemon.config.node}.json"
            try:
                await daemon.lanes.run(
                    root.path, _tiercoord.write_fact, root, rel, msgspec.json.encode(part)
                )
            except OSError as exc:
                if save is not None:
                    self._failed(save, f"cannot publish the part: {exc.strerror or exc}")
                return False
            covered = await self._await_parts(root, part)
            if isinstance(covered, str):
                if save is not None:
                    self._failed(save, covered)
                return False
            nodes = covered
        try:
            await self.run(_tier.promote_local, tier, part.step)
        except (OSError, VerificationError) as exc:
            if save is not None:
                self._failed(save, f"local promotion failed: {exc}")
            return False
        self.generation += 1
        daemon.events.emit(
            "tier.promoted", root=root.path, step=part.step, path=tier.final_dir(part.step),
            bytes=part.bytes, nodes=nodes, wait_ms=round((daemon.clock() - start) * 1000, 3),
        )  # fmt: skip
        if self.promoted is not None:
            self.promoted(root, part.step, part, "0" in part.ranks)
        self._trim(root.path)
        return True

    def _trim(self, root: str, kept: int = 64) -> None:
        """Forget all but the newest ``kept`` settled saves of ``root`` (memory stays bounded)."""
        settled = sorted(
            step
            for (path, step), save in self._saves.items()
            if path == root and save.state in ("promoted", "failed")
        )
        for step in settled[:-kept]:
            del self._saves[(root, step)]

    async def _await_parts(self, root: RootConfig, part: Part) -> int | str:
        """Wait until the run's parts cover every rank; how many nodes, or why not."""
        assert root.fast is not None
        deadline = self._daemon.clock() + root.fast.node_timeout
        while True:
            parts = await self._daemon.lanes.run(root.path, read_parts, root, part.step)
            mine = [q for q in parts if q.run == part.run and q.world_size == part.world_size]
            ranks = {r for q in mine for r in q.ranks}
            if len(ranks) >= part.world_size:
                return len(mine)
            failed = await self._daemon.lanes.run(root.path, read_failures, root, part.step)
            for node, run, reason in failed:
                if run == part.run:
                    return f"node {node} failed: {reason}"
            if self._daemon.clock() >= deadline or self._daemon.stopping:
                return f"not every node's part arrived within {root.fast.node_timeout}s"
            await anyio.sleep(root.poll_interval)

    async def recover(self) -> None:
        """Promote the sealed parts a previous run of the daemon left unpromoted."""
        for root in self._daemon.config.roots:
            if root.fast is None:
                continue
            tier = _tier.tier_root(root)
            for step in await self.run(_tier.open_steps, tier):
                part = await self.run(_tier.read_part, tier.tmp_dir(step))
                if part is not None:
                    assert self.group is not None
                    self.group.start_soon(self.publish_and_promote, root, part)


def read_parts(root: RootConfig, step: int) -> list[Part]:
    """Every node's published part of ``step`` (blocking; the root's lane)."""
    rel = f"parts/{root.final_prefix}{step}"
    parts = []
    for name in _tiercoord.list_names(root, rel):
        data = _tiercoord.read_fact(root, f"{rel}/{name}")
        if data is None:
            continue
        try:
            parts.append(msgspec.json.decode(data, type=Part))
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
    return parts


def read_failures(root: RootConfig, step: int) -> list[tuple[str, str, str]]:
    """(node, run, reason) of every node that failed its part of ``step`` (blocking)."""
    rel = f"parts/{root.final_prefix}{step}"
    found = []
    for name in _tiercoord.list_names(root, rel):
        if not name.endswith(".failed"):
            continue
        data = _tiercoord.read_fact(root, f"{rel}/{name}")
        try:
            fact = msgspec.json.decode(data or b"", type=dict[str, str])
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        found.append((name.removesuffix(".failed"), fact.get("run", ""), fact.get("reason", "")))
    return found

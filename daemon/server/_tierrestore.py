"""Where a restarting job restores from: the newest step complete in a tier it can read.

Every rank asks its node's daemon (``restore``). On a root without a fast tier the
answer is the root's newest promoted step. With one, the daemon gathers its node's
ranks of the run (all of them, or ``node_timeout``), then:

- on one node, it decides: the newest local step that holds every file its ranks will
  read, if that is at least as new as the newest durable step; else the durable one;
- across nodes, it publishes ``restore/RUN/NODE.json`` in the durable root's
  coordination directory (its ranks, its tier's incarnation, the local steps usable
  for those ranks); the daemon serving rank 0 waits until the nodes cover every rank,
  takes the newest step usable on *every* node (else the newest durable step), and
  writes ``restore/RUN/decision.json`` once (create-only); every node answers its
  ranks from that file. A node whose tier was wiped or replaced holds no usable step,
  so the decision falls back to durable for all: never a mixed restore.

A step is usable for a rank on a node when the node's part holds every file the rank
wrote; and, when the step spans nodes, only if no node's part holds a global DCP
``.metadata`` or a safetensors index, which make every rank read other ranks' files
(save with ``use_collectives=False``, per-rank metadata, for node-local restores).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import anyio
import msgspec

from orchestrator import protocol as p

from ..base._errors import RequestError
from ..config._root import RootConfig
from ..store import _tier, _tiercoord
from ..store._tier import Part
from ._tiers import TierHost, TierSaves, read_parts, run_key

__all__ = ["Restorer"]


class _NodeFacts(msgspec.Struct, frozen=True):
    node: str
    ranks: list[int]
    incarnation: str
    usable: list[int]


class Decision(msgspec.Struct, frozen=True):
    """The step every rank of one run restores."""

    step: int | None
    tier: str
    by: str
    reason: str = ""


@dataclass
class _Gather:
    ranks: set[int] = field(default_factory=set)
    arrived: anyio.Event = field(default_factory=anyio.Event)
    decided: anyio.Event = field(default_factory=anyio.Event)
    decision: Decision | None = None
    error: str = ""
    started: bool = False
    generation: int = 0


def _global(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name == ".metadata" or name.endswith(".index.json")


class Restorer:
    """Answers ``restore``."""

    def __init__(self, daemon: TierHost, saves: TierSaves) -> None:
        self._daemon = daemon
        self._saves = saves
        self._runs: dict[tuple[str, str], _Gather] = {}

    async def restore(self, request: p.Restore) -> p.RestoreReply:
        """The reply to one rank's ``restore``."""
        daemon = self._daemon
        root = daemon.configured(request.root)
        if root.fast is None:
            step, path = await self._durable(root)
            return p.RestoreReply(id=request.id, step=step, path=path, tier="durable")
        lws = request.local_world_size or request.world_size
        key = (root.path, run_key(request.run))
        gather = self._runs.get(key)
        if gather is None or (
            gather.decided.is_set() and gather.generation != self._saves.generation
        ):
            # First ask of the run, or the run saved since its decision: decide afresh.
            # Asked again with nothing saved since (a rank reading orchestrator.latest
            # after its restore): the same answer.
            gather = self._runs[key] = _Gather(generation=self._saves.generation)
        gather.ranks.add(request.rank)
        if len(gather.ranks) >= lws or lws >= request.world_size:
            # One node holds every rank: the first ask decides (a rank 0 alone reading
            # orchestrator.latest is answered at once). Across nodes, the node waits
            # for its ranks: which it serves now decides what it can offer.
            gather.arrived.set()
        if not gather.started:
            gather.started = True
            assert self._saves.group is not None
            self._saves.group.start_soon(self._decide, root, request, gather)
        with anyio.move_on_after(request.timeout):
            await gather.decided.wait()
        if gather.decision is None:
            raise RequestError(
                p.ErrorCode.INVALID_STATE,
                gather.error or f"no restore decision within {request.timeout}s",
            )
        d = gather.decision
        if d.step is None:
            return p.RestoreReply(id=request.id, tier=d.tier, reason=d.reason)
        if d.tier == "fast":
            path = _tier.tier_root(root).final_dir(d.step)
        else:
            path = await daemon.lanes.run(
                root.path, daemon.storage.locate, root, d.step, abandon=True
            )
        return p.RestoreReply(id=request.id, step=d.step, path=path, tier=d.tier, reason=d.reason)

    async def _durable(self, root: RootConfig) -> tuple[int | None, str | None]:
        daemon = self._daemon
        step = await daemon.lanes.run(root.path, daemon.storage.latest_promoted, root, abandon=True)
        if step is None:
            return None, None
        path = await daemon.lanes.run(root.path, daemon.storage.locate, root, step, abandon=True)
        return step, path

    async def _decide(self, root: RootConfig, request: p.Restore, gather: _Gather) -> None:
        daemon = self._daemon
        assert root.fast is not None
        try:
            with anyio.move_on_after(root.fast.node_timeout):
                await gather.arrived.wait()
            lws = request.local_world_size or request.world_size
            spans = lws < request.world_size
            ranks = sorted(gather.ranks) if spans else list(range(request.world_size))
            tier = _tier.tier_root(root)
            # A driver (not a rank) knows no world size: each step's own counts.
            world = None if request.driver else request.world_size
            usable = await self._usable(root, tier, ranks, spans, world)
            durable, _ = await self._durable(root)
            run = run_key(request.run) or "unnamed"
            if not spans:
                decision = _choose(max(usable, default=None), durable, daemon.config.node, "")
                await self._publish(root, f"restore/{run}/decision.json", decision, once=False)
            else:
                decision = await self._agree(root, request, run, ranks, usable, durable)
            gather.decision = decision
            daemon.events.emit(
                "tier.restore", root=root.path, run=run, step=decision.step,
                source=decision.tier if decision.step is not None else "none",
                reason=decision.reason or None,
            )  # fmt: skip
        except (OSError, RequestError) as exc:
            gather.error = f"restore of {root.path} failed: {exc}"
        finally:
            gather.decided.set()

    async def _usable(
        self, root: RootConfig, tier: RootConfig, ranks: list[int], spans: bool,
        world: int | None,
    ) -> list[int]:  # fmt: skip
        """The local steps this node can offer.

        ``world`` None: a driver asks, and a step counts when this node holds every
        rank of the world it was saved with.
        """
        usable = []
        for step in await self._saves.run(_tier.local_steps, tier):
            part: Part | None = await self._saves.run(_tier.read_part, tier.final_dir(step))
            if part is None or (world is not None and part.world_size != world):
                continue
            needed = ranks if world is not None else list(range(part.world_size))
            if not await self._saves.run(_tier.holds, tier, step, needed):
                continue
            if spans:
                parts = await self._daemon.lanes.run(root.path, read_parts, root, step)
                if any(_global(f.path) for q in parts for f in q.files()):
                    continue
            usable.append(step)
        return usable

    async def _agree(
        self, root: RootConfig, request: p.Restore, run: str, ranks: list[int],
        usable: list[int], durable: int | None,
    ) -> Decision:  # fmt: skip
        daemon = self._daemon
        assert root.fast is not None
        tier = _tier.tier_root(root)
        node = daemon.config.node
        incarnation = await self._saves.run(_tier.incarnation, tier.path)
        facts = _NodeFacts(node=node, ranks=ranks, incarnation=incarnation, usable=usable)
        base = f"restore/{run}"
        await daemon.lanes.run(
            root.path,
            _tiercoord.write_fact,
            root,
            f"{base}/{node}.json",
            msgspec.json.encode(facts),
        )
        deadline = daemon.clock() + root.fast.node_timeout
        while True:
            data = await daemon.lanes.run(
                root.path, _tiercoord.read_fact, root, f"{base}/decision.json"
            )
            if data is not None:
                return msgspec.json.decode(data, type=Decision)
            if 0 in ranks:
                nodes = await daemon.lanes.run(
                    root.path,
                    partial(_tiercoord.read_facts, skip="decision.json"),
                    root,
                    base,
                    _NodeFacts,
                )
                covered = {r for n in nodes for r in n.ranks}
                if len(covered) >= request.world_size or daemon.clock() >= deadline:
                    common = set(usable)
                    for n in nodes:
                        common &= set(n.usable)
                    reason = "" if len(covered) >= request.world_size else "not every node answered"
                    if reason:
                        common = set()
                    decision = _choose(max(common, default=None), durable, node, reason)
                    await self._publish(root, f"{base}/decision.json", decision, once=True)
                    continue  # read back what won
            elif daemon.clock() >= deadline + root.fast.node_timeout:
                raise RequestError(p.ErrorCode.INVALID_STATE, "the leader never decided")
            await anyio.sleep(root.poll_interval)

    async def _publish(self, root: RootConfig, rel: str, decision: Decision, *, once: bool) -> None:
        data = msgspec.json.encode(decision)
        fn = _tiercoord.create_once if once else _tiercoord.write_fact
        try:
            await self._daemon.lanes.run(root.path, fn, root, rel, data)
        except OSError:
            if once:
                raise
            # One node: the decision is its own; the record on the durable root is for
            # operators, and a durable root that cannot be written does not stop a
            # restore from the fast tier.


def _choose(fast: int | None, durable: int | None, by: str, why: str) -> Decision:
    if fast is not None and (durable is None or fast >= durable):
        return Decision(step=fast, tier="fast", by=by)
    reason = why or ("" if fast is None else f"durable step {durable} is newer than {fast}")
    if fast is None and not why:
        reason = "no step in the fast tier holds every file of the ranks here"
        if durable is None:
            reason = "nothing saved yet"
    return Decision(step=durable, tier="durable", by=by, reason=reason)

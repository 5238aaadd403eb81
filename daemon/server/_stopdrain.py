"""Which step a stop drains across nodes: one step, agreed through the coordination directory.

On SIGTERM each node drains a step of its fast tier within the grace. A durable step
commits only when every node copies its part of the *same* step, and each node's newest
local step may differ (a node that had not yet seen the last parts when it stopped, a
step lost on one node). So, for a step that spans nodes:

- each stopping node writes ``stop/RUN/NODE.json`` in the durable root's coordination
  directory (RUN: the run of its newest local step): its ranks, the local steps it
  holds, a nonce of this stop and when it was written;
- the node serving rank 0 waits until those facts cover every rank (at most
  ``node_timeout``, or half the grace), takes the newest step every answering node
  holds (:func:`choose`), and writes ``stop/RUN/decision.json`` with the step and the
  nonces it counted, and the step's drain order (``drains/step_N.json``), which the
  nodes still running follow as any order; then removes the facts it counted (a fact
  older than ``node_timeout`` is never counted);
- every other stopping node waits for a decision that counts its own nonce (an older
  stop's decision never does) and drains that step.

On one node the newest local step is drained, as it always was.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from functools import partial

import anyio
import msgspec

from ..config._root import RootConfig
from ..store import _tier, _tiercoord
from ..store._tier import Part
from ._tiers import TierHost, TierSaves

__all__ = ["StopDecision", "StopFacts", "agree", "choose"]


class StopFacts(msgspec.Struct, frozen=True):
    """What one stopping node holds of a run's steps."""

    node: str
    nonce: str
    ranks: list[int]
    held: list[int]
    at: float = 0.0
    """When it was written (wall clock, seconds): an older stop's facts are not counted."""


class StopDecision(msgspec.Struct, frozen=True):
    """The step every stopping node of a run drains."""

    step: int | None
    by: str
    nonces: list[str]
    reason: str = ""


def choose(facts: Sequence[StopFacts], world_size: int) -> tuple[int | None, str]:
    """The newest step every answering node holds, and what the choice lacked ("": nothing).

    Nodes that did not answer (still running, or gone) are not counted: a running node
    drains its part on the drain order; a gone node's part never comes, and the durable
    save fails at its timeout, the step staying in the fast tiers.
    """
    if not facts:
        return None, "no node answered"
    common = set(facts[0].held)
    for fact in facts[1:]:
        common &= set(fact.held)
    covered = {rank for fact in facts for rank in fact.ranks}
    why = (
        ""
        if len(covered) >= world_size
        else f"the nodes of {len(covered)} of {world_size} ranks answered"
    )
    step = max(common, default=None)
    if step is None:
        why = "; ".join(x for x in (why, "no local step is held on every answering node") if x)
    return step, why


async def agree(
    daemon: TierHost, saves: TierSaves, root: RootConfig, steps: Sequence[int], grace: float
) -> tuple[int | None, str]:
    """The step this node drains on stop, and what its choice lacked.

    Runs inside the stop's grace (the caller's deadline); ``steps`` are the local steps,
    oldest first.
    """
    assert root.fast is not None
    tier = _tier.tier_root(root)
    newest = steps[-1]
    part: Part | None = await saves.run(_tier.read_part, tier.final_dir(newest))
    if part is None or len(part.ranks) >= part.world_size:
        return newest, ""  # one node holds every rank
    node = daemon.config.node
    base = f"stop/{part.run or 'unnamed'}"
    mine = StopFacts(
        node=node, nonce=uuid.uuid4().hex, ranks=sorted(int(r) for r in part.ranks),
        held=list(steps), at=time.time(),
    )  # fmt: skip
    await daemon.lanes.run(
        root.path, _tiercoord.write_fact, root, f"{base}/{node}.json", msgspec.json.encode(mine)
    )
    decision = f"{base}/decision.json"
    if "0" not in part.ranks:
        while True:  # until a decision counts this stop (the caller's grace ends it)
            data = await daemon.lanes.run(root.path, _tiercoord.read_fact, root, decision)
            if data is not None:
                try:
                    said = msgspec.json.decode(data, type=StopDecision)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    said = None
                if said is not None and mine.nonce in said.nonces:
                    return said.step, said.reason
            await anyio.sleep(root.poll_interval)
    until = daemon.clock() + min(root.fast.node_timeout, grace / 2)
    while True:
        facts = await daemon.lanes.run(
            root.path, partial(_tiercoord.read_facts, skip="decision.json"), root, base, StopFacts
        )
        # An older stop's facts (a node that stopped before, alone, or whose fact
        # this stop has not replaced yet) are not counted: nodes' clocks agree far
        # better than node_timeout.
        fresh = mine.at - root.fast.node_timeout
        facts = [f for f in facts if f.node != node and f.at >= fresh] + [mine]
        covered = {rank for f in facts for rank in f.ranks}
        if len(covered) >= part.world_size or daemon.clock() >= until:
            break
        await anyio.sleep(root.poll_interval)
    step, why = choose(facts, part.world_size)
    said = StopDecision(step=step, by=node, nonces=[f.nonce for f in facts], reason=why)
    await daemon.lanes.run(
        root.path, _tiercoord.write_fact, root, decision, msgspec.json.encode(said)
    )
    if step is not None:
        order = msgspec.json.encode({"step": step, "by": node, "stop": True})
        rel = f"drains/{root.final_prefix}{step}.json"
        await daemon.lanes.run(root.path, _tiercoord.write_fact, root, rel, order)
    for fact in facts:  # counted: the decision names their nonces, a later stop needs none
        try:
            await daemon.lanes.run(
                root.path, _tiercoord.remove_fact, root, f"{base}/{fact.node}.json"
            )
        except OSError:
            pass  # left behind, it is too old to be counted by a later stop
    return step, why

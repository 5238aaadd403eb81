"""``ckptd promote`` of a step that spans nodes: from its node markers, or a refusal."""

from __future__ import annotations

from orchestrator import protocol as p

from ..base._errors import RequestError
from ..config._config import RootConfig
from ..host._host import Host
from ..ledger._saves import SaveRecord, ranges
from ..store._markers import NodeMarker

__all__ = ["RescueMarkers", "done_on_root", "rescue_markers"]


class RescueMarkers:
    """The node markers that let ``ckptd promote`` promote a spanning step on any node.

    Attributes:
        world_size: The job's world size, as the markers say.
        markers: The ``done`` markers to take (this node's own left out when its ranks
            are in the ledger already).
    """

    def __init__(self, world_size: int, markers: list[NodeMarker]) -> None:
        self.world_size = world_size
        self.markers = markers

    def files(self) -> dict[int, tuple[p.FileEntry, ...]]:
        """Every rank the markers cover, with its files."""
        return {r: tuple(es) for m in self.markers for r, es in m.ranks().items()}


async def rescue_markers(
    daemon: Host,
    root: RootConfig,
    step: int,
    attempt: str,
    save: SaveRecord | None,
    tmp: str | None = None,
) -> RescueMarkers | None:
    """For ``ckptd promote``: the markers of ``attempt`` in ``tmp_step_N``, if it spans nodes.

    Returns:
        None for a step with no node markers (promoted as a single node's).

    Raises:
        RequestError: (``unverifiable``) the markers do not cover every rank, or a node
            reported a failure; the message says what is missing.
    """
    where = tmp or root.tmp_dir(step)
    found = await daemon.lanes.run(
        root.path, daemon.storage.read_markers_in, where, {}, abandon=True
    )
    assert isinstance(found, list)
    ours = [m for m in found if isinstance(m, NodeMarker) and m.attempt == attempt]
    if not ours:
        return None
    world_size = ours[0].world_size
    failed = [m for m in ours if m.state == "failed"]
    if failed:
        said = "; ".join(f"node {m.node}: {m.reason}" for m in failed)
        raise RequestError(p.ErrorCode.UNVERIFIABLE, f"step {step} failed on a node: {said}")
    local = set() if save is None else set(save.local_ranks())
    done = [m for m in ours if m.state == "done" and not (local and m.node == daemon.config.node)]
    covered = local | {r for m in done for r in m.ranks()}
    missing = sorted(set(range(world_size)) - covered)
    if missing:
        writing = sorted(m.node for m in ours if m.state == "writing")
        raise RequestError(
            p.ErrorCode.UNVERIFIABLE,
            f"step {step} spans nodes and ranks {ranges(missing)} have no node marker of "
            f"attempt {attempt}"
            + (f" (still writing: {', '.join(writing)})" if writing else "")
            + "; their writes may not have landed",
        )
    return RescueMarkers(world_size, done)


async def done_on_root(daemon: Host, root: RootConfig, step: int) -> bool:
    """Whether ``tmp_step_N``, which no journal knows, is this node's to finish.

    True when its node markers of the attempt its attempt marker names are all ``done``,
    cover every rank of the step, and this node's marker holds rank 0 (a step that
    spans nodes is promoted by its leader only). Such a step was complete, by every
    rank's word, when a daemon that lost its state directory left it: one with the
    journal would promote it, and so does recovery (through :func:`rescue_markers`).
    """
    tmp = root.tmp_dir(step)
    marker = await daemon.lanes.run(root.path, daemon.storage.read_attempt, tmp, abandon=True)
    if marker is None:
        return False
    found = await daemon.lanes.run(root.path, daemon.storage.read_markers_in, tmp, {}, abandon=True)
    assert isinstance(found, list)
    ours = [m for m in found if isinstance(m, NodeMarker) and m.attempt == marker.attempt]
    if not ours or any(m.state != "done" for m in ours):
        return False
    covered = {r for m in ours for r in m.ranks()}
    leader = [m.node for m in ours if 0 in m.ranks()]
    world_size = ours[0].world_size
    return covered == set(range(world_size)) and leader == [daemon.config.node]

"""Replies: what the daemon answers, and the records they carry.

Every reply echoes the request's ``id`` with ``ok``; a refusal is an :class:`ErrorReply`.
The records inside them (a save, a rank, a root's layout, a retention verdict) are also
what the daemon writes to disk where a file needs the same shape: :class:`RootInfo` is
the root's layout file, :class:`AttemptMarker` the marker in ``tmp_step_N``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from ._constants import PROTOCOL_VERSION, RankState, SaveState

__all__ = [
    "Ack",
    "AttemptMarker",
    "BeginReply",
    "ErrorInfo",
    "ErrorReply",
    "GcReply",
    "HealthReply",
    "LatestReply",
    "RestoreReply",
    "PingReply",
    "RankInfo",
    "RetentionInfo",
    "RetentionReply",
    "RetentionStep",
    "RootInfo",
    "SaveInfo",
    "StallInfo",
    "StatusReply",
    "WaitReply",
]


class ErrorInfo(msgspec.Struct, frozen=True):
    """Why a request was refused."""

    code: str
    message: str


class _Reply(msgspec.Struct, frozen=True, kw_only=True):
    id: int | None
    ok: bool = True


class Ack(_Reply, frozen=True):
    """Success with nothing to report (``done``, ``fail``, ``subscribe``)."""


class ErrorReply(_Reply, frozen=True, kw_only=True):
    """Failure; ``ok`` is false."""

    ok: bool = False
    error: ErrorInfo


class PingReply(_Reply, frozen=True, kw_only=True):
    """Reply to ``ping``."""

    version: str
    protocol: int = PROTOCOL_VERSION


class HealthReply(_Reply, frozen=True, kw_only=True):
    """Reply to ``health``."""

    version: str
    healthy: bool
    problem: str | None = None
    """Why the daemon is not healthy (None when it is)."""


class BeginReply(_Reply, frozen=True, kw_only=True):
    """Reply to ``begin``: where to write, the save's state, and the attempt it joined.

    ``path`` exists when the reply is sent, and holds the attempt's marker.
    """

    path: str
    state: SaveState
    attempt: str = ""


class WaitReply(_Reply, frozen=True, kw_only=True):
    """Reply to ``wait``. ``path`` is set when promoted, ``reason`` when failed."""

    state: Literal["promoted", "failed", "pending"]
    path: str | None = None
    reason: str | None = None
    attempt: str | None = None


class RankInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """One rank's part in a save, as ``status`` reports it."""

    rank: int
    state: RankState
    connected: bool
    files: int = 0
    bytes: int = 0
    lease_s: float | None = None
    reason: str | None = None
    node: str | None = None
    """The node whose marker reported this rank (the leader of a spanning save)."""


class SaveInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """One save, as ``status`` reports it."""

    root: str
    step: int
    world_size: int
    state: SaveState
    age_s: float
    ranks: list[RankInfo]
    path: str | None = None
    reason: str | None = None
    attempt: str | None = None
    set_aside: str | None = None
    """Where a failed attempt's files were moved (inside the root's trash)."""
    local_world_size: int | None = None
    """For a save that spans nodes: the job's ranks on this node."""
    role: Literal["leader", "node"] | None = None
    """For a save that spans nodes: whether this daemon promotes it (the leader, serving
    rank 0) or learns its outcome from the shared directory."""
    marked: bool = False
    """For a save that spans nodes: this node's marker is durable."""


class RootInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """A configured root and how its directories are named."""

    path: str
    tmp_prefix: str
    final_prefix: str
    pointer: str
    staging: str = ""
    """The directory the steps are written in when it is not the root (the root's
    ``staging`` option); "": the root."""
    fast: str = ""
    """The node-local directory the steps are written in when the root has a fast tier
    (its ``[roots.fast]``, docs/tiers.md); "": none."""


class StallInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A root (or the journal) whose filesystem call has been blocked too long."""

    root: str | None
    """The stalled root; None for the daemon's journal."""
    call: str
    """The blocking function that has run longest, for people (e.g. ``scan_save``)."""
    blocked_s: float
    """Seconds it has run so far."""
    running: int
    """Calls under way in the root's threads."""
    queued: int
    """Calls waiting for one of those threads."""


class AttemptMarker(msgspec.Struct, frozen=True, kw_only=True):
    """What :data:`ATTEMPT_MARKER` holds: the attempt that owns a ``tmp_step_N``."""

    format: str = "ckptd-attempt/1"
    attempt: str
    root: str
    step: int
    world_size: int
    created: str
    """When the attempt began (ISO 8601, UTC)."""
    run: str = ""
    """The run of the job the attempt belongs to (``begin``'s ``run``); "": unnamed."""


class StatusReply(_Reply, frozen=True, kw_only=True):
    """Reply to ``status``."""

    version: str
    pid: int
    uptime_s: float
    roots: list[str]
    saves: list[SaveInfo]
    layouts: list[RootInfo] = []
    waits: int = 0
    """``wait`` requests pending."""
    waited_steps: int = 0
    """Steps that pending waits wait for (what they cost the daemon's memory)."""
    stalled: list[StallInfo] = []
    """Roots (and the journal) reported stalled (``root.stalled``) and not yet recovered."""
    node: str = ""
    """This daemon's node name (``--node``)."""


class LatestReply(_Reply, frozen=True, kw_only=True):
    """Reply to ``latest``."""

    path: str
    step: int


class RestoreReply(_Reply, frozen=True, kw_only=True):
    """Reply to ``restore``: the step to load and where; ``step`` None: nothing to load.

    ``tier`` is ``fast`` (``path`` is on this node's fast tier) or ``durable``;
    ``reason`` says why a newer fast-tier step was not offered, if one was not.
    """

    step: int | None = None
    path: str | None = None
    tier: str = "durable"
    reason: str = ""


class GcReply(_Reply, frozen=True, kw_only=True):
    """Reply to ``gc``: what qualifies for removal, and whether it was removed."""

    candidates: list[str]
    """``ROOT/tmp_step_N`` of each tmp directory that goes, and of each failed step with
    nothing left on disk (also in ``absent``), by step."""
    removed: bool
    set_aside: list[str] = []
    """Failed attempts' directories set aside in the root's trash that go, by step."""
    absent: list[str] = []
    """The ``candidates`` that do not exist: failed steps with nothing left on disk, which
    the daemon only forgets."""


class RetentionStep(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One ``step_N`` of a root, as the retention policy judges it."""

    step: int
    kept: list[str] = []
    """Why it is kept (``newest``, a pointer's name, ``last-K``, ``every-N``, ``best-K``,
    ``unscored``, ``pinned``, ``held``, ``incomplete``); empty when it would be retired."""
    retire: str | None = None
    """When it would be retired: the rules that let it go."""
    metrics: dict[str, float] = {}
    pinned: bool = False
    held_for_s: float | None = None
    """Seconds its hold has left."""


class RetentionInfo(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A root's retention policy, in the form ``ckptd ls`` shows it."""

    policy: str
    """The rules, e.g. ``keep_last=3 keep_best=2:val_loss:min``; "" when none is set."""
    best: int | None = None
    """The step the ``best`` pointer names (by the policy's ``keep_best`` metric)."""
    best_pointer: str | None = None
    """The best pointer's name (``best``)."""
    prunes: bool = True
    """Whether this daemon prunes the root (on a shared root only the leader does)."""


class RetentionReply(_Reply, frozen=True, kw_only=True):
    """Reply to ``retention``: every ``step_N`` of the root, judged; what was retired."""

    info: RetentionInfo
    steps: list[RetentionStep]
    retired: list[int] = []
    """With ``apply``: the steps moved into the trash by this request."""

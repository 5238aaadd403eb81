"""Requests: every message a client may send, and the bounds on their fields.

Each request is a frozen ``msgspec.Struct`` tagged by its ``op``; :data:`Request` is
their union, which :func:`~orchestrator.protocol.decode_request` decodes a line into.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = [
    "AttemptId",
    "RunId",
    "Begin",
    "Done",
    "Fail",
    "FileEntry",
    "Gc",
    "Health",
    "Hold",
    "Latest",
    "MetricName",
    "Metrics",
    "Pin",
    "Ping",
    "Promote",
    "Request",
    "Restore",
    "Retention",
    "Score",
    "Status",
    "Subscribe",
    "Unpin",
    "Wait",
]

_MAX_PATH = 4096
_MAX_REASON = 4096
_MAX_FILES = 100_000
_I64 = 2**63 - 1

Step = Annotated[int, msgspec.Meta(ge=0, le=_I64)]
Rank = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
WorldSize = Annotated[int, msgspec.Meta(ge=1, le=2**31)]
PathStr = Annotated[str, msgspec.Meta(min_length=1, max_length=_MAX_PATH)]
Reason = Annotated[str, msgspec.Meta(max_length=_MAX_REASON)]
RequestId = Annotated[int, msgspec.Meta(ge=-_I64, le=_I64)]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=7 * 24 * 3600)]
AttemptId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9._-]{1,64}$")]
RunId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9._:-]{1,128}$")]
"""An attempt's id: what the daemon put in the ``begin`` reply (1-64 of ``A-Za-z0-9._-``)."""
MetricName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.:/@+-]{1,128}$")]
"""A metric's name: 1-128 of ``A-Za-z0-9_.:/@+-`` (``val_loss``, ``val:accuracy``)."""
Metrics = Annotated[dict[MetricName, float], msgspec.Meta(max_length=256)]
"""Metrics of a checkpoint: name to number, at most 256 (non-finite values are refused)."""
HoldSeconds = Annotated[float, msgspec.Meta(ge=0, le=30 * 24 * 3600)]


class FileEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A file a rank wrote, relative to the step's tmp directory."""

    path: PathStr
    size: Annotated[int, msgspec.Meta(ge=0, le=_I64)]


class _Request(msgspec.Struct, frozen=True, tag_field="op", kw_only=True):
    id: RequestId


class Ping(_Request, frozen=True, tag="ping"):
    """Liveness check; the reply carries the daemon's version."""


class Begin(_Request, frozen=True, tag="begin"):
    """A rank is about to write into ``ROOT/<tmp_prefix><step>/``. Idempotent.

    ``resent`` marks a begin repeated on a new connection after a reconnect: it can never
    start a failed step over, only re-attach to the attempt it belongs to. ``attempt``
    names that attempt (from the first ``begin`` reply); a begin naming an attempt that
    is not the step's current one is refused with ``stale_attempt``.

    ``local_world_size`` is how many of the job's ranks write through this node's daemon
    (torchrun's ``LOCAL_WORLD_SIZE``). None means ``world_size``: every rank is on this
    node. Below ``world_size``, the step spans nodes: this node's daemon writes a node
    marker once its ranks are done, and the daemon serving rank 0 promotes the step when
    the markers cover every rank (``docs/multinode.md``).

    ``run`` names the run of the job this rank belongs to (every rank of one run says
    the same; a restarted or requeued run says another, see
    ``orchestrator._run.run_identity``). A node joins, and counts, only an attempt of
    its own run: a ``tmp_step_N`` another run left behind is set aside by the leader
    before this run writes there, and a step another run still writes is refused.
    None: unsaid, as before runs were named.
    """

    root: PathStr
    step: Step
    rank: Rank
    world_size: WorldSize
    resent: bool = False
    attempt: AttemptId | None = None
    local_world_size: WorldSize | None = None
    run: RunId | None = None


class Done(_Request, frozen=True, tag="done"):
    """A rank's writes for the step have all landed.

    With ``attempt``, refused (``stale_attempt``) unless it is the step's current attempt.
    """

    root: PathStr
    step: Step
    rank: Rank
    files: Annotated[list[FileEntry], msgspec.Meta(max_length=_MAX_FILES)] = []
    attempt: AttemptId | None = None
    metrics: Metrics | None = None
    """The checkpoint's metrics (e.g. ``{"val_loss": 1.25}``), kept for retention's
    ``keep_best`` once the step is promoted; merged over the ranks' ``done``s."""


class Fail(_Request, frozen=True, tag="fail"):
    """A rank's save failed; the step must never be promoted.

    With ``attempt``, refused (``stale_attempt``) unless it is the step's current attempt:
    a rank of an earlier attempt cannot fail the one that replaced it.
    """

    root: PathStr
    step: Step
    rank: Rank
    reason: Reason
    attempt: AttemptId | None = None


class Wait(_Request, frozen=True, tag="wait"):
    """Reply once the step is promoted or failed, or after ``timeout`` seconds."""

    root: PathStr
    step: Step
    timeout: Seconds = 0.0


class Status(_Request, frozen=True, tag="status"):
    """Every save the daemon knows, optionally for one root only."""

    root: PathStr | None = None


class Latest(_Request, frozen=True, tag="latest"):
    """Path of the newest promoted step of ``root``."""

    root: PathStr


class Restore(_Request, frozen=True, tag="restore"):
    """Which step this rank of a restarting job loads, and from where (docs/tiers.md).

    Every rank of run ``run`` gets the same step: on a root with a fast tier, one
    daemon decides once every node has said what its tier holds; elsewhere, the
    root's newest promoted step. ``timeout``: how long to wait for the other nodes.
    ``driver``: asked by a job's driver, not a rank (NeMo-RL's): ``rank`` and
    ``world_size`` are not the saves', a fast-tier step counts if this node holds every
    rank's files of the world it was saved with (one node's job).
    """

    root: PathStr
    rank: Rank
    world_size: WorldSize
    local_world_size: WorldSize | None = None
    run: RunId | None = None
    timeout: Seconds = 60.0
    driver: bool = False


class Subscribe(_Request, frozen=True, tag="subscribe"):
    """Stream every event to this connection from now on."""


class Promote(_Request, frozen=True, tag="promote"):
    """Operator rescue: promote a step whose trainer died after its writes landed.

    Refused unless what can be verified on disk proves the step complete.
    """

    root: PathStr
    step: Step
    timeout: Seconds = 600.0


class Gc(_Request, frozen=True, tag="gc"):
    """List (and with ``remove`` delete) failed and orphaned tmp directories of ``root``."""

    root: PathStr
    remove: bool = False


class Health(_Request, frozen=True, tag="health"):
    """Whether the daemon can do its job, for probes (``ckptd health``).

    Answered from the event loop after checking that the journal can be written; never
    touches a checkpoint root, so a slow checkpoint filesystem never fails it.
    """


class Score(_Request, frozen=True, tag="score"):
    """Record metrics of a promoted step (an evaluation job scoring it later)."""

    root: PathStr
    step: Step
    metrics: Metrics


class Pin(_Request, frozen=True, tag="pin"):
    """Keep ``step`` whatever the retention policy says, until ``unpin``."""

    root: PathStr
    step: Step


class Unpin(_Request, frozen=True, tag="unpin"):
    """Undo ``pin``: the step is judged by the retention policy again."""

    root: PathStr
    step: Step


class Hold(_Request, frozen=True, tag="hold"):
    """Keep ``step`` for ``ttl`` seconds from now (a reader using it); ``ttl`` 0 releases."""

    root: PathStr
    step: Step
    ttl: HoldSeconds


class Retention(_Request, frozen=True, tag="retention"):
    """What the root's retention policy keeps and why; with ``apply``, run it now."""

    root: PathStr
    apply: bool = False


Request = (
    Ping
    | Begin
    | Done
    | Fail
    | Wait
    | Status
    | Latest
    | Restore
    | Subscribe
    | Gc
    | Promote
    | Score
    | Pin
    | Unpin
    | Hold
    | Retention
    | Health
)
"""Every message a client may send."""

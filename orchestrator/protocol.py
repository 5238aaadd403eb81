"""Wire protocol between trainers and the ckptd daemon.

Newline-delimited JSON over a Unix stream socket: one object per line, UTF-8, at most
:data:`MAX_LINE` bytes. Every request carries ``op`` and an integer ``id``; every reply
echoes ``id`` with ``ok`` and, when ``ok`` is false, ``error: {code, message}``. Events
pushed to a subscribed connection carry ``event`` instead of ``id``.

This module is shared by the daemon and the trainer-side client, so it depends on msgspec
alone: importing it never pulls in torch or the daemon. ``docs/protocol.md`` is the
reference for every op, field and error code.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal

import msgspec

__all__ = [
    "ATTEMPT_MARKER",
    "LAYOUT_FILE",
    "MAX_LINE",
    "MAX_REPLY",
    "PROTOCOL_VERSION",
    "Ack",
    "AttemptId",
    "AttemptMarker",
    "Begin",
    "BeginReply",
    "Done",
    "ErrorCode",
    "ErrorInfo",
    "ErrorReply",
    "Fail",
    "FileEntry",
    "Gc",
    "GcReply",
    "Health",
    "HealthReply",
    "Hold",
    "MetricName",
    "Metrics",
    "Pin",
    "RetentionInfo",
    "RetentionReply",
    "RetentionStep",
    "Score",
    "Unpin",
    "Latest",
    "LatestReply",
    "Ping",
    "Promote",
    "PingReply",
    "ProtocolError",
    "RankInfo",
    "RankState",
    "RootInfo",
    "Request",
    "Retention",
    "SaveInfo",
    "SaveState",
    "StallInfo",
    "Status",
    "StatusReply",
    "Subscribe",
    "Wait",
    "WaitReply",
    "decode_request",
    "default_socket_path",
    "encode",
]

MAX_LINE: Final = 1024 * 1024
"""Longest accepted line in bytes, newline included."""

PROTOCOL_VERSION: Final = 1
"""Bumped on any incompatible change to a message's shape."""

MAX_REPLY: Final = 256 * 1024 * 1024
"""Longest reply line a client must accept (a ``status`` of many large saves is long)."""

ATTEMPT_MARKER: Final = ".ckptd-attempt"
"""File in ``tmp_step_N`` naming the attempt that owns the directory (JSON,
:class:`AttemptMarker`); written by the daemon before it acknowledges a new attempt."""

LAYOUT_FILE: Final = ".ckptd-layout.json"
"""File in each configured root describing how its directories are named (JSON,
:class:`RootInfo`); written by the daemon at start, so that a client can name a step's
directory while the daemon is unreachable."""


def default_socket_path(env: Mapping[str, str] | None = None) -> str:
    """Where the daemon listens and clients connect when no path is given.

    ``$CKPTD_SOCKET``, else ``$XDG_RUNTIME_DIR/ckptd.sock``, else ``/run/ckptd/ckptd.sock``
    as root, else ``/tmp/ckptd-$UID/ckptd.sock``.
    """
    env = os.environ if env is None else env
    if env.get("CKPTD_SOCKET"):
        return env["CKPTD_SOCKET"]
    if env.get("XDG_RUNTIME_DIR"):
        return os.path.join(env["XDG_RUNTIME_DIR"], "ckptd.sock")
    if os.getuid() == 0:
        return "/run/ckptd/ckptd.sock"
    return f"/tmp/ckptd-{os.getuid()}/ckptd.sock"


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
"""An attempt's id: what the daemon put in the ``begin`` reply (1-64 of ``A-Za-z0-9._-``)."""
MetricName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.:/@+-]{1,128}$")]
"""A metric's name: 1-128 of ``A-Za-z0-9_.:/@+-`` (``val_loss``, ``val:accuracy``)."""
Metrics = Annotated[dict[MetricName, float], msgspec.Meta(max_length=256)]
"""Metrics of a checkpoint: name to number, at most 256 (non-finite values are refused)."""
HoldSeconds = Annotated[float, msgspec.Meta(ge=0, le=30 * 24 * 3600)]


class ErrorCode(enum.StrEnum):
    """Stable error codes carried in ``error.code``; see ``docs/protocol.md``."""

    BAD_JSON = "bad_json"
    """The line is not valid UTF-8 JSON."""
    BAD_REQUEST = "bad_request"
    """Valid JSON, but not an object with an ``op`` string and an integer ``id``."""
    UNKNOWN_OP = "unknown_op"
    """``op`` names no operation."""
    INVALID_FIELD = "invalid_field"
    """A field is missing, of the wrong type, or out of range."""
    LINE_TOO_LONG = "line_too_long"
    """The line exceeded :data:`MAX_LINE`; it was discarded up to its newline."""
    ROOT_NOT_CONFIGURED = "root_not_configured"
    """``root`` is not one of the daemon's configured roots."""
    PATH_ESCAPE = "path_escape"
    """A path leaves its root or checkpoint directory (``..``, absolute, or a symlink)."""
    RANK_OUT_OF_RANGE = "rank_out_of_range"
    """``rank`` is not below ``world_size``."""
    WORLD_SIZE_MISMATCH = "world_size_mismatch"
    """A rank announced a different ``world_size`` than the step already has."""
    ALREADY_PROMOTED = "already_promoted"
    """The step is already promoted; it cannot be begun or failed again."""
    STEP_FAILED = "step_failed"
    """The step has failed and will never be promoted."""
    NOT_BEGUN = "not_begun"
    """``done``/``fail`` for a rank that never sent ``begin`` for that step."""
    INVALID_STATE = "invalid_state"
    """The request does not fit the save's current state (e.g. ``fail`` after ``done``)."""
    STALE_ATTEMPT = "stale_attempt"
    """``begin``/``done``/``fail`` names an attempt that is not the step's current one (an
    earlier, failed or replaced run of the job); nothing was changed."""
    STEP_CLOSED = "step_closed"
    """``begin`` for a step that is being verified or promoted: no writer may join it."""
    NODE_CONFLICT = "node_conflict"
    """A save that spans nodes got a contradiction: a ``local_world_size`` unlike the
    step's, more ranks on a node than it said, or a rank claimed by two nodes."""
    UNVERIFIABLE = "unverifiable"
    """``promote`` refused: the files on disk do not prove the step complete."""
    NOT_FOUND = "not_found"
    """Nothing matches (e.g. ``latest`` for a root with no promoted step)."""
    FORBIDDEN = "forbidden"
    """The connecting process's uid/gid is not allowed; the connection is closed."""
    TOO_BUSY = "too_busy"
    """A per-connection or per-daemon bound was reached; retry later."""
    UNAVAILABLE = "unavailable"
    """The daemon could not make the change durable (e.g. its state disk is full); the
    request was not acknowledged and may be retried."""
    SHUTTING_DOWN = "shutting_down"
    """The daemon is stopping and accepts no new saves."""
    INTERNAL = "internal"
    """An unexpected daemon error; the daemon logged it."""


class SaveState(enum.StrEnum):
    """Life of one checkpoint step; ``docs/protocol.md`` draws the state machine."""

    OPEN = "open"
    VERIFYING = "verifying"
    PROMOTING = "promoting"
    PROMOTED = "promoted"
    FAILED = "failed"


class RankState(enum.StrEnum):
    """One rank's part in a step."""

    WRITING = "writing"
    DONE = "done"
    FAILED = "failed"


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
    """

    root: PathStr
    step: Step
    rank: Rank
    world_size: WorldSize
    resent: bool = False
    attempt: AttemptId | None = None
    local_world_size: WorldSize | None = None


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


class RootInfo(msgspec.Struct, frozen=True):
    """A configured root and how its directories are named."""

    path: str
    tmp_prefix: str
    final_prefix: str
    pointer: str


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


_request_decoder: Final = msgspec.json.Decoder(Request)
_envelope_decoder: Final = msgspec.json.Decoder(dict[str, msgspec.Raw])
_encoder: Final = msgspec.json.Encoder()
_OPS: Final = frozenset(
    str(t.__struct_config__.tag)
    for t in (
        Ping,
        Begin,
        Done,
        Fail,
        Wait,
        Status,
        Latest,
        Subscribe,
        Gc,
        Promote,
        Score,
        Pin,
        Unpin,
        Hold,
        Retention,
        Health,
    )
)


class ProtocolError(ValueError):
    """Raised by :func:`decode_request` for a line that is not a valid request.

    Attributes:
        code: The :class:`ErrorCode` for the reply.
        request_id: The request's ``id`` if one could be read, else None.
    """

    def __init__(self, code: ErrorCode, message: str, request_id: int | None) -> None:
        super().__init__(message)
        self.code = code
        self.request_id = request_id


def decode_request(line: bytes) -> Request:
    """Decode one line into a typed request.

    Args:
        line: One frame, with or without its trailing newline.

    Returns:
        The request.

    Raises:
        ProtocolError: The line is not UTF-8 JSON, not an object with ``op`` and ``id``,
            names an unknown op, or has a missing, mistyped or out-of-range field.
    """
    try:
        # msgspec skips unknown fields without looking at them; the whole line must
        # still be UTF-8, as the protocol says.
        line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(ErrorCode.BAD_JSON, f"not valid UTF-8: {exc}", None) from None
    try:
        return _request_decoder.decode(line)
    except msgspec.ValidationError as exc:
        raise _classify(line, exc) from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(ErrorCode.BAD_JSON, f"not valid JSON: {exc}", None) from None
    except RecursionError:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "JSON nested too deeply", None) from None


def _classify(line: bytes, exc: msgspec.ValidationError) -> ProtocolError:
    # Only on the error path: look at the envelope to say precisely what is wrong. Field
    # values stay raw, so an unreadable value elsewhere cannot hide the op and id.
    try:  # the typed decoder may have stopped at a type mismatch before a syntax error
        msgspec.json.decode(line)
    except msgspec.ValidationError:  # e.g. a number out of range: valid syntax
        pass
    except msgspec.DecodeError as err:
        return ProtocolError(ErrorCode.BAD_JSON, f"not valid JSON: {err}", None)
    except RecursionError:
        return ProtocolError(ErrorCode.BAD_REQUEST, "JSON nested too deeply", None)
    try:
        raw = _envelope_decoder.decode(line)
    except (msgspec.DecodeError, RecursionError):
        return ProtocolError(ErrorCode.BAD_REQUEST, "a request must be a JSON object", None)
    request_id = _raw_value(raw.get("id"))
    if type(request_id) is not int or not -_I64 <= request_id <= _I64:
        request_id = None
    op = _raw_value(raw.get("op"))
    if not isinstance(op, str):
        return ProtocolError(ErrorCode.BAD_REQUEST, 'a request needs an "op" string', request_id)
    if op not in _OPS:
        known = ", ".join(sorted(_OPS))
        return ProtocolError(
            ErrorCode.UNKNOWN_OP, f"unknown op {op!r}; known ops: {known}", request_id
        )
    if request_id is None:
        return ProtocolError(ErrorCode.BAD_REQUEST, 'a request needs an integer "id"', None)
    return ProtocolError(ErrorCode.INVALID_FIELD, str(exc), request_id)


def _raw_value(raw: msgspec.Raw | None) -> Any:
    if raw is None:
        return None
    try:
        return msgspec.json.decode(raw, type=int | str | float | bool | None)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


def encode(message: msgspec.Struct | dict[str, Any]) -> bytes:
    """Encode one message as a JSON line, newline included."""
    buf = _encoder.encode(message)
    return buf + b"\n"

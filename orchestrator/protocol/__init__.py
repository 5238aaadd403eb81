"""Wire protocol between trainers and the ckptd daemon.

Newline-delimited JSON over a Unix stream socket: one object per line, UTF-8, at most
:data:`MAX_LINE` bytes. Every request carries ``op`` and an integer ``id``; every reply
echoes ``id`` with ``ok`` and, when ``ok`` is false, ``error: {code, message}``. Events
pushed to a subscribed connection carry ``event`` instead of ``id``.

This package is shared by the daemon and the trainer-side client, so it depends on msgspec
alone: importing it never pulls in torch or the daemon. ``docs/protocol.md`` is the
reference for every op, field and error code. Its parts: the fixed values and codes
(``_constants.py``), the requests (``_requests.py``), the order of runs
(``_runs.py``), the replies and the records they
carry (``_replies.py``), and decoding and encoding lines (``_codec.py``); every name is
imported from here.
"""

from __future__ import annotations

from ._codec import ProtocolError, decode_request, encode
from ._constants import (
    ATTEMPT_MARKER,
    LAYOUT_FILE,
    MAX_LINE,
    MAX_REPLY,
    PROTOCOL_VERSION,
    TIER_RUN_FILE,
    ErrorCode,
    RankState,
    SaveState,
    default_socket_path,
)
from ._replies import (
    Ack,
    AttemptMarker,
    BeginReply,
    ErrorInfo,
    ErrorReply,
    GcReply,
    HealthReply,
    LatestReply,
    PingReply,
    RankInfo,
    RestoreReply,
    RetentionInfo,
    RetentionReply,
    RetentionStep,
    RootInfo,
    SaveInfo,
    StallInfo,
    StatusReply,
    WaitReply,
)
from ._requests import (
    AttemptId,
    Begin,
    Done,
    Fail,
    FileEntry,
    Gc,
    Health,
    Hold,
    Latest,
    MetricName,
    Metrics,
    Pin,
    Ping,
    Promote,
    Request,
    Restore,
    Retention,
    RunId,
    Score,
    Status,
    Subscribe,
    Unpin,
    Wait,
)

# The field types of requests, importable from here as they were from the single module.
from ._requests import HoldSeconds as HoldSeconds
from ._requests import PathStr as PathStr
from ._requests import Rank as Rank
from ._requests import Reason as Reason
from ._requests import RequestId as RequestId
from ._requests import Seconds as Seconds
from ._requests import Step as Step
from ._requests import WorldSize as WorldSize
from ._runs import LaunchRun, launch_run, run_supersedes

__all__ = [
    "ATTEMPT_MARKER",
    "TIER_RUN_FILE",
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
    "RunId",
    "Score",
    "Unpin",
    "LaunchRun",
    "Latest",
    "LatestReply",
    "RestoreReply",
    "Ping",
    "Promote",
    "PingReply",
    "ProtocolError",
    "RankInfo",
    "RankState",
    "RootInfo",
    "Request",
    "Restore",
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
    "launch_run",
    "run_supersedes",
]

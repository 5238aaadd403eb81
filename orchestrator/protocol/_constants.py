"""The protocol's fixed vocabulary: limits, file names, the socket's default path, codes.

Everything here is a value both sides agree on without a message: the size bounds of a
line, the names of the files the daemon writes into a root, where the socket is by
default, and the enumerations messages carry (error codes, save and rank states).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from typing import Final

__all__ = [
    "ATTEMPT_MARKER",
    "LAYOUT_FILE",
    "TIER_RUN_FILE",
    "MAX_LINE",
    "MAX_REPLY",
    "PROTOCOL_VERSION",
    "ErrorCode",
    "RankState",
    "SaveState",
    "default_socket_path",
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

TIER_RUN_FILE: Final = ".ckptd-tier/run"
"""File in a fast tier's ``tmp_step_N`` naming the run whose save the directory is (the
run's id, UTF-8). The daemon writes it at the step's first ``begin``; a driver that writes
its own files there before its workers begin (NeMo-RL's) writes it first, so that the
daemon keeps those files for that run and removes any other run's."""


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
    RUN_CONFLICT = "run_conflict"
    """``begin`` of one run for a step whose attempt another run of the job (``run``) is
    still writing: a requeued run never joins the run it replaced; it starts the step
    over once that attempt failed."""
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

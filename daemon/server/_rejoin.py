"""Re-sent begins of saves the ledger does not know: the root says what they belong to.

A client re-sends a ``begin`` naming its attempt after every reconnect, for its saves in
flight and for its last few ended ones (``orchestrator._channel``). A daemon that kept its
journal knows them. One that started on an empty state directory (a Slurm prolog wipes
it on every job, a pod's ``emptyDir`` is new on every restart) does not, and must decide
as the one with the journal would (DESIGN invariant 10): from the root.

- ``tmp_step_N``'s attempt marker names that attempt, of the same run: the daemon takes
  the attempt over as it stands, with the time the marker records as its start (so
  ``save_timeout`` counts from the attempt's real beginning), and every rank that
  re-sends joins it. Nothing on the root is moved.
- ``step_N``'s manifest names that attempt: it is promoted; the answer says so.
- Neither: the attempt is gone (failed and set aside, or removed by hand or by gc).
  The begin is refused as stale; nothing is created for it.

A first one-node ``begin`` (no attempt named) of a run whose attempt ``tmp_step_N``'s
marker names joins that attempt (a node of a spanning save joins its leader's attempt as
``daemon/nodes`` decides, and a re-sent ``begin`` of one is refused if the leader's
verdict failed it): another rank of the same run began it and had it acknowledged by the
daemon that lost its state. Without a run identity the root cannot tell a live attempt
from a dead one, and such a ``begin`` starts a new attempt as before (the documented
limit of unnamed runs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime

from orchestrator import protocol as p

from ..base._errors import RequestError, VerificationError
from ..config._config import RootConfig
from ..store._storage import Storage

__all__ = ["Rejoin", "rejoin"]


@dataclass(frozen=True, slots=True)
class Rejoin:
    """What the root says of a re-sent begin's attempt.

    Attributes:
        attempt: The attempt to take over (``tmp_step_N`` is still its).
        age_s: Seconds since the attempt began, by its marker (0 if unreadable).
        promoted: ``step_N`` is this attempt's promotion: answer so, take nothing over.
    """

    attempt: str
    age_s: float = 0.0
    promoted: bool = False


def rejoin(storage: Storage, root: RootConfig, request: p.Begin) -> Rejoin | None:
    """Find ``request``'s attempt on the root. Blocking I/O: run it in the root's lane.

    For a ``begin`` of a step the ledger does not know. One naming an attempt (re-sent
    after a reconnect) must find it; one without but with a run joins the attempt
    ``tmp_step_N``'s marker names if that is of the same run and world size (another
    rank of the run began it, and this daemon's record of that was lost).

    Args:
        storage: The root's storage.
        root: The root.
        request: The ``begin``.

    Returns:
        The attempt to take over, or None to begin as if the root held nothing of the
        run (a new attempt; whatever is in the way is set aside as before).

    Raises:
        RequestError: ``stale_attempt`` when a named attempt is neither ``tmp_step_N``'s
            nor ``step_N``'s, or ``run_conflict`` when its marker names another run.
    """
    if not request.attempt and not request.run:
        return None  # an unnamed run: the root cannot tell its attempts apart
    spans = request.local_world_size is not None and request.local_world_size < request.world_size
    if not request.attempt and spans:
        return None  # a node joins a spanning attempt by its leader's marker (nodes/)
    marker = storage.read_attempt(root.tmp_dir(request.step))
    if not request.attempt:
        if (
            marker is not None
            and marker.run == request.run
            and marker.world_size == request.world_size
        ):
            return Rejoin(attempt=marker.attempt, age_s=_age(marker.created))
        return None
    attempt = request.attempt
    if marker is not None and marker.attempt == attempt:
        if (marker.run or "") != (request.run or ""):
            raise RequestError(
                p.ErrorCode.RUN_CONFLICT,
                f"attempt {attempt} of step {request.step} belongs to run "
                f"{marker.run or '(unnamed)'}, not {request.run or '(unnamed)'}",
            )
        verdict = storage.read_verdict(root, request.step, attempt) if spans else None
        if verdict is not None and verdict.state == "failed":
            raise RequestError(
                p.ErrorCode.STEP_FAILED,
                f"attempt {attempt} of step {request.step} failed: {verdict.reason}",
            )
        return Rejoin(attempt=attempt, age_s=_age(marker.created))
    if storage.promoted(root, request.step):
        try:
            manifest = storage.read_manifest(root.final_dir(request.step))
        except VerificationError:
            manifest = None
        if manifest is not None and manifest.attempt == attempt:
            return Rejoin(attempt=attempt, promoted=True)
    raise RequestError(
        p.ErrorCode.STALE_ATTEMPT,
        f"attempt {attempt} of step {request.step} is no longer on {root.path}: neither "
        f"{root.tmp_dir(request.step)} nor {root.final_dir(request.step)} is its (it failed "
        "and was set aside, or was removed)",
    )


def _age(created: str) -> float:
    try:
        began = datetime.fromisoformat(created).timestamp()
    except ValueError:
        return 0.0
    return max(0.0, time.time() - began)

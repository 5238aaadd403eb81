"""The ``gc`` request: list what a root may lose and, with ``remove``, doom it.

A ``gc`` does its slow parts where they delay nobody: the walk that finds the orphans
that nothing modified for ``save_timeout`` runs in a worker thread before the root's lock
is taken; the deletion runs in the background afterwards (``_trash``). Under the lock
there are only the renames into ``ROOT/.ckptd-trash/delete/`` and the ledger forgetting
the removed failed steps, so a promotion in the root waits for a few renames at most.
While gc takes a step, a ``begin`` for it is refused (``Daemon._collecting``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Final

from orchestrator import protocol as p

from . import _gc
from ._config import RootConfig
from ._errors import RequestError
from ._faults import crash_point
from ._ledger import SaveKey, SaveRecord

if TYPE_CHECKING:
    from ._server import Daemon

__all__ = ["collect"]

ORPHAN_AGE: Final = 3600.0
"""Seconds an unknown tmp directory must be untouched when ``save_timeout`` is off."""

_SETTLED: Final = (p.SaveState.PROMOTED, p.SaveState.FAILED)


async def collect(daemon: Daemon, request_id: int, root: RootConfig, remove: bool) -> p.GcReply:
    """Answer ``gc`` for ``root``: the candidates and, with ``remove``, doom them.

    Candidates are the failed steps (whether or not their tmp directory still exists),
    the unknown tmp directories nothing modified for ``save_timeout``, and the failed
    attempts set aside in the root's trash, except those of a step in flight.

    Raises:
        RequestError: (``unavailable``) the removal could not be journaled;
            (``invalid_state``) an entry could not be moved into the trash; the others
            were removed.
    """
    failed = {s.key.step for s in _saves_of(daemon, root) if s.state is p.SaveState.FAILED}
    active = _active_steps(daemon, root)
    # An unknown tmp dir counts as orphaned only once it could no longer be a save whose
    # ranks write before they begin.
    min_age = daemon.config.save_timeout or ORPHAN_AGE
    lanes = daemon.lanes
    on_disk = await lanes.run(
        root.path, _gc.candidates, root, failed, active, min_age, abandon=True
    )
    kept = await lanes.run(root.path, _gc.set_aside, root, abandon=True)
    # A failed save with no directory left is still listed, so gc can clear it.
    steps = sorted(set(on_disk) | failed)
    kept = [k for k in kept if k.step not in active]
    removed = False
    if remove and (steps or kept):
        steps, kept = await _remove(daemon, root, steps, kept)
        removed = bool(steps or kept)
    trash = os.path.join(root.path, _gc.TRASH)
    return p.GcReply(
        id=request_id,
        candidates=[root.tmp_dir(step) for step in steps],
        removed=removed,
        set_aside=[os.path.join(trash, k.name) for k in kept],
    )


async def _remove(
    daemon: Daemon, root: RootConfig, steps: list[int], kept: list[_gc.KeptEntry]
) -> tuple[list[int], list[_gc.KeptEntry]]:
    """Doom ``steps``' tmp directories and ``kept``, forget the steps, start deletion.

    Returns:
        The steps and kept entries actually removed.
    """
    keys = {SaveKey(root.path, step) for step in steps}
    async with daemon.root_locks[root.path]:
        daemon._collecting |= keys  # from here on, begin refuses these steps
        try:
            # A begin or a rescue may have come in since the candidates were listed.
            active = _active_steps(daemon, root)
            steps = [step for step in steps if step not in active]
            kept = [k for k in kept if k.step not in active]
            names = [k.name for k in kept]
            try:
                moved, refused = await daemon.lanes.run(root.path, _gc.doom, root, steps, names)
            except OSError as exc:
                raise RequestError(
                    p.ErrorCode.INVALID_STATE,
                    f"cannot create {_gc.doomed_dir(root)}: {exc.strerror or exc}",
                ) from None
            steps = [step for step in steps if root.tmp_dir(step) not in refused]
            kept = [k for k in kept if os.path.join(root.path, _gc.TRASH, k.name) not in refused]
            for step in steps:
                daemon.ledger.forget(SaveKey(root.path, step))
        finally:
            daemon._collecting -= keys
    problems = [f"cannot move {path} into the trash: {why}" for path, why in refused.items()]
    if moved:
        try:
            await daemon.lanes.run(root.path, _gc.sync_doomed, root)
        except OSError as exc:
            problems.append(f"the renames into the trash may not be durable: {exc.strerror}")
    crash_point("gc_after_doom")
    try:
        await daemon.commit([])
    finally:
        daemon.trash.kick(root)  # the renames happened, whether journaled or not
    daemon.events.emit("gc.removed", root=root.path, steps=steps, set_aside=[k.name for k in kept])
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise RequestError(
            p.ErrorCode.INVALID_STATE, f"{problems[0]}{more}; the other candidates were removed"
        )
    return steps, kept


def _saves_of(daemon: Daemon, root: RootConfig) -> list[SaveRecord]:
    return [s for s in daemon.ledger if s.key.root == root.path]


def _active_steps(daemon: Daemon, root: RootConfig) -> set[int]:
    return {s.key.step for s in _saves_of(daemon, root) if s.state not in _SETTLED}

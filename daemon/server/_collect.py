"""The ``gc`` request: list what a root may lose and, with ``remove``, doom it.

What a failed step leaves is where its attempt's directory went: normally its kept entry
in the trash (set aside when it failed: the ledger's ``SaveRecord.set_aside``, or, when
the journal that recorded it is lost, the entry whose name
``<tmp prefix>N.attempt-<id>-<suffix>`` names the attempt); ``tmp_step_N`` only if it
could not be set aside; nothing at all once both are gone.
Removing what is left of a failed step makes the daemon forget it, so the step can be
saved again.

A ``gc`` does its slow parts where they delay nobody: the walk that finds the orphans
that nothing modified for ``save_timeout`` runs in a worker thread before the root's lock
is taken; the deletion runs in the background afterwards (``_trash``). Under the lock
there are only the renames into ``ROOT/.ckptd-trash/delete/`` and the ledger forgetting
the removed failed steps, so a promotion in the root waits for a few renames at most.
While gc takes a step's tmp directory, a ``begin`` for it is refused
(``Daemon.collecting``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Final

from orchestrator import protocol as p

from ..base._errors import RequestError
from ..base._faults import crash_point
from ..config._config import RootConfig
from ..host._host import Collecting
from ..ledger._ledger import SaveKey, SaveRecord
from ..store import _gc

__all__ = ["collect"]

ORPHAN_AGE: Final = 3600.0
"""Seconds an unknown tmp directory must be untouched when ``save_timeout`` is off."""

_SETTLED: Final = (p.SaveState.PROMOTED, p.SaveState.FAILED)


@dataclass(slots=True)
class _Step:
    """What gc takes of one step, and what the ledger said of the step when it looked."""

    record: SaveRecord | None
    state: p.SaveState | None
    set_aside: str | None
    tmp: bool = False
    """Its ``tmp_step_N`` goes."""
    kept: list[_gc.KeptEntry] = field(default_factory=list)
    """Its kept trash entries that go."""
    absent: bool = False
    """A failed step with nothing left on disk: only forgotten."""
    forget: frozenset[str] | None = None
    """For a failed step: the paths whose removal forgets it (None: it is not forgotten)."""
    forgotten: bool = False

    def unchanged(self, now: SaveRecord | None) -> bool:
        """Whether the ledger's record of the step is still the one that was looked at."""
        if now is not self.record:
            return False
        return now is None or (now.state, now.set_aside) == (self.state, self.set_aside)


async def collect(daemon: Collecting, request_id: int, root: RootConfig, remove: bool) -> p.GcReply:
    """Answer ``gc`` for ``root``: the candidates and, with ``remove``, doom them.

    Candidates are the tmp directories of steps not in flight that are a failed
    attempt's or that nothing modified for ``save_timeout``, the kept entries of the
    trash (failed attempts set aside) of steps not in flight, and the failed steps with
    nothing left on disk.

    Raises:
        RequestError: (``unavailable``) the removal could not be journaled;
            (``invalid_state``) an entry could not be moved into the trash; the others
            were removed.
    """
    plan = await _plan(daemon, root)
    removed = False
    if remove and plan:
        plan = await _remove(daemon, root, plan)
        removed = bool(plan)
    trash = os.path.join(root.path, _gc.TRASH)
    steps = sorted(plan.items())
    return p.GcReply(
        id=request_id,
        candidates=[root.tmp_dir(n) for n, s in steps if s.tmp or s.absent],
        removed=removed,
        set_aside=[os.path.join(trash, k.name) for _, s in steps for k in s.kept],
        absent=[root.tmp_dir(n) for n, s in steps if s.absent],
    )


async def _plan(daemon: Collecting, root: RootConfig) -> dict[int, _Step]:
    """What gc would take of ``root``, by step."""
    saves = {s.key.step: s for s in _saves_of(daemon, root)}
    seen = {n: (s, s.state, s.set_aside) for n, s in saves.items()}
    busy = _busy_steps(daemon, root)
    # A failed save that spans nodes leaves a directory shared with the other nodes:
    # only its leader takes it (when it sets it aside); elsewhere it is not this daemon's.
    failed = {
        n: s
        for n, s in saves.items()
        if s.state is p.SaveState.FAILED and n not in busy and (not s.spans or s.leader)
    }
    attempts = {n: s.attempt for n, s in failed.items()}
    # An unknown tmp dir counts as orphaned only once it could no longer be a save whose
    # ranks write before they begin.
    min_age = daemon.config.save_timeout or ORPHAN_AGE
    lanes, storage = daemon.lanes, daemon.storage
    dirs = await lanes.run(root.path, storage.tmp_dirs, root, attempts, busy, min_age, abandon=True)
    kept = await lanes.run(root.path, storage.kept_entries, root, abandon=True)
    plan: dict[int, _Step] = {}

    def at(step: int) -> _Step:
        if step not in plan:
            plan[step] = _Step(*seen.get(step, (None, None, None)))
        return plan[step]

    for found in dirs:
        if found.qualifies:
            at(found.step).tmp = True
    for entry in kept:
        if entry.step not in busy:  # never while the step is in flight or being reported
            at(entry.step).kept.append(entry)
    trash = os.path.join(root.path, _gc.TRASH)
    on_disk = {d.step: d for d in dirs}
    for step, save in failed.items():
        own = {root.tmp_dir(step)} if step in on_disk and on_disk[step].failed else set()
        own |= {
            os.path.join(trash, k.name)
            for k in kept
            if k.step == step and _owned_by(save, os.path.join(trash, k.name), k)
        }
        if own:
            at(step).forget = frozenset(own)
        elif step not in on_disk:
            gone = at(step)
            gone.absent, gone.forget = True, frozenset()
        elif on_disk[step].qualifies:
            # Nothing of the failed attempt is left; an orphan took its directory's name.
            at(step).forget = frozenset({root.tmp_dir(step)})
        # else: a trainer is writing tmp_step_N again; its begin replaces the failed save.
    return plan


def _owned_by(save: SaveRecord, path: str, entry: _gc.KeptEntry) -> bool:
    """Whether kept ``entry`` (at ``path``) is failed ``save``'s attempt's directory."""
    # The ledger knows where it went unless the journal lost the record; the name then
    # still says whose it is (an attempt without an id has none to match).
    return path == save.set_aside or (bool(save.attempt) and entry.attempt == save.attempt)


async def _remove(daemon: Collecting, root: RootConfig, plan: dict[int, _Step]) -> dict[int, _Step]:
    """Doom what ``plan`` takes, forget its failed steps, start deletion.

    Returns:
        What was actually removed (and forgotten), by step.
    """
    trash = os.path.join(root.path, _gc.TRASH)
    keys = {SaveKey(root.path, n) for n, s in plan.items() if s.tmp}
    async with daemon.root_locks[root.path]:
        daemon.collecting.update(keys)  # from here on, begin refuses these steps
        try:
            # Since the plan was made, a begin may have started an attempt, a failure may
            # be moving its directory aside, or a ``promote`` (which restores a set-aside
            # attempt and verifies it under this lock) may have taken the step: such a
            # step is left for the next gc.
            busy = _busy_steps(daemon, root)
            plan = {
                n: s
                for n, s in plan.items()
                if n not in busy and s.unchanged(daemon.ledger.get(SaveKey(root.path, n)))
            }
            if not plan:
                return plan  # nothing renamed, nothing to journal or report
            steps = [n for n, s in plan.items() if s.tmp]
            names = [k.name for s in plan.values() for k in s.kept]
            try:
                moved, refused = await daemon.lanes.run(
                    root.path, daemon.storage.doom, root, steps, names
                )
            except OSError as exc:
                raise RequestError(
                    p.ErrorCode.INVALID_STATE,
                    f"cannot create {_gc.doomed_dir(root)}: {exc.strerror or exc}",
                ) from None
            for step, taken in list(plan.items()):
                taken.tmp = taken.tmp and root.tmp_dir(step) not in refused
                taken.kept = [k for k in taken.kept if os.path.join(trash, k.name) not in refused]
                if taken.forget is not None and not taken.forget & refused.keys():
                    key = SaveKey(root.path, step)
                    if daemon.ledger.get(key) is taken.record:
                        daemon.ledger.forget(key)
                        taken.forgotten = True
                taken.absent = taken.absent and taken.forgotten
                if not (taken.tmp or taken.kept or taken.forgotten):
                    del plan[step]
        finally:
            daemon.collecting.difference_update(keys)
    problems = [f"cannot move {path} into the trash: {why}" for path, why in refused.items()]
    if moved:
        try:
            await daemon.lanes.run(root.path, daemon.storage.sync_doomed, root)
        except OSError as exc:
            problems.append(f"the renames into the trash may not be durable: {exc.strerror}")
    crash_point("gc_after_doom")
    try:
        await daemon.commit([])
    finally:
        daemon.trash.kick(root)  # the renames happened, whether journaled or not
    daemon.events.emit(
        "gc.removed",
        root=root.path,
        steps=[n for n, s in sorted(plan.items()) if s.tmp],
        set_aside=[k.name for _, s in sorted(plan.items()) for k in s.kept],
        forgotten=[n for n, s in sorted(plan.items()) if s.forgotten],
    )
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise RequestError(
            p.ErrorCode.INVALID_STATE, f"{problems[0]}{more}; the other candidates were removed"
        )
    return plan


def _saves_of(daemon: Collecting, root: RootConfig) -> list[SaveRecord]:
    return [s for s in daemon.ledger if s.key.root == root.path]


def _busy_steps(daemon: Collecting, root: RootConfig) -> set[int]:
    """Steps gc leaves alone: a save in flight, or a failure still being set aside."""
    return {
        s.key.step
        for s in _saves_of(daemon, root)
        if s.state not in _SETTLED or daemon.attempt_dirs.reporting(s.key)
    }

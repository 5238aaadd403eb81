"""Recovery: rebuild the ledger from the journal and finish what a crash left half done."""

from __future__ import annotations

import errno
import time
from collections.abc import Iterable
from functools import partial
from typing import Final

from orchestrator import protocol as p

from ..base._errors import RequestError
from ..config._config import RootConfig
from ..host._host import Recovering
from ..ledger._ledger import SaveKey
from ..ledger._records import Replay
from ..nodes._rescue import done_on_root

__all__ = ["recover", "scan_roots"]

_SCAN_WAIT: Final = 1.0
"""Seconds start-up waits for the roots' orphan scans (milliseconds on a healthy root)."""


async def recover(daemon: Recovering, replay: Replay) -> None:
    """Replay ``replay`` into ``daemon``'s ledger, then resume and report.

    Saves in flight get their ranks' leases re-armed (ranks that reconnect and send
    ``done`` complete them); saves whose ranks were all done are verified again; a
    promotion whose intent was journaled is finished exactly once. The journal is then
    compacted to the recovered state. Unknown ``tmp_step_*`` directories are reported as
    orphans; one whose node markers say every rank was done is promoted from them on the
    node that holds rank 0 (its journal was lost), any other is never touched. Each root
    is scanned in its own lane, and one whose scan has not returned within a second (a
    hung filesystem) is scanned on in the background rather than waited for
    (``unscanned`` in ``daemon.recovered``).
    """
    ledger = daemon.ledger
    now, wall = daemon.clock(), time.time()
    skipped = 0
    for record in replay.records:
        if daemon.retention.replay(record):
            continue  # metrics, pins, holds, retirements
        at = getattr(record, "at", wall)
        try:
            ledger.replay(record, now - (wall - at))
        except (RequestError, RuntimeError):
            skipped += 1  # a duplicate a compaction kept; the state already has it
    daemon.apply(ledger.rearm(now))
    daemon.apply(ledger.resume())  # spanning saves: write or watch their node markers
    if daemon.journal is not None:
        await daemon.journal.lane.run(daemon.journal.compact, daemon.journal_snapshot())
    resumed = [s.key for s in ledger if s.state in (p.SaveState.VERIFYING, p.SaveState.PROMOTING)]
    for key in resumed:
        daemon.promoter.start(key)
    # Each root is scanned in its own lane. One whose scan has not returned within
    # _SCAN_WAIT (a hung filesystem) is scanned on in the background and reports its
    # orphans when it answers; the daemon does not wait for it to serve the others.
    found, set_aside, unscanned = await scan_roots(daemon, daemon.config.roots)
    daemon.events.emit(
        "daemon.recovered",
        records=len(replay.records),
        skipped=skipped,
        dropped_bytes=replay.dropped_bytes,
        problem=replay.problem,
        saves=len(ledger),
        in_flight=sum(1 for s in ledger if s.state is p.SaveState.OPEN),
        resumed=len(resumed),
        set_aside=len(set_aside),
        orphans=len(found),
        unscanned=unscanned,
    )


async def scan_roots(
    daemon: Recovering, roots: Iterable[RootConfig]
) -> tuple[list[int], list[int], list[str]]:
    """Scan each root in its own lane (:func:`_scan_root`), waiting for each a second at most.

    Returns:
        The orphaned steps found, the failed steps set aside, and the roots whose scan
        had not returned in time (it goes on in the background).
    """
    found: list[int] = []
    set_aside: list[int] = []
    scans = {r.path: partial(_scan_root, daemon, r, found, set_aside) for r in roots}
    unscanned = await daemon.lanes.settle(scans, _SCAN_WAIT)
    return found, set_aside, unscanned


async def _scan_root(
    daemon: Recovering, root: RootConfig, found: list[int], set_aside: list[int]
) -> None:
    """Write ``root``'s layout file, set aside its failed attempts, report its orphans.

    A failure journaled before its attempt's directory was set aside (a crash between
    the two, or a journal from before attempts) is set aside here; a ``begin`` that
    comes first sets it aside itself, by its marker. Each ``tmp_step_N`` the ledger does
    not know is reported (``save.orphaned``) and added to ``found``.
    """
    try:
        await daemon.lanes.run(root.path, daemon.storage.write_layout, root)
    except OSError as exc:
        error = exc.strerror or str(exc)
        if root.on_object_store:
            # The probe of the store failed: its requests fail with this, others go on.
            refused = exc.errno == errno.EPROTO  # it ignores conditional writes
            daemon.events.emit(
                "root.store_unusable", "error", root=root.path, error=error, refused=refused
            )
        else:
            # Clients then fall back to the default names while the daemon is down.
            daemon.events.emit("root.layout_failed", "warning", root=root.path, error=error)
    try:
        steps = await daemon.lanes.run(
            root.path, daemon.storage.unknown_tmp_dirs, root, (), abandon=True
        )
    except OSError as exc:
        error = exc.strerror or str(exc)
        daemon.events.emit("root.scan_failed", "warning", root=root.path, error=error)
        return
    for step in steps:
        # Looked up once the scan returned: a save begun meanwhile is no orphan.
        key = SaveKey(root.path, step)
        save = daemon.ledger.get(key)
        # Only the leader sets aside a shared directory (spanning saves).
        mine = save is not None and (not save.spans or save.leader)
        if save is not None and save.state is p.SaveState.FAILED and save.set_aside is None:
            if not mine:
                continue
            if save.spans:  # the other nodes read the failure there, once it is set aside
                await daemon.nodes.write_verdict(root, key, save.attempt, save.reason or "")
            if await daemon.attempt_dirs.set_aside(key, save.attempt) is not None:
                set_aside.append(step)
        elif save is None:
            found.append(step)
            daemon.events.emit(
                "save.orphaned", "warning", root=root.path, step=step, path=root.tmp_dir(step)
            )
            if await done_on_root(daemon, root, step) and daemon.ledger.get(key) is None:
                await daemon.finish_orphan(root, step)

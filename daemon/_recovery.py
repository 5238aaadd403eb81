"""Recovery: rebuild the ledger from the journal and finish what a crash left half done."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import anyio

from orchestrator import protocol as p

from . import _gc
from ._errors import RequestError
from ._journal import Replay
from ._layout import write_layout

if TYPE_CHECKING:
    from ._server import Daemon

__all__ = ["recover"]


async def recover(daemon: Daemon, replay: Replay) -> None:
    """Replay ``replay`` into ``daemon``'s ledger, then resume and report.

    Saves in flight get their ranks' leases re-armed (ranks that reconnect and send
    ``done`` complete them); saves whose ranks were all done are verified again; a
    promotion whose intent was journaled is finished exactly once. Unknown
    ``tmp_step_*`` directories are reported as orphans, never touched. The journal is
    then compacted to the recovered state.
    """
    ledger = daemon.ledger
    now, wall = daemon.clock(), time.time()
    skipped = 0
    for record in replay.records:
        at = getattr(record, "at", wall)
        try:
            ledger.replay(record, now - (wall - at))
        except (RequestError, RuntimeError):
            skipped += 1  # a duplicate a compaction kept; the state already has it
    daemon.apply(ledger.rearm(now))
    # A failure journaled before its attempt's directory was set aside (a crash between
    # the two, or a journal from before attempts): set it aside now, before any begin.
    for root in daemon.config.roots:
        try:
            await anyio.to_thread.run_sync(write_layout, root)
        except OSError as exc:
            # Clients then fall back to the default names while the daemon is down.
            daemon.events.emit(
                "root.layout_failed", "warning", root=root.path, error=exc.strerror or str(exc)
            )
    on_disk = {
        root.path: set(await anyio.to_thread.run_sync(_gc.unknown_tmp_dirs, root, ()))
        for root in daemon.config.roots
    }
    set_aside = 0
    for save in list(ledger):
        if save.state is not p.SaveState.FAILED or save.set_aside is not None:
            continue
        if save.key.step in on_disk.get(save.key.root, ()):
            if await daemon.attempt_dirs.set_aside(save.key, save.attempt) is not None:
                set_aside += 1
                on_disk[save.key.root].discard(save.key.step)
    if daemon.journal is not None:
        await anyio.to_thread.run_sync(daemon.journal.compact, daemon.journal_snapshot())
    resumed = [s.key for s in ledger if s.state in (p.SaveState.VERIFYING, p.SaveState.PROMOTING)]
    for key in resumed:
        daemon.promoter.start(key)
    orphans = 0
    for root in daemon.config.roots:
        known = {s.key.step for s in ledger if s.key.root == root.path}
        for step in sorted(on_disk[root.path] - known):
            orphans += 1
            daemon.events.emit(
                "save.orphaned", "warning", root=root.path, step=step, path=root.tmp_dir(step)
            )
    daemon.events.emit(
        "daemon.recovered",
        records=len(replay.records),
        skipped=skipped,
        dropped_bytes=replay.dropped_bytes,
        problem=replay.problem,
        saves=len(ledger),
        in_flight=sum(1 for s in ledger if s.state is p.SaveState.OPEN),
        resumed=len(resumed),
        set_aside=set_aside,
        orphans=orphans,
    )

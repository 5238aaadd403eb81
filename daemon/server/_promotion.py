"""Running promotions: verify, journal the intent, rename, journal the outcome.

Each promotion runs as its own task in the daemon's promotion task group, under its
root's lock, inside a shielded scope: cancellation (shutdown) never stops one halfway,
and shutdown waits for :meth:`Promoter.idle`. A promotion whose intent was journaled
before a restart is resumed: if the rename already happened it is finished (pointer,
outcome), never redone.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup

from orchestrator import protocol as p
from orchestrator.protocol import FileEntry

from ..base._errors import PromotionError, RequestError, VerificationError
from ..base._faults import crash_point
from ..config._config import RootConfig
from ..host._host import Host
from ..ledger._ledger import SaveKey
from ..store._fence import ClaimedError
from ..store._markers import NodeMarker, now_iso
from ..store._promote import Promotion
from ..store._storage import Storage
from ..store._verify import Manifest

__all__ = ["Promoter"]


class Promoter:
    """Starts and tracks the promotions of one daemon.

    Args:
        daemon: The daemon whose ledger, journal, storage and events the promotions use.
    """

    def __init__(self, daemon: Host) -> None:
        self._daemon = daemon
        self._running = 0
        self._idle = anyio.Event()
        self._idle.set()
        self.group: TaskGroup | None = None
        """Where promotions run; set by ``serve`` before any request is handled."""
        self.claimed: Callable[[SaveKey], None] | None = None
        """Called when another node holds a spanning save's claim: it promotes the step,
        and this daemon learns the outcome as the other nodes do."""

    def start(self, key: SaveKey) -> None:
        """Promote ``key`` (now ``verifying``, or ``promoting`` after a restart)."""
        assert self.group is not None, "promotions start only while serving"
        self._running += 1
        self._idle = anyio.Event()
        self.group.start_soon(self._promote, key)

    @property
    def busy(self) -> bool:
        """Whether a promotion is in flight."""
        return self._running > 0

    async def idle(self) -> None:
        """Return once no promotion is in flight."""
        while self._running:
            await self._idle.wait()

    async def _promote(self, key: SaveKey) -> None:
        try:
            with anyio.CancelScope(shield=True):
                root = self._daemon.configured(key.root)
                with self._daemon.trash.pause(root):  # deletion waits for promotions
                    unmarked = await self._mark(root, key)
                    async with self._daemon.root_locks[root.path]:
                        await self._promote_locked(root, key, unmarked)
        finally:
            self._running -= 1
            if not self._running:
                self._idle.set()

    async def _mark(self, root: RootConfig, key: SaveKey) -> OSError | None:
        """Leave a one-node save's ranks' word on the root, before it waits its turn.

        A save whose ranks are all done is judged once the promotions before it on its
        root are; its node marker is written at once (in the root's lane, behind at most
        the promotion running there), as each node of a spanning save writes its own: a
        daemon that restarts without its journal finds every rank done there, and
        promotes as this one would. The error, if any, fails the save once verification
        has had its say.
        """
        daemon = self._daemon
        save = daemon.ledger.get(key)
        if save is None or save.state is not p.SaveState.VERIFYING or save.spans or save.rescued:
            return None  # resumed (marked before), spanning (its own markers), or a rescue
        marker = NodeMarker(
            node=daemon.config.node,
            attempt=save.attempt,
            step=key.step,
            world_size=save.world_size,
            local_world_size=save.world_size,
            state="done",
            files={str(r): list(es) for r, es in save.reported_files().items()},
            written=now_iso(),
        )
        try:
            await daemon.lanes[root.path].run(daemon.storage.write_marker, root, key.step, marker)
        except OSError as exc:
            return exc
        except Exception as exc:  # a bug must fail the save (below), not leave it verifying
            daemon.events.emit("daemon.internal_error", "error", where="mark", error=repr(exc))
            return OSError(errno.EIO, f"internal error: {exc!r}")
        return None

    async def _promote_locked(
        self, root: RootConfig, key: SaveKey, unmarked: OSError | None = None
    ) -> None:
        daemon, ledger, storage = self._daemon, self._daemon.ledger, self._daemon.storage
        save = ledger.get(key)
        if save is None or save.state not in (p.SaveState.VERIFYING, p.SaveState.PROMOTING):
            return
        start = daemon.clock()
        resumed = save.state is p.SaveState.PROMOTING  # intent journaled before a restart
        lane = daemon.lanes[root.path]
        # A save that spans nodes is on a shared filesystem, renamed under a claim only
        # one node can hold, its pointer moved under a lock every node honours.
        fence = (daemon.config.node, save.attempt) if save.spans or save.fenced else None
        # A rescued failed attempt is promoted from where it was set aside: its files
        # never return to tmp_step_N, where a new attempt may be writing.
        source = save.set_aside if save.rescued else None
        try:
            tmp = source or root.tmp_dir(key.step)
            if resumed and await lane.run(storage.promotion_landed, root, key.step, tmp):
                # The rename happened before the restart: finish, never redo it.
                manifest = await lane.run(storage.read_manifest, root.final_dir(key.step))
                node = None if fence is None else fence[0]
                done = await lane.run(storage.finish, root, key.step, node)
            else:
                # One thread of the root's lane verifies and promotes; it journals the
                # intent through the event loop (by the loop's token: the thread is not
                # anyio's) while the save's files are flushed, and renames only once the
                # intent is durable (a resumed promotion's already is).
                token = anyio.lowlevel.current_token()
                journal_intent = partial(anyio.from_thread.run, self._intent, key, token=token)
                intent = None if resumed else journal_intent
                manifest, done = await lane.run(
                    _verify_and_promote,
                    storage,
                    root,
                    key.step,
                    save.world_size,
                    save.reported_files(),
                    save.attempt,
                    intent,
                    fence,
                    source,
                    unmarked,
                    save.flushed_files(),
                )
        except ClaimedError as exc:
            daemon.events.emit(
                "checkpoint.claimed", "warning", root=key.root, step=key.step, reason=str(exc)
            )
            if self.claimed is not None:
                self.claimed(key)
            return
        except VerificationError as exc:
            await self._reject(key, f"verification failed: {exc}")
            return
        except PromotionError as exc:
            await self._reject(key, f"promotion failed: {exc.strerror or exc}")
            return
        except RequestError as exc:  # the intent could not be journaled: do not rename
            await self._reject(key, f"promotion not started: {exc}")
            return
        except Exception as exc:  # a bug must fail the save, not kill the daemon
            daemon.events.emit("daemon.internal_error", "error", where="promote", error=repr(exc))
            await self._reject(key, f"internal error: {exc!r}")
            return
        if fence is not None:
            # The other nodes report the step promoted only on this word: written once
            # the rename is durable, never on the sight of step_N alone.
            try:
                said = partial(storage.write_verdict, promoted=True)
                await lane.run(said, root, key.step, save.attempt, fence[0], "")
            except OSError as exc:
                daemon.events.emit(
                    "node.marker_failed", "error", root=key.root, step=key.step,
                    attempt=save.attempt, error=exc.strerror or str(exc),
                )  # fmt: skip
        if done.pointer_error is not None:
            daemon.events.emit(
                "pointer.failed", "error", root=key.root, step=key.step, reason=done.pointer_error
            )
        now = daemon.clock()
        fields: dict[str, Any] = {
            "bytes": manifest.bytes,
            "files": len(manifest.files),
            "promotion_ms": round((now - start) * 1000, 3),
            "latest": done.pointer_moved,
        }
        if resumed:
            fields["resumed"] = True
        try:
            await daemon.commit(ledger.promoted(key, done.path, now, **fields))
        except RequestError:
            pass  # on disk it is promoted; recovery finds the rename done
        except RuntimeError as exc:  # the ledger no longer expects it: a bug, never fatal
            daemon.events.emit("daemon.internal_error", "error", where="promoted", error=repr(exc))
        crash_point("after_promoted")
        daemon.retention.promoted(root, key)  # a pass in the background, after this lock

    async def _intent(self, key: SaveKey) -> None:
        """Journal that ``key`` passed verification and is about to be renamed."""
        crash_point("before_intent")
        await self._daemon.commit(self._daemon.ledger.verified(key))
        crash_point("after_intent")

    async def _reject(self, key: SaveKey, reason: str) -> None:
        daemon = self._daemon
        try:
            await daemon.commit(daemon.ledger.rejected(key, reason, daemon.clock()))
        except RequestError:
            pass  # already reported as journal.failed; recovery verifies again


def _verify_and_promote(
    storage: Storage,
    root: RootConfig,
    step: int,
    world_size: int,
    reported: dict[int, tuple[FileEntry, ...]],
    attempt: str,
    intent: Callable[[], object] | None,
    fence: tuple[str, str] | None = None,
    source: str | None = None,
    unmarked: OSError | None = None,
    flushed: frozenset[str] = frozenset(),
) -> tuple[Manifest, Promotion]:
    """Verify ``tmp_step_N``, then promote it (blocking; one worker thread for both).

    The directory renamed is the one verified: its identity (device, inode) is taken
    before the scan and checked again before and after the rename. With ``fence``
    (node, attempt), the step is claimed first, and the claim dropped if it fails
    verification. ``source`` is the directory to promote if not ``tmp_step_N`` (a
    rescued attempt's, in the trash). ``unmarked``: why the save's node marker could
    not be written; it fails the save once verification passes. ``flushed``: files
    other nodes flushed before their markers, not flushed again.

    Raises:
        ClaimedError: another node holds the claim.
        PromotionError: the node marker could not be written (``unmarked``).
    """
    tmp = source or root.tmp_dir(step)
    try:
        identity = storage.identity(tmp)
    except FileNotFoundError:
        raise VerificationError(f"{tmp} does not exist") from None
    if fence is not None:
        storage.claim(root, step, *fence, tmp)
    try:
        manifest = storage.scan_save(root, step, world_size, reported, attempt, source)
    except VerificationError:
        if fence is not None:
            storage.release(root, step, *fence, tmp)
        raise
    if unmarked is not None:  # never promoted without its ranks' word on the root
        raise PromotionError(
            unmarked.errno or errno.EIO,
            f"write node marker failed for {tmp}: {unmarked.strerror or unmarked}",
        )
    node = None if fence is None else fence[0]
    done = storage.promote(
        root,
        step,
        manifest,
        intent=intent,
        expect=identity,
        pointer_node=node,
        source=source,
        flushed=flushed,
    )
    return manifest, done

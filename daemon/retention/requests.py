"""The retention requests: ``score``, ``pin``, ``unpin``, ``hold`` and ``retention``.

Each is checked against the disk (the step must be there) in the root's lane, changes
:class:`~daemon.retention.state.RetentionState` with no ``await`` between the check that
the step is not being retired and the change, is journaled before the reply, and kicks
the root's pass. A pin or hold whose step vanished meanwhile is undone and refused.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Protocol

import anyio
import msgspec

from orchestrator import protocol as p

from ..base._errors import RequestError, VerificationError
from ..config._config import RootConfig
from ..host._host import Host
from ..ledger._saves import SaveKey
from .policy import Verdict
from .state import RetentionState

__all__ = ["Retaining", "answer"]


class Retaining(Protocol):
    """What the requests need of retention (:class:`daemon.retention.applier.Retention`)."""

    @property
    def state(self) -> RetentionState:
        """Metrics, pins and holds."""
        ...

    def kick(self, root: str) -> None:
        """Run a pass over ``root`` soon."""
        ...

    def retiring(self, key: SaveKey) -> bool:
        """Whether ``key`` is being retired right now."""
        ...

    def prunes(self, root: RootConfig) -> bool:
        """Whether this daemon prunes ``root``."""
        ...

    async def run_pass(
        self, root: RootConfig, *, apply: bool
    ) -> tuple[list[Verdict], int | None, list[int]]:
        """Judge ``root``'s steps (and, with ``apply``, retire what goes)."""
        ...

    def facts_lock(self, root: RootConfig) -> anyio.Lock:
        """Held while a step's facts of ``root`` are taken from the state and written."""
        ...


async def answer(
    retention: Retaining, daemon: Host, request: p.Score | p.Pin | p.Unpin | p.Hold | p.Retention
) -> p.Ack | p.RetentionReply:
    """Answer ``score``, ``pin``, ``unpin``, ``hold`` or ``retention``.

    Raises:
        RequestError: the step is not there (``not_found``), is being retired
            (``invalid_state``), a value is bad (``invalid_field``), or the change
            could not be journaled (``unavailable``).
    """
    root = daemon.configured(request.root)
    if isinstance(request, p.Retention):
        return await _report(retention, request, root)
    key = SaveKey(root.path, request.step)
    match request:
        case p.Score(metrics=metrics):
            await _require_promoted(daemon, root, key)
            async with retention.facts_lock(root):
                merged = retention.state.scored(key, metrics)
                await _on_root(retention, daemon, root, key, metrics=merged, locked=True)
                retention.state.score(key, metrics)
        case p.Unpin():
            changed = retention.state.pin(key, False)
            repin = partial(retention.state.pin, key, True) if changed else None
            await _on_root(retention, daemon, root, key, undo=repin)
        case p.Pin():
            _not_retiring(retention, key)
            changed = retention.state.pin(key, True)
            if not await _exists(daemon, root, key, in_flight=True):
                if changed:
                    retention.state.pin(key, False)
                raise RequestError(
                    p.ErrorCode.NOT_FOUND, f"{root.final_dir(key.step)} does not exist"
                )
            unpin = partial(retention.state.pin, key, False) if changed else None
            await _on_root(retention, daemon, root, key, undo=unpin)
        case p.Hold(ttl=ttl):
            now = time.time()
            if ttl > 0:
                _not_retiring(retention, key)
                before = retention.state.held_until(key, now)
                retention.state.hold(key, now + ttl, now)
                if not await _exists(daemon, root, key, in_flight=False):
                    retention.state.hold(key, before or 0.0, now)
                    raise RequestError(
                        p.ErrorCode.NOT_FOUND,
                        f"{root.final_dir(key.step)} is not a promoted checkpoint",
                    )
            else:
                before = retention.state.held_until(key, now)
                retention.state.hold(key, 0.0, now)
            undo = partial(retention.state.hold, key, before or 0.0, now)
            await _on_root(retention, daemon, root, key, undo=undo)
    await daemon.commit([])
    retention.kick(root.path)
    return p.Ack(id=request.id)


async def _on_root(
    retention: Retaining,
    daemon: Host,
    root: RootConfig,
    key: SaveKey,
    *,
    metrics: dict[str, float] | None = None,
    undo: Callable[[], object] | None = None,
    locked: bool = False,
) -> None:
    """Record the step's retention facts on the root (``metrics``: as they will be).

    Durable before the request is acknowledged: a daemon that starts with an empty
    state directory takes them from there (``daemon.store._facts``). If they cannot be
    written, ``undo`` puts the state back and the request is refused. The facts are
    taken from the state under the root's facts lock (``locked``: the caller holds it),
    so a write never carries an older state than the one before it.

    Raises:
        RequestError: (``unavailable``) the facts could not be written.
    """
    if not locked:
        async with retention.facts_lock(root):
            await _on_root(retention, daemon, root, key, undo=undo, locked=True)
        return
    lanes, storage = daemon.lanes, daemon.storage
    try:
        final = root.final_dir(key.step)
        manifest = await lanes.run(root.path, storage.read_manifest, final, abandon=True)
        attempt = manifest.attempt
    except VerificationError:
        attempt = ""  # not promoted yet (a pin of a step in flight): no metrics or hold
    facts = retention.state.facts(key, attempt, time.time())
    if metrics is not None:
        facts = msgspec.structs.replace(facts, metrics=metrics)
    try:
        await lanes.run(root.path, storage.write_facts, root, facts, abandon=True)
    except OSError as exc:
        if undo is not None:
            undo()
        raise RequestError(
            p.ErrorCode.UNAVAILABLE,
            f"cannot record step {key.step}'s retention on {root.path} "
            f"({exc.strerror or exc}); nothing was changed",
        ) from None


def _not_retiring(retention: Retaining, key: SaveKey) -> None:
    if retention.retiring(key):
        raise RequestError(p.ErrorCode.INVALID_STATE, f"step {key.step} is being retired right now")


async def _exists(daemon: Host, root: RootConfig, key: SaveKey, *, in_flight: bool) -> bool:
    save = daemon.ledger.get(key)
    if (
        in_flight
        and save is not None
        and save.state
        not in (
            p.SaveState.PROMOTED,
            p.SaveState.FAILED,
        )
    ):
        return True
    lanes, storage = daemon.lanes, daemon.storage
    if await lanes.run(root.path, storage.promoted, root, key.step, abandon=True):
        return True
    if in_flight and save is not None and save.state is p.SaveState.FAILED and save.set_aside:
        # A failed attempt kept in the trash, which ``ckptd promote`` may rescue: a pin
        # first keeps it once it is promoted.
        if await lanes.run(root.path, storage.directory, save.set_aside, abandon=True):
            return True
    return in_flight and await lanes.run(root.path, storage.writing, root, key.step, abandon=True)


async def _require_promoted(daemon: Host, root: RootConfig, key: SaveKey) -> None:
    if not await _exists(daemon, root, key, in_flight=False):
        raise RequestError(
            p.ErrorCode.NOT_FOUND, f"{root.final_dir(key.step)} is not a promoted checkpoint"
        )


async def _report(retention: Retaining, request: p.Retention, root: RootConfig) -> p.RetentionReply:
    config = root.retention
    if config is None:
        info = p.RetentionInfo(policy="", prunes=False)
        return p.RetentionReply(id=request.id, info=info, steps=[])
    try:
        verdicts, best, gone = await retention.run_pass(root, apply=request.apply)
    except OSError as exc:
        raise RequestError(
            p.ErrorCode.INVALID_STATE, f"cannot judge {root.path}: {exc.strerror or exc}"
        ) from None
    now = time.time()
    steps = []
    for v in verdicts:
        key = SaveKey(root.path, v.step)
        held = retention.state.held_until(key, now)
        steps.append(
            p.RetentionStep(
                step=v.step,
                kept=list(v.kept),
                retire=v.retire,
                metrics=retention.state.metrics(key),
                pinned=retention.state.pinned(key),
                held_for_s=None if held is None else round(held - now, 3),
            )
        )
    info = p.RetentionInfo(
        policy=config.policy.describe(),
        best=best,
        best_pointer=config.best_pointer,
        prunes=retention.prunes(root),
    )
    return p.RetentionReply(id=request.id, info=info, steps=steps, retired=gone)

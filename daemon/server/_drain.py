"""Draining fast-tier steps to the durable root, off the training path.

Who decides: the daemon serving rank 0 of a step (the leader; on one node, that node)
selects steps by the root's policy (every K steps, every T minutes) as they are
promoted locally, and orders one drain at a time by writing ``drains/step_N.json`` in
the coordination directory. While a drain runs, a newer selected step replaces an older
one waiting (``tier.drain_skipped``): a drain that falls behind skips older steps, never
the newest. Every node drains its own part of each ordered step it holds (a watcher
reads the orders), so a step is committed once, by every node.

How: this node's daemon is, for the durable root, the writer of its ranks' parts. It
sends itself each rank's ``begin`` (run ``ckptd-drain.<run>.t<try>``), copies the part's
files into the directory the reply names (checked against the part's checksums, in
threads of its own, throttled, at low IO priority: :mod:`daemon.store._tiercopy`,
:mod:`daemon.store._tierobj` on an object store), adds
``.ckptd-sums/NODE.json`` (the checksums, for ``ckptd verify --deep``), then each rank's
``done``. From there the durable commit is exactly a normal save's: verification, node
markers, the leader's rename or commit object, the journal. The outcome arrives like a
``wait``'s. The attempt is recorded in the local step's ``drain.json`` before the copy,
so a daemon killed mid-drain re-attaches to it on restart (a ``begin`` resent with its
attempt) and copies only what is not there yet; an attempt that failed meanwhile is
retried once under a new try.
"""

from __future__ import annotations

import hashlib
from functools import partial
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskGroup

from orchestrator import protocol as p
from orchestrator.protocol import FileEntry

from ..base._errors import RequestError
from ..config._root import RootConfig
from ..store import _tier, _tiercoord, _tiercopy
from ..store._tier import DrainRecord, Part
from . import _stopdrain
from ._tiers import TierHost, TierSaves

__all__ = ["Drainer"]

SUMS_DIR = ".ckptd-sums"


class Drainer:
    """The drains of this daemon's fast tiers."""

    def __init__(self, daemon: TierHost, saves: TierSaves) -> None:
        self._daemon = daemon
        self._saves = saves
        self.group: TaskGroup | None = None
        self._pending: dict[str, int] = {}  # leader: newest selected step not ordered
        self._ordered: dict[str, int] = {}  # leader: the order outstanding
        self._last_order: dict[str, float] = {}
        self._running: dict[tuple[str, int], anyio.Event] = {}
        self._done: set[tuple[str, int]] = set()
        self._orders: dict[str, set[int]] = {}  # every node: orders seen
        self._mine: set[tuple[str, int]] = set()  # orders this node wrote
        saves.promoted = self.promoted

    # -- selection (the leader) ----------------------------------------------------------

    def promoted(self, root: RootConfig, step: int, part: Part, leads: bool) -> None:
        """A step was promoted locally: select it if due, and apply local retention."""
        assert self.group is not None and root.fast is not None
        if leads:
            last = self._last_order.get(root.path)
            since = None if last is None else self._daemon.clock() - last
            if root.fast.due(step, since):
                self.select(root, step)
        self.group.start_soon(self.retain, root)

    def select(self, root: RootConfig, step: int) -> None:
        """Select ``step`` for draining; an older selected step still waiting is skipped."""
        waiting = self._pending.get(root.path)
        if waiting is not None and waiting != step:
            self._daemon.events.emit("tier.drain_skipped", root=root.path, step=waiting, newer=step)
        self._pending[root.path] = max(step, waiting or step)
        self._kick(root)

    def _kick(self, root: RootConfig) -> None:
        if root.path in self._ordered or root.path not in self._pending:
            return
        step = self._pending.pop(root.path)
        self._ordered[root.path] = step
        self._last_order[root.path] = self._daemon.clock()
        assert self.group is not None
        self.group.start_soon(self._order, root, step)

    async def _order(self, root: RootConfig, step: int) -> None:
        daemon = self._daemon
        order = msgspec.json.encode({"step": step, "by": daemon.config.node})
        rel = f"drains/{root.final_prefix}{step}.json"
        try:
            await daemon.lanes.run(root.path, _tiercoord.write_fact, root, rel, order)
        except OSError as exc:
            daemon.events.emit(
                "tier.drain_failed", "error", root=root.path, step=step,
                reason=f"cannot write the drain order: {exc.strerror or exc}",
            )  # fmt: skip
            self._settle_order(root, step)
            return
        self._orders.setdefault(root.path, set()).add(step)
        self._mine.add((root.path, step))
        await self.drain(root, step)

    def _settle_order(self, root: RootConfig, step: int) -> None:
        if self._ordered.get(root.path) == step:
            del self._ordered[root.path]
            self._kick(root)

    # -- orders (every node) -------------------------------------------------------------

    async def watch(self) -> None:
        """Follow the leaders' drain orders (and resume this node's after a restart).

        Each tiered root has a watcher of its own (a hung durable root holds up only its
        own drains), looking at its ``drains/`` every ``max(poll_interval, 0.5)`` seconds;
        the configuration is read again every second (a reload adds or removes one).
        """
        daemon = self._daemon
        watching: set[str] = set()
        while not daemon.stopping:
            for root in daemon.config.roots:
                if root.fast is not None and root.path not in watching:
                    watching.add(root.path)
                    assert self.group is not None
                    self.group.start_soon(self._watch_root, root.path, watching)
            await anyio.sleep(1.0)

    async def _watch_root(self, path: str, watching: set[str]) -> None:
        daemon = self._daemon
        try:
            while not daemon.stopping:
                root = daemon.config.root_for(path)
                if root is None or root.fast is None:
                    return
                await self._look(root)
                await anyio.sleep(max(root.poll_interval, 0.5))
        finally:
            watching.discard(path)

    async def _look(self, root: RootConfig) -> None:
        """One look at ``root``'s drain orders: drain each ordered step held here."""
        assert self.group is not None
        tier = _tier.tier_root(root)
        try:
            names = await self._daemon.lanes.run(
                root.path, _tiercoord.list_names, root, "drains", abandon=True
            )
            held = set(await self._saves.run(_tier.local_steps, tier))
        except OSError:
            return
        for name in names:
            step = root.parse_step(name.removesuffix(".json"), root.final_prefix)
            if step is None:
                continue
            self._orders.setdefault(root.path, set()).add(step)
            key = (root.path, step)
            if step not in held or key in self._running or key in self._done:
                continue
            record = await self._saves.run(_tier.read_drain, tier, step)
            if record is not None and record.state == "done":
                self._done.add(key)
            elif record is None or record.state != "failed":  # a failure was reported
                self.group.start_soon(self.drain, root, step)

    # -- one drain -----------------------------------------------------------------------

    async def drain(self, root: RootConfig, step: int) -> bool:
        """Drain this node's part of local ``step`` to the durable root; whether it is durable."""
        key = (root.path, step)
        if key in self._done:
            return True
        running = self._running.get(key)
        if running is not None:
            await running.wait()
            return key in self._done
        event = self._running[key] = anyio.Event()
        try:
            ok = await self._drain(root, step)
        finally:
            del self._running[key]
            event.set()
            self._settle_order(root, step)
        if ok:
            self._done.add(key)
            assert self.group is not None
            self.group.start_soon(self.retain, root)
        return ok

    async def _drain(self, root: RootConfig, step: int) -> bool:
        assert root.fast is not None
        tier = _tier.tier_root(root)
        part = await self._saves.run(_tier.read_part, tier.final_dir(step))
        if part is None:
            return False
        record = await self._saves.run(_tier.read_drain, tier, step)
        if record is not None and record.state == "done":
            return True
        for resume in (True, False):
            tries = 0 if record is None else record.tries + (0 if resume else 1)
            attempt = record.attempt if record is not None and resume else ""
            if resume and not attempt:
                continue
            outcome = await self._attempt(root, tier, part, tries, attempt)
            if outcome is not None:
                record = outcome
                if outcome.state == "done":
                    return True
        return False

    async def _attempt(
        self, root: RootConfig, tier: RootConfig, part: Part, tries: int, attempt: str
    ) -> DrainRecord | None:
        """One try; the record it ends with (None: refused before anything was copied)."""
        daemon, fast = self._daemon, root.fast
        assert fast is not None
        step = part.step
        run = f"ckptd-drain.{hashlib.sha256(part.run.encode()).hexdigest()[:12]}.t{tries}"
        ranks = sorted(int(r) for r in part.ranks)
        lws = len(ranks) if len(ranks) < part.world_size else None
        conn = daemon.internal_conn()
        start = daemon.clock()
        daemon.events.emit(
            "tier.drain_started", root=root.path, step=step, bytes=part.bytes,
            resumed=bool(attempt), lag_steps=self._lag(root, step),
        )  # fmt: skip
        try:
            path = ""
            for rank in ranks:
                begin = p.Begin(
                    id=0, root=root.path, step=step, rank=rank, world_size=part.world_size,
                    resent=bool(attempt), attempt=attempt or None, local_world_size=lws, run=run,
                )  # fmt: skip
                reply = await daemon.begin_internal(conn, begin)
                if reply.state is p.SaveState.PROMOTED:
                    return await self._finish(root, tier, part, start, DrainRecord(
                        state="done", run=run, attempt=reply.attempt, tries=tries), 0)  # fmt: skip
                path, attempt = reply.path, reply.attempt
            record = DrainRecord(state="copying", run=run, attempt=attempt, tries=tries)
            await self._saves.run(_tier.write_drain, tier, step, record)
            files = [(f.path, f.size, f.sha256) for f in part.files()]
            pace: dict[str, Any] = {
                "threads": fast.drain_threads,
                "rate": fast.drain_rate_mb_s * 1e6,
                "ionice": fast.drain_ionice,
            }
            sums_rel = f"{SUMS_DIR}/{daemon.config.node}.json"
            sums = msgspec.json.encode({f.path: f.sha256 for f in part.files()})
            src = tier.final_dir(step)
            copy = partial(_tiercopy.drain_files, root, src, path, files, **pace)
            copied = await anyio.to_thread.run_sync(copy)
            small = partial(_tiercopy.drain_small, root, f"{path}/{sums_rel}", sums)
            await anyio.to_thread.run_sync(small)
            for i, rank in enumerate(ranks):
                files_ = [FileEntry(f.path, f.size) for f in part.ranks[str(rank)]]
                if i == 0:
                    files_.append(FileEntry(sums_rel, len(sums)))
                done = p.Done(id=0, root=root.path, step=step, rank=rank, files=files_,
                              attempt=attempt)  # fmt: skip
                await daemon.dispatch(conn, done)
            wait = p.Wait(id=0, root=root.path, step=step, timeout=86_400.0)
            outcome = await daemon.settled(wait, root, durable=True)
        except RequestError as exc:
            reason = f"{exc.code.value}: {exc}"
            return await self._failed(root, tier, step, run, attempt, tries, reason)
        except Exception as exc:  # a copy that failed its checksum, or the disk
            return await self._failed(root, tier, step, run, attempt, tries, repr(exc))
        finally:
            daemon.apply(daemon.ledger.disconnect(conn, daemon.clock()))
        if outcome.state != "promoted":
            return await self._failed(
                root, tier, step, run, attempt, tries, outcome.reason or outcome.state
            )
        done_record = DrainRecord(state="done", run=run, attempt=attempt, tries=tries)
        return await self._finish(root, tier, part, start, done_record, copied)

    async def _finish(
        self, root: RootConfig, tier: RootConfig, part: Part, start: float,
        record: DrainRecord, copied: int,
    ) -> DrainRecord:  # fmt: skip
        daemon = self._daemon
        await self._saves.run(_tier.write_drain, tier, part.step, record)
        seconds = max(daemon.clock() - start, 1e-9)
        daemon.events.emit(
            "tier.drained", root=root.path, step=part.step, bytes=copied,
            seconds=round(seconds, 3), mb_s=round(copied / seconds / 1e6, 1),
            lag_steps=self._lag(root, part.step),
        )  # fmt: skip
        return record

    async def _failed(
        self, root: RootConfig, tier: RootConfig, step: int, run: str, attempt: str,
        tries: int, reason: str,
    ) -> DrainRecord:  # fmt: skip
        record = DrainRecord(state="failed", run=run, attempt=attempt, tries=tries, reason=reason)
        try:
            await self._saves.run(_tier.write_drain, tier, step, record)
        except OSError:
            pass
        self._daemon.events.emit(
            "tier.drain_failed", "error", root=root.path, step=step, reason=reason
        )
        return record

    def _lag(self, root: RootConfig, step: int) -> int:
        newest = max((s for r, s in self._saves.local_newest() if r == root.path), default=step)
        return max(0, newest - step)

    # -- space and stopping --------------------------------------------------------------

    async def retain(self, root: RootConfig) -> None:
        """Keep the newest ``keep`` local steps; never evict one selected and not durable."""
        assert root.fast is not None
        tier = _tier.tier_root(root)
        steps = await self._saves.run(_tier.local_steps, tier)
        if len(steps) <= root.fast.keep:
            return
        newest = steps[-1]
        protected = set(self._orders.get(root.path, set())) | {
            s for r, s in self._running if r == root.path
        }
        protected |= {s for r, s in self._pending.items() if r == root.path}
        protected |= {s for r, s in self._ordered.items() if r == root.path}
        for step in steps[: -root.fast.keep]:
            if step == newest:
                continue
            durable = (root.path, step) in self._done
            if not durable:
                record = await self._saves.run(_tier.read_drain, tier, step)
                durable = record is not None and record.state == "done"
            if step in protected and not durable and not root.fast.evict_undrained:
                continue
            await self._saves.run(_tier.remove_step, tier, step)
            self._daemon.events.emit("tier.evicted", root=root.path, step=step, durable=durable)
            await self._forget(root, step, durable)

    async def _forget(self, root: RootConfig, step: int, durable: bool) -> None:
        """Remove this node's facts of an evicted step from the coordination directory.

        Its part (no restore can use the step here now) and, once the step is durable,
        the drain order this node wrote (every node's part was committed by then).
        """
        daemon = self._daemon
        name = f"{root.final_prefix}{step}"
        facts = [f"parts/{name}/{daemon.config.node}.json"]
        if durable and (root.path, step) in self._mine:
            facts.append(f"drains/{name}.json")
            self._mine.discard((root.path, step))
        for rel in facts:
            try:
                await daemon.lanes.run(root.path, _tiercoord.remove_fact, root, rel)
            except OSError:
                pass  # a fact left behind is only a file, never read as a newer one

    async def stop(self) -> None:
        """On a clean stop: drain each root's newest local step within its grace.

        Across nodes, the newest step every node holds, agreed through the coordination
        directory (:mod:`daemon.server._stopdrain`), so that every node drains the same one.
        """
        daemon = self._daemon
        for root in daemon.config.roots:
            fast = root.fast
            if fast is None or not fast.drain_on_stop:
                continue
            tier = _tier.tier_root(root)
            steps = await self._saves.run(_tier.local_steps, tier)
            if not steps:
                continue
            step: int | None = steps[-1]
            ok, why, agreed = False, "", False
            with anyio.move_on_after(fast.stop_grace) as scope:
                try:
                    step, lacked = await _stopdrain.agree(daemon, self._saves, root, steps,
                                                          fast.stop_grace)  # fmt: skip
                except OSError as exc:
                    step, lacked = None, f"cannot agree on a step: {exc.strerror or exc}"
                agreed = True
                if step != steps[-1] or lacked:
                    daemon.events.emit(
                        "tier.stop_agreed", root=root.path, step=step, newest=steps[-1],
                        reason=lacked or None,
                    )  # fmt: skip
                if step is None:
                    why = lacked
                else:
                    record = await self._saves.run(_tier.read_drain, tier, step)
                    if record is not None and record.state == "done":
                        continue
                    ok = await self.drain(root, step)
            if scope.cancelled_caught:
                why = "not durable within the grace" if agreed else (
                    "no step agreed with the other nodes within the grace")  # fmt: skip
            elif not ok and step is not None:
                why = "the drain failed"
            if ok:
                daemon.events.emit("tier.stop_drained", root=root.path, step=step)
            else:
                local = tier.final_dir(step if step is not None else steps[-1])
                daemon.events.emit(
                    "tier.stop_drain_unfinished", "error", root=root.path, step=step,
                    grace_s=fast.stop_grace, local=local,
                    reason=f"{why}; the step stays in the fast tier",
                )  # fmt: skip

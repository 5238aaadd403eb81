"""The simulated nodes of the scale benchmark: many follower daemons in one process.

Each simulated node is a real :class:`daemon.server._server.Daemon` (its own config,
ledger, lanes and :class:`daemon.nodes.Nodes`), with no socket and no journal: its
ranks' ``begin`` and ``done`` go to ``Daemon.dispatch`` as the connection would send
them, so the node joins the leader's attempt, checks its ranks' files, writes its
marker durably and waits for the outcome by the same code a follower daemon runs; its
outcome is read with ``Daemon.settled``, the handler of ``wait``.

Driven by ``bench/scale.py`` over stdin and stdout, one JSON object a line::

    {"op": "begin", "step": 2}   -> {"ok": true, "t": <wall clock>}
    {"op": "done", "step": 2}    -> {"ok": true, "t_done": ..., "learned": [...], ...}
    {"op": "quit"}

    python -m bench._scale_nodes --root ROOT --nodes 4096 --ranks 8 [--poll-budget B]
        [--shard I/K]

With ``--shard I/K`` this process runs nodes ``1 + I``, ``1 + I + K``, ... only: ``K``
such processes share the job's nodes (and the machine's cores, as real nodes have
their own).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
import threading
import time
from typing import Any

import anyio
import structlog

from daemon.config._config import Config, RootConfig
from daemon.server._server import Daemon
from orchestrator import protocol as p

__all__ = ["main"]

_FILE_SIZE = 4096
"""Each node's local rank 0 reports one file of this size (``rank<R>.bin``)."""
SWITCH_S = 0.0005
"""The interpreter's switch interval here (``sys.setswitchinterval``)."""
NICE = 5
"""How much lower than the leader's the simulated nodes' CPU priority is."""
LAG_EVERY = 0.02
"""Seconds between the probe's wake-ups (see :func:`_probe`)."""


async def _probe(samples: list[tuple[float, float]]) -> None:
    """Record how late this process's event loop runs a wake-up, until cancelled.

    Every simulated node's look is a wake-up on this one loop, so a wake-up this late
    is a look this late: time a real node, on a machine of its own, would not lose.
    Each sample is (wall clock, seconds late).
    """
    while True:
        due = time.monotonic() + LAG_EVERY
        await anyio.sleep(LAG_EVERY)
        samples.append((time.time(), max(0.0, time.monotonic() - due)))


class _Nodes:
    """Nodes 1..n-1 (or one shard of them) of a job of ``n`` nodes, ``ranks`` ranks each."""

    def __init__(self, args: argparse.Namespace, home: str) -> None:
        self.root = RootConfig(
            path=args.root,
            watch="poll",
            poll_interval=args.poll_interval,
            poll_budget=args.poll_budget,
        )
        self.ranks: int = args.ranks
        self.world: int = args.nodes * args.ranks
        self.errors: list[dict[str, Any]] = []
        self.daemons: list[Daemon] = []
        first, every = (int(x) for x in args.shard.split("/"))
        self.numbers = list(range(1 + first, args.nodes, every))
        """Each daemon's node number, in the order of :attr:`daemons`."""
        for i in self.numbers:
            config = Config(
                socket=os.path.join(home, f"n{i}.sock"),
                roots=(self.root,),
                state_dir=home,
                node=f"n{i}",
                node_timeout=3600.0,
                root_threads=1,
                lease=3600.0,
            )
            daemon = Daemon(config)
            daemon.events.observer = self._observe
            self.daemons.append(daemon)
        self._ids = itertools.count(1)

    def _observe(self, name: str, fields: dict[str, Any]) -> None:
        if name in ("daemon.internal_error", "node.marker_failed", "checkpoint.failed"):
            self.errors.append({"event": name, **fields})

    def _rank(self, node: int, local: int) -> int:
        return node * self.ranks + local

    async def begin(self, step: int) -> dict[str, Any]:
        """Every rank of every simulated node begins ``step`` (each node joins the leader's)."""

        async def one(node: int, daemon: Daemon) -> None:
            for local in range(self.ranks):
                rank = self._rank(node, local)
                request = p.Begin(
                    id=next(self._ids),
                    root=self.root.path,
                    step=step,
                    rank=rank,
                    world_size=self.world,
                    local_world_size=self.ranks,
                )
                await daemon.dispatch(rank + 1, request)

        async with anyio.create_task_group() as tg:
            for node, daemon in zip(self.numbers, self.daemons, strict=True):
                tg.start_soon(one, node, daemon)
        return {"ok": True, "t": time.time(), "errors": self.errors[-5:]}

    async def done(self, step: int) -> dict[str, Any]:
        """Every simulated rank says done; returns when each node learned the outcome."""
        learned: list[float] = [0.0] * len(self.daemons)
        states: dict[str, int] = {}
        lag: list[tuple[float, float]] = []

        async def settle(i: int, daemon: Daemon) -> None:
            wait = p.Wait(id=next(self._ids), root=self.root.path, step=step, timeout=600.0)
            reply = await daemon.settled(wait, self.root)
            learned[i] = time.time()
            states[str(reply.state)] = states.get(str(reply.state), 0) + 1

        async with anyio.create_task_group() as probing:
            probing.start_soon(_probe, lag)
            async with anyio.create_task_group() as tg:
                for i, daemon in enumerate(self.daemons):
                    tg.start_soon(settle, i, daemon)
                await self._dones(step)
                t_done = time.time()
            probing.cancel_scope.cancel()
        return {
            "ok": True,
            "t_done": t_done,
            "learned": learned,
            "states": states,
            "lag": lag,
            "errors": self.errors[-5:],
        }

    async def _dones(self, step: int) -> None:
        """Every simulated rank's ``done`` of ``step``, handed to its node."""
        for node, daemon in zip(self.numbers, self.daemons, strict=True):
            for local in range(self.ranks):
                rank = self._rank(node, local)
                files = [p.FileEntry(f"rank{rank}.bin", _FILE_SIZE)] if local == 0 else []
                request = p.Done(
                    id=next(self._ids), root=self.root.path, step=step, rank=rank, files=files
                )
                await daemon.dispatch(rank + 1, request)


def _reply(message: dict[str, Any]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


async def _serve(args: argparse.Namespace) -> None:
    home = args.home
    nodes = _Nodes(args, home)
    async with anyio.create_task_group() as group:
        for daemon in nodes.daemons:
            daemon.nodes.group = group
            daemon.attempt_dirs.group = group
            daemon.promoter.group = group
        _reply({"ok": True, "ready": len(nodes.daemons)})
        stdin = anyio.wrap_file(sys.stdin)
        while line := await stdin.readline():
            command = json.loads(line)
            if command["op"] == "begin":
                _reply(await nodes.begin(int(command["step"])))
            elif command["op"] == "done":
                _reply(await nodes.done(int(command["step"])))
            else:
                break
        for daemon in nodes.daemons:
            daemon.nodes.close()
        group.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> None:
    """Run the simulated nodes until stdin closes or says ``quit``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True)
    parser.add_argument("--home", required=True, help="a directory for sockets (never bound)")
    parser.add_argument("--nodes", type=int, required=True, help="the job's nodes, leader too")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--poll-interval", type=float, default=0.25)
    parser.add_argument("--poll-budget", type=float, default=1500.0)
    parser.add_argument("--shard", default="0/1", help="I/K: every K-th node from node 1 + I")
    args = parser.parse_args(argv)
    # Thousands of lanes, each with a thread while it has work: keep their stacks small.
    threading.stack_size(512 * 1024)
    # Each node's look is a hand-off to its lane's thread and back, and hundreds of
    # nodes here share one interpreter lock: hand it over sooner than the default 5 ms,
    # or every look waits behind the others' (a real node's daemon waits for no one).
    sys.setswitchinterval(SWITCH_S)
    # The leader, and the mounts, run on the same cores; on a real job they have a
    # node of their own. The simulated nodes yield the CPU to them.
    os.nice(NICE)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    anyio.run(_serve, args)


if __name__ == "__main__":
    main()

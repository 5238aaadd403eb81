"""Benchmark 5: what the client costs the training thread and the writer thread.

A real :class:`orchestrator.CheckpointClient` connected to a real daemon. Timed with
``time.perf_counter_ns``, one call at a time:

- ``track()``: what a trainer calls per save after its save call returned (``begin``
  sent, not awaited; add the future; seal), for a new step and for a step already begun.
- ``begin()`` acknowledged, new step: the round trip ``orchestrator.async_save``
  overlaps with DCP's own work (the daemon journals it: a ``write`` and an ``fsync``).
- ``SaveHandle.add`` + ``seal`` on a begun handle: the client's own bookkeeping.
- the done-callback: completing the upload future (``set_result`` with a DCP
  ``Metadata`` of 16 shards) runs it on the calling thread, as DCP's writer thread does:
  it lists the rank's shard files and queues ``done`` for the client's I/O thread.
- the step directory ``save()`` creates on the calling thread (the path contract): the
  very call it makes, for a new directory and for one that exists already (``EEXIST``),
  against ``os.stat`` of the root (one cheap syscall) measured in the same run; and
  ``save(wait=False)`` of a new step as a whole, directory included.

Baselines in the same run: ``Future.add_done_callback`` of a no-op plus nothing else
(the floor of registering), and ``set_result`` on a future with a no-op callback. Two
more show the cost of a hand-off between threads: ``loop.call_soon_threadsafe`` into an
idle asyncio loop thread (a wake-up through its self-pipe, which releases the GIL to the
woken thread) and ``SimpleQueue.put`` to a thread blocked in ``get`` (the client's
design: the caller keeps the GIL), the latter also after the taker slept 20 ms (the
wake-up of an idle thread and CPU, which an isolated call pays). Allocation growth:
``tracemalloc``'s traced size after each tenth of 100,000 iterations of ``track()`` +
completing the future (flushed, ``gc`` run), last minus first.

    .venv/bin/python -m bench.client_cost [--full] [--calls 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import queue
import threading
import time
import tracemalloc
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any

from orchestrator import CheckpointClient
from orchestrator._layout import make_step_dir  # the exact call save() makes

from ._common import BenchResult, Daemon, Row, median, p99, print_table, scratch_dir

__all__ = ["run"]


def _metadata(shards: int = 16) -> Any:
    """A DCP ``Metadata`` as a 2-rank save's future resolves to (rank 0's shards)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    storage = {
        MetadataIndex(f"layer{i}.weight", (0,)): _StorageInfo(
            f"__{i % 2}_0.distcp", (i // 2) * 4096, 4096
        )
        for i in range(shards)
    }
    return Metadata(state_dict_metadata={}, storage_data=storage)


def _noop(_fut: Future[Any]) -> None:
    """A done-callback that does nothing (the baseline's)."""


def _take_forever(inbox: queue.SimpleQueue[object]) -> None:
    """Take items until ``None``: the thread a ``SimpleQueue.put`` hands off to."""
    while inbox.get() is not None:
        pass


def _time_ns(func: Callable[[], object]) -> int:
    start = time.perf_counter_ns()
    func()
    return time.perf_counter_ns() - start


def _row(name: str, metric: str, us: list[float], base: list[float] | None, base_name: str) -> Row:
    row = Row("client_cost", name, metric, "us", median(us))
    row.p99, row.n = p99(us), len(us)
    if base:
        row.baseline, row.baseline_name = median(base), base_name
        row.ratio = row.median / row.baseline
    return row


def run(
    quick: bool = True, *, calls: int | None = None, alloc_calls: int | None = None
) -> BenchResult:
    """Run benchmark 5.

    Args:
        quick: 1,000 timed calls per case, 10,000 for allocation growth; full: 10,000
            timed calls, 100,000 for allocation growth.
        calls: Timed calls per case (overrides the mode).
        alloc_calls: Calls between the two allocation snapshots (default 100,000).
    """
    n = calls or (1_000 if quick else 10_000)
    n_alloc = alloc_calls or (10_000 if quick else 100_000)
    new_steps = min(n, 500)  # each journals a begin: an fsync apiece
    md = _metadata()
    raw: dict[str, Any] = {}
    with scratch_dir() as work:
        root = work / "run"
        root.mkdir()
        rootp = str(root)
        with Daemon(work, [root], keep_events=False) as daemon:
            client = CheckpointClient(daemon.socket, begin_timeout=10.0)
            assert client.ping(10.0)
            # World size 2 and only rank 0: the saves stay open and nothing is promoted.
            base_reg: list[float] = []
            base_set: list[float] = []
            handoff: list[float] = []
            handoff_q: list[float] = []
            handoff_idle: list[float] = []
            track_new: list[float] = []
            track_again: list[float] = []
            begin_new: list[float] = []
            add_seal: list[float] = []
            callback: list[float] = []
            base_stat: list[float] = []
            mkdir_new: list[float] = []
            mkdir_exists: list[float] = []
            save_new: list[float] = []
            dirs = root / "dirs"
            dirs.mkdir()
            loop = asyncio.new_event_loop()
            looper = threading.Thread(target=loop.run_forever, daemon=True)
            looper.start()
            inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
            taker = threading.Thread(target=_take_forever, args=(inbox,), daemon=True)
            taker.start()
            for i in range(n):
                fut: Future[Any] = Future()
                base_reg.append(_time_ns(partial(fut.add_done_callback, _noop)) / 1000)
                base_set.append(_time_ns(partial(fut.set_result, md)) / 1000)
                handoff.append(_time_ns(partial(loop.call_soon_threadsafe, _noop, fut)) / 1000)
                handoff_q.append(_time_ns(partial(inbox.put, fut)) / 1000)
                # Each timed call starts with nothing queued for the daemon.
                if i < new_steps:  # a new step: begin is journaled before it is acknowledged
                    client.flush(30.0)
                    fut = Future()
                    track = partial(client.track, rootp, 1_000_000 + i, 0, 2, fut, dcp_dir=".")
                    track_new.append(_time_ns(track) / 1000)
                    fut.set_result(md)
                    client.flush(30.0)
                    begin = partial(client.begin, rootp, 2_000_000 + i, 0, 2)
                    begin_new.append(_time_ns(begin) / 1000)
                    client.flush(30.0)
                    start = time.perf_counter_ns()
                    opened = client.save(rootp, 3_000_000 + i, 0, 2, wait=False)
                    save_new.append((time.perf_counter_ns() - start) / 1000)
                    opened.seal()
                    client.flush(30.0)  # the client's threads idle again: nothing competes
                    base_stat.append(_time_ns(partial(os.stat, rootp)) / 1000)
                    fresh = str(dirs / f"d{i}")
                    mkdir_new.append(_time_ns(partial(make_step_dir, fresh)) / 1000)
                    mkdir_exists.append(_time_ns(partial(make_step_dir, fresh)) / 1000)
                client.flush(30.0)
                fut = Future()
                track = partial(client.track, rootp, 1, 0, 2, fut, dcp_dir=".")
                track_again.append(_time_ns(track) / 1000)
                client.flush(30.0)
                callback.append(_time_ns(partial(fut.set_result, md)) / 1000)
                handle = client.save(rootp, 1, 0, 2)
                client.flush(30.0)
                fut = Future()

                def add_and_seal(h: Any = handle, f: Future[Any] = fut) -> None:
                    h.add(f, dcp_dir=".")
                    h.seal()

                add_seal.append(_time_ns(add_and_seal) / 1000)
                fut.set_result(md)
            # The same hand-off to a thread that has slept a while, as the client's relay
            # has between two checkpoints: waking it is the kernel's (and hypervisor's)
            # cross-CPU wake-up, paid by the caller.
            for _ in range(min(n, 200)):
                time.sleep(0.02)
                handoff_idle.append(_time_ns(partial(inbox.put, 0)) / 1000)
            loop.call_soon_threadsafe(loop.stop)
            looper.join(10.0)
            loop.close()
            inbox.put(None)
            taker.join(10.0)
            assert client.flush(30.0)

            # Allocation growth across many calls: the traced size after each tenth of
            # them (flushed, collected); growth is the last minus the first.
            def cycle(count: int) -> None:
                for i in range(count):
                    f: Future[Any] = Future()
                    client.track(rootp, 3, 0, 2, f, dcp_dir=".")
                    f.set_result(md)
                    if i % 100 == 99:  # a trainer is never far ahead of the daemon either
                        client.flush(30.0)
                client.flush(30.0)

            cycle(1000)  # warm caches and freelists
            tracemalloc.start()
            sizes: list[int] = []
            for _block in range(10):
                cycle(n_alloc // 10)
                gc.collect()
                sizes.append(tracemalloc.get_traced_memory()[0])
            tracemalloc.stop()
            client.close()
    rows = [
        _row("track(), new step", "training thread", track_new, base_reg, "add_done_callback"),
        _row(
            "track(), step already begun",
            "training thread",
            track_again,
            base_reg,
            "add_done_callback",
        ),
        _row("SaveHandle.add + seal", "training thread", add_seal, base_reg, "add_done_callback"),
        _row(
            "done-callback (set_result)",
            "writer thread",
            callback,
            base_set,
            "set_result, no-op cb",
        ),
    ]
    for row in rows:
        row.target, row.met = "p50 < 20 us", row.median < 20.0
    saved = _row(
        "save(wait=False), new step", "training thread", save_new, base_reg, "add_done_callback"
    )
    saved.note = "begin queued, the step's directory created (layout known)"
    rows.append(saved)
    for name, samples in (("new", mkdir_new), ("exists (EEXIST)", mkdir_exists)):
        made = _row(f"step directory, {name}", "training thread", samples, base_stat, "os.stat")
        made.note = "one mkdir: what save() adds for the path contract"
        rows.append(made)
    ack = _row("begin() acknowledged, new step", "round trip", begin_new, None, "")
    ack.note = "what orchestrator.async_save overlaps with dcp.async_save's own work"
    floor = _row("call_soon_threadsafe", "hand-off to a loop thread", handoff, None, "")
    floor.note = "wakes the loop through its self-pipe: the woken thread takes the GIL"
    queued = _row("SimpleQueue.put", "hand-off to a blocked thread", handoff_q, None, "")
    queued.note = "the client's hand-off: the caller keeps the GIL"
    idle = _row(
        "SimpleQueue.put, taker idle 20 ms", "hand-off to a sleeping thread", handoff_idle, None, ""
    )
    idle.note = "the wake-up of a thread (and CPU) that was idle: what an isolated call pays"
    rows += [ack, floor, queued, idle]
    growth = Row(
        "client_cost",
        f"{n_alloc:,} x track + done",
        "allocation growth",
        "bytes",
        float(sizes[-1] - sizes[0]),
    )
    growth.p99, growth.n = float(max(sizes) - min(sizes)), n_alloc
    growth.target = "no growth (< 64 KiB)"
    growth.met = sizes[-1] - sizes[0] < 64 * 1024
    growth.note = "traced size after the last tenth minus after the first; p99 column: max - min"
    rows.append(growth)
    raw.update(
        {
            "track_new_us": track_new,
            "track_again_us": track_again,
            "begin_new_us": begin_new,
            "handoff_queue_us": handoff_q,
            "handoff_idle_us": handoff_idle,
            "add_seal_us": add_seal,
            "save_new_us": save_new,
            "stat_us": base_stat,
            "mkdir_new_us": mkdir_new,
            "mkdir_exists_us": mkdir_exists,
            "callback_us": callback,
            "handoff_us": handoff,
            "alloc_sizes": sizes,
        }
    )
    return BenchResult(rows, raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--calls", type=int)
    parser.add_argument("--alloc-calls", type=int)
    args = parser.parse_args()
    print_table(run(not args.full, calls=args.calls, alloc_calls=args.alloc_calls).rows)


if __name__ == "__main__":
    main()

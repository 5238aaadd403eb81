"""One rank of the training-stall benchmark: a real gloo job saving the same state many ways.

Started by :mod:`bench.stall` (and :mod:`bench.disk`) once per rank, as
``tests/_dcp_worker.py`` is by the tests. Each round saves the same per-rank state once
per variant, in rotating order so that drift on a loaded machine hits every variant
alike, and prints one JSON line per save:

- ``a``: synchronous ``dcp.save`` into ``tmp_step_N``, then rank 0 renames it.
- ``b``: NeMo-RL's pattern: ``dcp.async_save``, wait for the upload, barrier, rank 0
  renames (the training thread is blocked until the rename).
- ``c``: bare ``dcp.async_save``: the floor (no daemon, no promotion).
- ``d``: ckptd: ``orchestrator.async_save`` (begin sent, ``dcp.async_save``, the
  begin's acknowledgement awaited, done from the upload callback); the daemon promotes.
- ``e``: as ``d``, with the acknowledgement awaited *before* ``dcp.async_save``
  (``client.save()`` then ``async_save(handle=...)``): what overlapping the round trip
  with DCP's own work saves.
- ``disk``: rank 0 writes the same volume as both ranks' shards with ``write`` and one
  ``fsync`` (the disk's sequential bandwidth, for :mod:`bench.disk`).

``b`` to ``e`` use one CPU-safe ``DefaultStager`` and the same gloo checkpoint group
(``orchestrator.checkpoint_group``), so the ratios isolate what ckptd adds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import async_save, save

import orchestrator

_CHUNK = 8 * 1024 * 1024


def say(**fields: Any) -> None:
    """One JSON line for the parent."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def make_state(rank: int, mb: int, tensors: int = 8) -> dict[str, torch.Tensor]:
    """``mb`` MiB of float32 random values in ``tensors`` tensors (incompressible).

    The names are the rank's own, as with sharded (FSDP) state: DCP would otherwise
    deduplicate identical names across ranks and each rank would write only part.
    """
    gen = torch.Generator().manual_seed(rank)
    numel = mb * 1024 * 1024 // 4 // tensors
    return {f"rank{rank}.layer{i}.weight": torch.rand(numel, generator=gen) for i in range(tensors)}


def _stamp(holder: dict[str, float], key: str) -> Any:
    def callback(_fut: Any) -> None:
        holder[key] = time.time()

    return callback


def _disk_baseline(path: str, nbytes: int) -> float:
    """Seconds to write ``nbytes`` sequentially and fsync them."""
    block = os.urandom(_CHUNK)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    start = time.perf_counter()
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, block[: min(left, _CHUNK)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True, help="directory with one root per variant")
    parser.add_argument("--mb", type=int, required=True, help="MiB of state per rank")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--variants", default="a,b,c,d")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    variants = args.variants.split(",")
    roots = {v: os.path.join(args.base, v) for v in variants}
    state = make_state(rank, args.mb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    group = orchestrator.checkpoint_group("")
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=False,
        )
    )
    clients: dict[str, orchestrator.CheckpointClient] = {}
    if "d" in variants:
        clients["d"] = orchestrator.CheckpointClient(begin_timeout=10.0)
    if "e" in variants:
        clients["e"] = orchestrator.CheckpointClient(begin_timeout=10.0)
    for client in clients.values():
        client.ping(10.0)  # connected before the first timed save
    say(event="ready", rank=rank, bytes=nbytes)

    step = 0
    for round_no in range(args.warmup + args.saves):
        shift = round_no % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            step += 1
            root = roots[variant]
            tmp, final = os.path.join(root, f"tmp_step_{step}"), os.path.join(root, f"step_{step}")
            times: dict[str, float] = {}
            dist.barrier()
            t0 = time.time()
            start = time.perf_counter()
            if variant == "disk":
                if rank == 0:
                    os.makedirs(tmp, exist_ok=True)
                    times["disk_s"] = _disk_baseline(os.path.join(tmp, "seq.bin"), nbytes * world)
                blocked = time.perf_counter() - start
            elif variant == "a":
                save(state, checkpoint_id=tmp, process_group=group)
                if rank == 0:
                    os.rename(tmp, final)
                    times["visible"] = time.time()
                blocked = time.perf_counter() - start
            elif variant == "b":
                resp: Any = async_save(
                    state, checkpoint_id=tmp, process_group=group, async_stager=stager
                )
                resp.staging_completion.add_done_callback(_stamp(times, "staged"))
                resp.upload_completion.add_done_callback(_stamp(times, "landed"))
                resp.upload_completion.result()
                dist.barrier()
                if rank == 0:
                    os.rename(tmp, final)
                    times["visible"] = time.time()
                blocked = time.perf_counter() - start
            elif variant == "c":
                resp = async_save(
                    state, checkpoint_id=tmp, process_group=group, async_stager=stager
                )
                blocked = time.perf_counter() - start
            else:  # d, e: ckptd
                handle = None
                if variant == "e":
                    handle = clients[variant].save(root, step, rank, world)
                    times["begin_s"] = time.perf_counter() - start
                resp = orchestrator.async_save(
                    state,
                    root=root,
                    step=step,
                    client=clients[variant],
                    handle=handle,
                    process_group=group,
                    async_stager=stager,
                )
                if handle is not None:
                    handle.seal()
                blocked = time.perf_counter() - start
            if variant in ("c", "d", "e"):
                resp.staging_completion.add_done_callback(_stamp(times, "staged"))
                resp.upload_completion.add_done_callback(_stamp(times, "landed"))
                resp.upload_completion.result()
            if variant in ("d", "e") and rank == 0:
                reply = clients[variant].wait(root, step, timeout=120.0)
                if reply.state != "promoted":
                    raise SystemExit(f"step {step} of {root} not promoted: {reply}")
            # Let any callback stamps land before reporting them.
            while variant in ("b", "c", "d", "e") and "landed" not in times:
                time.sleep(0.001)
            say(
                event="sample",
                rank=rank,
                variant=variant,
                step=step,
                warmup=round_no < args.warmup,
                mb=args.mb,
                bytes=nbytes,
                t0=t0,
                blocked_s=blocked,
                **{
                    k: (v - t0 if k in ("staged", "landed", "visible") else v)
                    for k, v in times.items()
                },
            )
            dist.barrier()
            if rank == 0:
                for path in (tmp, final):
                    shutil.rmtree(path, ignore_errors=True)
                os.sync()
            dist.barrier()
    for client in clients.values():
        client.close(timeout=30.0)
    stager.close()
    dist.barrier()
    dist.destroy_process_group()
    say(event="finished", rank=rank, threads=threading.active_count())


if __name__ == "__main__":
    main()

"""One rank of a real multi-process DCP job that checkpoints through ckptd.

Started by the tests as ``python tests/_dcp_worker.py`` once per rank (gloo, CPU). It
prints one JSON object per line on stdout so the test can follow it. A rank can be told
to hold its upload at a FIFO gate, before writing its shards (``write``) or, on the
coordinator, before writing ``.metadata`` (``finish``), so the test controls exactly
when its writes land.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.futures
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.storage import WriteResult

import orchestrator


def state_for(rank: int, step: int, numel: int, part: str = "") -> dict[str, torch.Tensor]:
    """The deterministic tensors rank ``rank`` saves at ``step`` for ``part``."""
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + len(part))
    return {
        f"{part}rank{rank}.weight": torch.randn(numel, generator=gen),
        f"{part}rank{rank}.bias": torch.arange(16, dtype=torch.int64) + step,
        f"{part}shared.step": torch.tensor([step]),
    }


def say(**fields: Any) -> None:
    """One JSON line for the test."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def _gate(path: str, rank: int, where: str) -> None:
    # Open first, then say "held": a release (the test opening the FIFO to write) that
    # comes after "held" always finds this reader there to wake.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        say(event="held", rank=rank, at=where)
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while not poller.poll():  # POLLIN with the byte, or POLLHUP once the writer closed
            pass
    finally:
        os.close(fd)
    say(event="released", rank=rank, at=where)


class HeldWriter(FileSystemWriter):
    """A real FileSystemWriter that waits at a FIFO gate before writing."""

    def __init__(self, path: str, gate: str, at: str, rank: int) -> None:
        super().__init__(path)
        self._gate_path, self._at, self._rank = gate, at, rank

    def write_data(
        self, plan: SavePlan, planner: SavePlanner
    ) -> torch.futures.Future[list[WriteResult]]:
        if self._at == "write":
            _gate(self._gate_path, self._rank, "write")
        return super().write_data(plan, planner)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self._at == "finish":
            _gate(self._gate_path, self._rank, "finish")
        super().finish(metadata, results)


class ReportingWriter(FileSystemWriter):
    """A real FileSystemWriter that says when DCP sets it up (before any directory/write)."""

    def __init__(self, path: str, rank: int, step: int) -> None:
        super().__init__(path)
        self._rank, self._step = rank, step

    def set_up_storage_writer(self, *args: Any, **kwargs: Any) -> None:
        say(event="writer_setup", rank=self._rank, step=self._step)
        super().set_up_storage_writer(*args, **kwargs)


def _step_dir(client: orchestrator.CheckpointClient, root: str, step: int) -> str:
    """Where the client names the step's directory without asking the daemon."""
    return client.step_path(root, step) or os.path.join(root, f"tmp_step_{step}")


def _plain_save(client: orchestrator.CheckpointClient, args: argparse.Namespace) -> None:
    """One ``orchestrator.async_save`` per step with no handle: it begins and seals."""
    rank = dist.get_rank()
    uploads = []
    for i, step in enumerate(int(s) for s in args.steps.split(",")):
        if i and args.gate:  # the first save teaches the client the root's layout
            _gate(args.gate, rank, f"step{step}")
        say(event="saving", rank=rank, step=step)
        result = orchestrator.async_save(
            state_for(rank, step, args.numel),
            root=args.root,
            step=step,
            client=client,
            storage_writer=ReportingWriter(args.root, rank, step),
        )
        path = _step_dir(client, args.root, step)
        say(event="save_returned", rank=rank, step=step, path=path, exists=os.path.isdir(path))
        uploads.append(getattr(result, "upload_completion", result))
    for upload in uploads:
        upload.result()


def _save_by(
    client: orchestrator.CheckpointClient, args: argparse.Namespace, step: int
) -> tuple[Any, orchestrator.SaveHandle | None]:
    """One save of ``step`` the way ``--mode`` says a trainer makes it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    state = state_for(rank, step, args.numel)
    handle = None
    if args.mode == "plain":  # async_save begins and seals its own handle
        result = orchestrator.async_save(state, root=args.root, step=step, client=client)
    elif args.mode == "handle":  # the caller's handle, begun and awaited first
        handle = client.save(args.root, step, rank, world)
        result = orchestrator.async_save(
            state, root=args.root, step=step, client=client, handle=handle
        )
        handle.seal()
    else:  # the caller's own dcp.async_save, gated on a handle begun first, then tracked
        handle = client.save(args.root, step, rank, world, wait=False)
        group = orchestrator.checkpoint_group()
        result = dcp_async_save(
            state,
            checkpoint_id=handle.path,
            process_group=group,
            planner=orchestrator.AfterBeginPlanner(handle),
        )
        client.track(
            args.root,
            step,
            rank,
            world,
            result,
            dcp_dir=".",
            group_rank=dist.get_rank(group),
            handle=handle,
        )
    path = handle.path if handle is not None else _step_dir(client, args.root, step)
    say(event="save_returned", rank=rank, step=step, path=path, exists=os.path.isdir(path))
    return result, handle


def _saves_by_mode(client: orchestrator.CheckpointClient, args: argparse.Namespace) -> None:
    """Each step saved in turn (``--mode``), its outcome reported before the next."""
    rank = dist.get_rank()
    for i, step in enumerate(int(s) for s in args.steps.split(",")):
        if i and args.gate:
            _gate(args.gate, rank, f"save{i}")
        result, handle = _save_by(client, args, step)
        upload = getattr(result, "upload_completion", result)
        try:
            upload.result()
            ok, error = True, ""
        except BaseException as exc:  # CheckpointException derives from BaseException
            ok, error = False, str(exc)[:8000]
        refusal = None if handle is None or handle.refusal is None else handle.refusal.code
        say(event="upload_done", rank=rank, step=step, save=i, ok=ok, error=error, refusal=refusal)
        if ok and args.wait_promoted and rank == 0:
            say(event="settled", step=step, state=client.wait(args.root, step, 60.0).state)
        dist.barrier()  # a refused save's DCP plan failed on every rank: the group is fine


def _write_extra(
    handle: orchestrator.SaveHandle, rank: int, args: argparse.Namespace
) -> Future[None]:
    """A plain per-rank file written by a background thread, tracked with the step."""
    future: Future[None] = Future()
    data = bytes(range(256)) * 64
    rel = f"extra/rank{rank}.bin"

    def write() -> None:
        if rank == args.hold_rank and args.hold_at == "extra":
            _gate(args.gate, rank, "extra")
        os.makedirs(os.path.join(handle.path, "extra"), exist_ok=True)
        with open(os.path.join(handle.path, rel), "wb") as fh:
            fh.write(data)
            os.fsync(fh.fileno())
        future.set_result(None)

    handle.add(future)
    handle.add_files([orchestrator.FileEntry(rel, len(data))])
    threading.Thread(target=write, daemon=True).start()
    return future


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--steps", default="1")
    parser.add_argument("--numel", type=int, default=4096)
    parser.add_argument("--hold-rank", type=int, default=-1)
    parser.add_argument("--hold-at", choices=["write", "finish", "extra"], default="write")
    parser.add_argument("--extra", action="store_true", help="also write a per-rank file")
    parser.add_argument("--gate", default="")
    parser.add_argument("--stager", action="store_true", help="use a CPU-safe DefaultStager")
    parser.add_argument("--parts", default="", help="DCP subdirs per step, e.g. model,optim")
    parser.add_argument("--plain", action="store_true", help="async_save without a handle")
    parser.add_argument(
        "--mode", choices=["plain", "handle", "track"], help="save each step this way, in turn"
    )
    parser.add_argument("--wait-promoted", action="store_true", help="wait for each step")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    client = orchestrator.CheckpointClient(begin_timeout=10.0)
    if args.plain or args.mode:
        (_saves_by_mode if args.mode else _plain_save)(client, args)
        dist.barrier()
        say(event="finished", rank=rank, world=world)
        client.close()
        dist.destroy_process_group()
        return
    handles = []
    parts = args.parts.split(",") if args.parts else [""]
    for step in [int(s) for s in args.steps.split(",")]:
        handle = client.save(args.root, step, rank, world)
        for part in parts:
            kwargs: dict[str, Any] = {"client": client, "handle": handle}
            if rank == args.hold_rank and part == parts[-1]:
                kwargs["storage_writer"] = HeldWriter(args.root, args.gate, args.hold_at, rank)
            if args.stager:
                kwargs["async_stager"] = DefaultStager(
                    StagingOptions(
                        use_pinned_memory=False,
                        use_shared_memory=False,
                        use_async_staging=True,
                        use_non_blocking_copy=False,
                    )
                )
            start = time.perf_counter()
            result = orchestrator.async_save(
                state_for(rank, step, args.numel, part),
                root=args.root,
                step=step,
                subdir=part,
                **kwargs,
            )
            blocked = time.perf_counter() - start
            say(event="save_returned", rank=rank, step=step, part=part, blocked_s=blocked)
            upload = getattr(result, "upload_completion", result)
            upload.add_done_callback(
                lambda f, step=step, part=part: say(
                    event="upload_done", rank=rank, step=step, part=part, ok=f.exception() is None
                )
            )
            handles.append(result)
        if args.extra:
            handles.append(_write_extra(handle, rank, args))
        handle.seal()
    for result in handles:
        upload = getattr(result, "upload_completion", result)
        try:
            upload.result()
        except BaseException as exc:  # CheckpointException derives from BaseException
            say(event="upload_failed", rank=rank, error=repr(exc)[:500])
            client.close(timeout=10)
            os._exit(3)  # the process group is broken: a barrier would hang
    dist.barrier()
    say(event="finished", rank=rank, world=world)
    client.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

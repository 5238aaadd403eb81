"""One rank of a real DCP job for the fault-injection suite (gloo, CPU).

Started once per rank by :class:`tests.faults.harness.Ranks`. Like ``tests/_dcp_worker.py``
(whose tensors it reuses) it prints one JSON object per line, and it
also reports what the daemon answered: every ``begin`` (acknowledged or not) and every
``done``/``fail`` once the daemon replied to it, so the harness knows which changes were
acknowledged and must survive a daemon crash.

Modes:
- ``--steps 1,2,3``: save those steps.
- ``--stream STOPFILE``: save steps 1, 2, 3, ... until ``STOPFILE`` exists (rank 0
  decides and tells the others), as a trainer checkpointing every step would.

Faults: ``--pause-before`` holds every rank at a FIFO gate before a step (so the harness
can fill or free a disk in between); ``--fault raise`` makes one rank's storage writer
raise ``EIO`` at one step; ``--fault hold`` holds one rank's upload at the gate, so the
harness can SIGKILL or SIGSTOP it mid-upload. Each gate has one reader at a time (the
pause has its own FIFO when both are used), so one release frees exactly one wait.

A gate is a FIFO the rank opens read-write before it says ``held``: from then on the
harness's write never blocks and is never lost, even if the rank is stopped before it
reads (a plain blocking open would leave the harness waiting on a stopped reader).
"""

from __future__ import annotations

import argparse
import errno
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.futures
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

import orchestrator
from orchestrator import protocol as p
from tests._dcp_worker import say, state_for


def hold(path: str, rank: int, where: str) -> None:
    """Wait at the FIFO gate ``path`` until the harness writes a byte to it."""
    fd = os.open(path, os.O_RDWR)  # Linux: never blocks, and keeps the FIFO readable
    try:
        say(event="held", rank=rank, at=where)
        os.read(fd, 1)
    finally:
        os.close(fd)
    say(event="released", rank=rank, at=where)


class HoldingWriter(FileSystemWriter):
    """A real FileSystemWriter that waits at a gate before writing its shards."""

    def __init__(self, path: str, gate: str, rank: int) -> None:
        super().__init__(path)
        self._gate, self._rank = gate, rank

    def write_data(
        self, plan: SavePlan, planner: SavePlanner
    ) -> torch.futures.Future[list[WriteResult]]:
        hold(self._gate, self._rank, "write")
        return super().write_data(plan, planner)


class AckLoggingClient(orchestrator.CheckpointClient):
    """The real client, reporting each ``done``/``fail`` once the daemon answered it.

    The request goes through the client's own queue (re-sent after reconnects exactly as
    a plain ``done`` is); only the wait for its reply happens on a side thread, so the
    writer's callback returns at once.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reporters: list[threading.Thread] = []

    def done(
        self, root: str, step: int, rank: int, files: Any = (), *, metrics: Any = None
    ) -> None:
        """See :meth:`CheckpointClient.done`."""
        done = p.Done(id=0, root=root, step=step, rank=rank, files=list(files), metrics=metrics)
        self._report(done)

    def fail(self, root: str, step: int, rank: int, reason: str) -> None:
        """See :meth:`CheckpointClient.fail`."""
        self._report(p.Fail(id=0, root=root, step=step, rank=rank, reason=reason[:4000]))

    def _report(self, request: p.Done | p.Fail) -> None:
        op = "done" if isinstance(request, p.Done) else "fail"

        def call() -> None:
            try:
                self.call(request, timeout=3600.0)
            except orchestrator.DaemonError as exc:
                say(event="acked", op=op, step=request.step, rank=request.rank, code=exc.code)
                return
            say(event="acked", op=op, step=request.step, rank=request.rank, code=None)

        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        self.reporters.append(thread)


class RaisingWriter(FileSystemWriter):
    """A real FileSystemWriter whose ``write_data`` fails as a dying disk would."""

    def write_data(
        self, plan: SavePlan, planner: SavePlanner
    ) -> torch.futures.Future[list[WriteResult]]:
        raise OSError(errno.EIO, "injected EIO at the storage boundary")


def _steps(args: argparse.Namespace, rank: int) -> Iterator[int]:
    if not args.stream:
        yield from (int(s) for s in args.steps.split(","))
        return
    step = 1
    while True:
        flag = torch.tensor([int(rank == 0 and os.path.exists(args.stream))])
        dist.broadcast(flag, 0)
        if flag.item():
            return
        yield step
        step += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--steps", default="1")
    parser.add_argument("--stream", default="", metavar="STOPFILE")
    parser.add_argument("--numel", type=int, default=1024)
    parser.add_argument("--gate", default="")
    parser.add_argument("--pause-before", default="", help="steps to hold every rank before")
    parser.add_argument("--pause-gate", default="", help="FIFO for --pause-before (--gate)")
    parser.add_argument("--fault", choices=["none", "raise", "hold"], default="none")
    parser.add_argument("--fault-rank", type=int, default=-1)
    parser.add_argument("--fault-step", type=int, default=-1)
    parser.add_argument("--begin-timeout", type=float, default=1.0)
    parser.add_argument("--train-s", type=float, default=0.0, help="training time per step")
    args = parser.parse_args()
    pauses = {int(s) for s in args.pause_before.split(",") if s}

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    client = AckLoggingClient(begin_timeout=args.begin_timeout, reconnect_max=0.5)
    uploads: list[Any] = []
    for step in _steps(args, rank):
        time.sleep(args.train_s)  # stands for the forward/backward passes between saves
        if step in pauses:
            if rank == 0:
                hold(args.pause_gate or args.gate, rank, f"step{step}")
            dist.barrier()
        handle = client.save(args.root, step, rank, world)
        say(event="begun", rank=rank, step=step, acked=handle.begun.acknowledged)
        kwargs: dict[str, Any] = {}
        if rank == args.fault_rank and step == args.fault_step:
            tmp = handle.path
            if args.fault == "raise":
                kwargs["storage_writer"] = RaisingWriter(tmp)
            elif args.fault == "hold":
                kwargs["storage_writer"] = HoldingWriter(tmp, args.gate, rank)
        result = orchestrator.async_save(
            state_for(rank, step, args.numel),
            root=args.root,
            step=step,
            client=client,
            handle=handle,
            **kwargs,
        )
        handle.seal()
        upload = getattr(result, "upload_completion", result)
        upload.add_done_callback(
            lambda f, step=step: say(
                event="upload",
                rank=rank,
                step=step,
                ok=f.exception() is None,
                error=None if f.exception() is None else repr(f.exception())[:300],
            )
        )
        uploads.append(upload)
    for upload in uploads:
        try:
            upload.result()
        except BaseException:  # CheckpointException derives from BaseException
            pass  # reported by the callback above and, as a fail, to the daemon
    deadline = time.monotonic() + 300.0
    for thread in client.reporters:  # every done/fail answered (the daemon may restart)
        thread.join(max(0.0, deadline - time.monotonic()))
    dist.barrier()
    say(event="finished", rank=rank, world=world)
    client.close(timeout=30.0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

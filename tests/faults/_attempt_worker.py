"""One rank of a real DCP job for the attempt scenarios (gloo, CPU).

Started once per rank by :class:`tests.faults.harness.Ranks` from
``tests/faults/attempts.py``. It saves with ``orchestrator.async_save`` and the real
``CheckpointClient``, and prints one JSON object per line: every ``begin`` and what the
daemon answered, and every file it wrote with its SHA-256, said by the storage writer
right after the write (so before the upload completes and the rank reports ``done``).
The scenarios compare a promoted step with what each attempt wrote.

Each job has a number (``--job``) that its tensors depend on, besides the rank and the
step: two attempts at one step write different bytes under the same file names
(``__0_0.distcp``), and ``dcp.load`` tells whose tensors a checkpoint holds.

Options:
- ``--steps 1,2``: the steps to save.
- ``--resume``: first load the newest promoted checkpoint (the daemon's ``latest``) and
  say which step it was and a digest of what it held, as a resumed trainer does.
- ``--pre-begin NAME``: before a step's ``begin``, rank 0 writes ``NAME`` into the
  step's tmp directory (NeMo-RL's ``training_info.json``); every rank begins after it.
  ``--pre-begin-steps`` says before which steps (default ``all``). A write that fails
  (the directory went away under it) is said (``write_failed``) and the step goes on.
- ``--gate FIFO --pause-before STEPS``: rank 0 waits at the gate before each of those
  steps (``all``: every step), then every rank goes on together.
- ``--hold-rank R --hold-step S --hold-gate FIFO``: rank R's storage writer waits at its
  gate before it writes step S's shards (the upload is in flight, nothing of R's on disk).
- ``--fail-steps STEPS``: once the step's upload has landed, report ``fail`` instead of
  ``done`` (a trainer that fails after its writes landed).
- ``--skip-refused``: a step whose ``begin`` the daemon refused on any rank is not saved.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.futures
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.storage import WriteResult

import orchestrator
from orchestrator import protocol as p
from tests._dcp_worker import say, state_for
from tests.faults._worker import hold

__all__ = ["digest", "job_state", "tensor_digest"]


def job_state(rank: int, step: int, numel: int, job: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` of job ``job`` saves at ``step`` (keys as ``state_for``'s)."""
    state = state_for(rank, step, numel)
    gen = torch.Generator().manual_seed(1_000_003 * job + 1000 * step + rank)
    state[f"rank{rank}.weight"] = torch.randn(numel, generator=gen)
    return state


def tensor_digest(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over a state dict's keys and tensor bytes, in key order."""
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].contiguous().numpy().tobytes())
    return h.hexdigest()


def digest(path: str) -> str:
    """SHA-256 of the file at ``path``."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class RecordingWriter(FileSystemWriter):
    """A real FileSystemWriter that says what it wrote, with hashes, right after writing.

    ``write_data`` writes synchronously before it returns its future, and the upload
    completes (and ``done`` can be sent) only after it and ``finish`` returned: every
    ``wrote`` line precedes the rank's ``done``. A write that raises is said too
    (``write_failed``, with the error), then raised as before.
    """

    def __init__(self, path: str, rank: int, step: int, job: int, gate: str = "") -> None:
        super().__init__(path)
        self._rank, self._step, self._job, self._gate = rank, step, job, gate

    def write_data(
        self, plan: SavePlan, planner: SavePlanner
    ) -> torch.futures.Future[list[WriteResult]]:
        if self._gate:
            hold(self._gate, self._rank, "write")
        try:
            future = super().write_data(plan, planner)
            self._wrote(sorted({r.storage_data.relative_path for r in future.wait()}))
        except BaseException as exc:
            self._failed("write_data", exc)
            raise
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            super().finish(metadata, results)
            self._wrote([".metadata"])
        except BaseException as exc:
            self._failed("finish", exc)
            raise

    def _wrote(self, names: list[str]) -> None:
        where = str(self.path)
        files = {n: digest(os.path.join(where, n)) for n in names}
        say(event="wrote", rank=self._rank, step=self._step, job=self._job, dir=where, files=files)

    def _failed(self, stage: str, exc: BaseException) -> None:
        say(
            event="write_failed",
            rank=self._rank,
            step=self._step,
            job=self._job,
            stage=stage,
            dir=str(self.path),
            error=repr(exc)[:300],
        )


def _steps(spec: str) -> list[int]:
    return [int(s) for s in spec.split(",") if s]


def _resume(client: orchestrator.CheckpointClient, args: argparse.Namespace, rank: int) -> None:
    """Load the newest promoted checkpoint on every rank, as a resumed trainer does."""
    reply = client.call(p.Latest(id=0, root=args.root), timeout=30.0)
    step, path = int(reply["step"]), str(reply["path"])
    template = {k: torch.empty_like(v) for k, v in job_state(rank, step, args.numel, 0).items()}
    dcp_load(template, checkpoint_id=path)
    say(event="resumed", rank=rank, step=step, path=path, digest=tensor_digest(template))


def _pre_begin(client: orchestrator.CheckpointClient, args: argparse.Namespace, step: int) -> None:
    """Rank 0 writes the step's pre-begin file into its tmp directory, before ``begin``."""
    tmp = client.step_path(args.root, step) or os.path.join(args.root, f"tmp_step_{step}")
    data = json.dumps({"job": args.job, "step": step, "pid": os.getpid()}).encode()
    try:
        os.makedirs(tmp, exist_ok=True)
        with open(os.path.join(tmp, args.pre_begin), "wb") as fh:
            fh.write(data)
    except OSError as exc:  # the directory went away between the two calls
        fields = {"stage": "pre_begin", "dir": tmp, "error": repr(exc)[:300]}
        say(event="write_failed", rank=0, step=step, job=args.job, **fields)
        return
    files = {args.pre_begin: hashlib.sha256(data).hexdigest()}
    say(event="wrote", rank=0, step=step, job=args.job, dir=tmp, files=files, pre_begin=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--job", type=int, required=True)
    parser.add_argument("--steps", default="1")
    parser.add_argument("--numel", type=int, default=1024)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--pre-begin", default="", metavar="NAME")
    parser.add_argument("--pre-begin-steps", default="all", help="steps, or 'all'")
    parser.add_argument("--gate", default="")
    parser.add_argument("--pause-before", default="", help="steps, or 'all'")
    parser.add_argument("--hold-rank", type=int, default=-1)
    parser.add_argument("--hold-step", type=int, default=-1)
    parser.add_argument("--hold-gate", default="")
    parser.add_argument("--fail-steps", default="", help="steps, or 'all'")
    parser.add_argument("--skip-refused", action="store_true")
    parser.add_argument("--begin-timeout", type=float, default=10.0)
    args = parser.parse_args()
    steps = _steps(args.steps)
    pauses = set(steps) if args.pause_before == "all" else set(_steps(args.pause_before))
    fails = set(steps) if args.fail_steps == "all" else set(_steps(args.fail_steps))
    early = set(steps) if args.pre_begin_steps == "all" else set(_steps(args.pre_begin_steps))
    early = early if args.pre_begin else set()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    client = orchestrator.CheckpointClient(begin_timeout=args.begin_timeout, reconnect_max=0.5)
    if args.resume:
        _resume(client, args, rank)
    uploads: list[Any] = []
    reporting: list[orchestrator.SaveHandle] = []  # handles that report done or fail
    refused = False
    for step in steps:
        if step in pauses:
            if rank == 0:
                hold(args.gate, rank, f"step{step}")
            dist.barrier()
        if step in early:
            if rank == 0:
                _pre_begin(client, args, step)
            dist.barrier()
        handle = client.save(args.root, step, rank, world)
        begun = handle.begun
        code = None if begun.error is None else begun.error.code
        attempt = getattr(begun, "attempt", None)
        say(
            event="begun",
            rank=rank,
            step=step,
            acked=begun.acknowledged,
            code=code,
            attempt=attempt,
        )
        if args.skip_refused:
            every = torch.tensor([int(begun.acknowledged)])
            dist.all_reduce(every, op=dist.ReduceOp.MIN)
            if not every.item():
                if begun.acknowledged:
                    handle.fail("another rank's begin was refused")
                    reporting.append(handle)
                refused |= not begun.acknowledged
                say(event="skipped", rank=rank, step=step)
                continue
        gate = args.hold_gate if (rank, step) == (args.hold_rank, args.hold_step) else ""
        writer = RecordingWriter(handle.path, rank, step, args.job, gate)
        result = orchestrator.async_save(
            job_state(rank, step, args.numel, args.job),
            root=args.root,
            step=step,
            client=client,
            handle=handle,
            storage_writer=writer,
        )
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
        if step in fails:
            try:
                upload.result()
            except BaseException:  # CheckpointException derives from BaseException
                pass  # the handle reported it already
            handle.fail("the trainer failed after its writes landed")
        else:
            handle.seal()
        uploads.append(upload)
        reporting.append(handle)
    for upload in uploads:
        try:
            upload.result()
        except BaseException:  # reported by the callback above and, as a fail, to the daemon
            pass
    settled = all(h.wait_local(300.0) for h in reporting)
    say(event="flushed", rank=rank, settled=settled, ok=client.flush(60.0))
    dist.barrier()
    say(event="finished", rank=rank, world=world)
    # Everything was reported; a save whose begin was refused has nothing to wait for.
    client.close(timeout=0.0 if refused else 30.0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

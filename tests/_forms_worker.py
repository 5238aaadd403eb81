"""One rank of a real 2-rank job that saves a step in each of DCP's save forms through ckptd.

Started by ``tests/test_save_forms.py`` as ``python tests/_forms_worker.py`` once per
rank (gloo, CPU). Each form is saved the way its README recipe says, gated on a handle
begun first: per-rank metadata (``use_collectives=False``), the process writer with a
stager that returns an ``AsyncSaveResponse``, ``HuggingFaceStorageWriter`` consolidated
and sharded, ``orchestrator.save`` and a raw ``dcp.save`` tracked afterwards. Each is
saved twice: once intact, and once with one file damaged or removed after the save
landed, after rank 0 reported and before rank 1 sent the step's last ``done`` (a
negative control). Then rank 0 asks the daemon
how each step ended, every rank loads each promoted step back, and each says so as one
JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.hf_storage import (
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
)
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import orchestrator

FORMS = ("per_rank", "process", "hf_consolidated", "hf_sharded", "sync", "sync_raw")
"""Each saved intact at step ``1 + FORMS.index(form)``."""
DAMAGED = {
    "per_rank": (11, "__1.metadata", "remove"),
    "process": (12, "__0_0.distcp", "truncate"),
    "hf_consolidated": (13, "model-00001-of-00001.safetensors", "remove"),
    "hf_sharded": (14, "shard-00002-model-00001-of-00001.safetensors", "truncate"),
    "sync": (15, "__1_0.distcp", "truncate"),
}
"""Each form saved again at a step of its own, with this file damaged before ``done``."""
UNKNOWN_STEP = 16
"""A step whose only file, a ``torch.save`` of rank 0's, no rank reports."""


def state_for(rank: int, step: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` saves at ``step``: float tensors (HF consolidation needs them)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return {
        f"rank{rank}.weight": torch.randn(64, 16, generator=gen),
        "shared.bias": torch.arange(16, dtype=torch.float32) + step,
    }


def say(**fields: Any) -> None:
    """One JSON line for the test."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def _damage(directory: str, name: str, how: str) -> None:
    for sub in ("", "sharded"):
        path = os.path.join(directory, sub, name)
        if os.path.exists(path):
            if how == "remove":
                os.remove(path)
            else:
                os.truncate(path, os.path.getsize(path) // 2)
            say(event="damaged", path=os.path.relpath(path, directory), how=how)
            return
    raise AssertionError(f"nothing to damage: {name} is not in {directory}")


def _save(
    client: orchestrator.CheckpointClient,
    root: str,
    step: int,
    form: str,
    group: Any,
    stager: DefaultStager,
) -> tuple[orchestrator.SaveHandle, Callable[[], None]]:
    """Save ``step`` in ``form``, gated; returns its handle and what reports it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    state = state_for(rank, step)
    handle = client.save(root, step, rank, world, wait=False)
    if form == "sync":
        orchestrator.save(state, root=root, step=step, client=client, handle=handle)
        return handle, handle.seal
    planner = orchestrator.AfterBeginPlanner(handle)
    result: Any
    if form == "sync_raw":
        result = dcp_save(state, checkpoint_id=handle.path, process_group=group, planner=planner)
    elif form == "per_rank":
        result = dcp_async_save(
            state,
            checkpoint_id=handle.path,
            process_group=group,
            planner=planner,
            use_collectives=False,
        )
    elif form == "process":
        result = dcp_async_save(
            state,
            checkpoint_id=handle.path,
            process_group=group,
            planner=planner,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=stager,
        )
        assert isinstance(result, AsyncSaveResponse), result
    else:
        writer = HuggingFaceStorageWriter(
            handle.path, save_distributed=True, enable_consolidation=form == "hf_consolidated"
        )
        result = dcp_async_save(state, storage_writer=writer, process_group=group, planner=planner)
    upload = getattr(result, "upload_completion", result)
    if isinstance(upload, Future):
        upload.result()  # one upload at a time on the group; and the damage comes after it

    def report() -> None:
        client.track(
            root, step, rank, world, result, dcp_dir=".", group_rank=dist.get_rank(group),
            handle=handle,
        )  # fmt: skip

    return handle, report


def _load(path: str, step: int, form: str, group: Any) -> bool:
    """Load step ``step`` back from ``path`` as a reader of its form would."""
    rank = dist.get_rank()
    expected = state_for(rank, step)
    loaded = {k: torch.zeros_like(v) for k, v in expected.items()}
    if form.startswith("hf_"):
        dcp_load(loaded, storage_reader=HuggingFaceStorageReader(path), process_group=group)
    else:
        dcp_load(loaded, checkpoint_id=path, process_group=group)
    return all(torch.equal(loaded[k], v) for k, v in expected.items())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")
    client = orchestrator.CheckpointClient(begin_timeout=30.0)
    # CPU-safe options that return an AsyncSaveResponse (no pinned memory, no
    # non-blocking copies on a host without an accelerator).
    stager = DefaultStager(StagingOptions(False, False, True, False))
    for i, form in enumerate(FORMS):
        _handle, report = _save(client, args.root, i + 1, form, group, stager)
        report()
    for form, (step, name, how) in DAMAGED.items():
        # Rank 0 reports, then a file goes, then rank 1 sends the step's last done.
        handle, report = _save(client, args.root, step, form, group, stager)
        if rank == 0:
            report()
            assert handle.wait_local(30.0)
        dist.barrier()
        if rank == 0:
            _damage(handle.path, name, how)
        dist.barrier()
        if rank == 1:
            report()
    handle = client.save(args.root, UNKNOWN_STEP, rank, dist.get_world_size(), wait=False)
    if rank == 0:
        torch.save(state_for(0, UNKNOWN_STEP), os.path.join(handle.path, "model.pt"))
    handle.seal()
    steps = {i + 1: form for i, form in enumerate(FORMS)}
    for step in [*steps, *(s for s, _, _ in DAMAGED.values()), UNKNOWN_STEP]:
        waited = client.wait(args.root, step, 120.0)
        if rank == 0:
            say(event="settled", step=step, state=waited.state, reason=waited.reason or "")
        if waited.state == "promoted" and step in steps:
            assert waited.path is not None
            say(
                event="loaded",
                rank=rank,
                step=step,
                ok=_load(waited.path, step, steps[step], group),
            )
    stager.close()
    dist.barrier()
    say(event="finished", rank=rank)
    client.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

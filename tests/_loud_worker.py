"""One rank of a small gloo job for the loud-mistakes and superseded-run tests.

``--mode``:

- ``hold``: begin step ``--step`` (acknowledged), say ``begun``, then wait to be killed;
- ``resume``: ``orchestrator.async_save`` of step ``--step``, wait for the daemon's
  verdict, say ``saved`` with it;
- ``loud``: from ``--cwd``, save step 1 under the relative root ``--root`` (promoted),
  then step 1 again (``already_promoted``) and step 2 under ``--other`` (not configured),
  saying ``refused`` with what each raised and whether its directory is there;
- ``quiet``: the same with a client that is not strict: each refused call returns,
  and says ``returned``.

Lines are JSON. The environment says whether the process-wide client is strict.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

import torch
import torch.distributed as dist

import orchestrator


def say(**fields: object) -> None:
    """One JSON line for the test."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def _try_save(root: str, step: int, name: str, state: dict[str, torch.Tensor]) -> None:
    client = orchestrator.default_client()
    tmp = os.path.join(os.path.abspath(root), f"tmp_step_{step}")
    try:
        future = orchestrator.async_save(state, root=root, step=step)
    except orchestrator.SaveRefused as exc:
        client.flush(10)  # every answer's callbacks ran
        say(event="refused", name=name, code=exc.code, text=str(exc), left=os.path.exists(tmp))
        return
    try:
        future.result()
    except BaseException as exc:  # the refused save's plan fails (CheckpointException)
        outcome = type(exc).__name__
    else:
        outcome = "ok"
    client.flush(10)
    say(event="returned", name=name, outcome=outcome, left=os.path.exists(tmp))


def main() -> None:
    """Run ``--mode`` (see the module)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--step", type=int, default=1)
    parser.add_argument("--cwd")
    parser.add_argument("--other")
    args = parser.parse_args()
    if args.cwd:
        os.chdir(args.cwd)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state = {"w": torch.full((64,), float(rank))}
    if args.mode == "hold":
        client = orchestrator.CheckpointClient()
        handle = client.save(args.root, args.step, rank, world)
        say(event="begun", rank=rank, attempt=handle.attempt, run=client.run)
        threading.Event().wait()  # SIGKILLed mid-save, as a crashed job is
    elif args.mode == "resume":
        future = orchestrator.async_save(state, root=args.root, step=args.step)
        future.result()
        client = orchestrator.default_client()
        reply = client.wait(args.root, args.step, timeout=60)
        say(event="saved", rank=rank, state=reply.state, attempt=reply.attempt, run=client.run)
    else:
        if args.mode in ("loud", "quiet"):
            future = orchestrator.async_save(state, root=args.root, step=1)
            future.result()
            reply = orchestrator.default_client().wait(args.root, 1, timeout=60)
            say(event="saved", rank=rank, state=reply.state, reason=reply.reason)
        _try_save(args.root, 1, "promoted", state)
        _try_save(args.other, 2, "unconfigured", state)
    orchestrator.default_client().close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

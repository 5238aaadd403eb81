"""One rank of a real gloo job whose ``orchestrator.async_save`` says its node's ranks.

Started by ``tests/test_client_nodes.py`` once per rank, against a scripted daemon
(``tests/_peer.py``) that records every ``begin``. Each rank saves, for each
``STEP:LOCAL`` argument, step ``STEP`` with ``local_world_size=LOCAL`` (``-`` for none:
the environment decides), and prints one JSON line per save: ``saved`` once its upload
landed, or ``refused`` with the ``ValueError`` the save raised. ``STEP:LOCAL@BEGUN``
first begins the step's handle with ``local_world_size=BEGUN`` and passes it to the
save (which the caller then seals, or fails if the save refused).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
import torch.distributed as dist

import orchestrator


def say(**fields: Any) -> None:
    """One JSON line for the test."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("saves", nargs="+", help="STEP:LOCAL, LOCAL an int or '-'")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    client = orchestrator.CheckpointClient(begin_timeout=30.0)
    for spec in args.saves:
        step_text, local_text = spec.split(":")
        local_text, _, begun_text = local_text.partition("@")
        step = int(step_text)
        local = None if local_text == "-" else int(local_text)
        handle = None
        if begun_text:
            handle = client.save(args.root, step, rank, 2, local_world_size=int(begun_text))
        state = {f"rank{rank}.w": torch.full((8,), float(step))}
        try:
            future = orchestrator.async_save(
                state,
                root=args.root,
                step=step,
                client=client,
                handle=handle,
                local_world_size=local,
            )
        except ValueError as exc:
            say(event="refused", rank=rank, step=step, error=str(exc))
            if handle is not None:
                handle.fail(str(exc))
            continue
        if handle is not None:
            handle.seal()
        future.result()
        say(event="saved", rank=rank, step=step)
    assert client.wait_saves(60.0)
    client.close()
    dist.destroy_process_group()
    say(event="exit", rank=rank)


if __name__ == "__main__":
    main()

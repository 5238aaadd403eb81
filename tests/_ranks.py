"""Starting real rank processes of a gloo job and reading their JSON lines."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tests._zygote import zygote

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_rank(
    cmd: list[str],
    rank: int,
    world: int,
    port: int,
    socket_path: Path,
    extra_env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start one rank (``python cmd...``) of a ``world``-rank job, stdout piped."""
    env = {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "CKPTD_SOCKET": str(socket_path),
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        **(extra_env or {}),
    }
    # Forked from a process that imported torch (and nemo_automodel, for its workers)
    # once, rather than importing them afresh: most of a rank's CPU (tests/_zygote.py).
    forked = zygote("automodel" if "automodel" in cmd[0] else "torch")
    if forked is not None:
        return forked.spawn(cmd, env, REPO)
    return subprocess.Popen(
        [sys.executable, *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO
    )


TORCHRUN = ["-m", "torch.distributed.run"]
"""``torchrun`` as the arguments of a Python process (what its console script runs)."""


def run_python(
    args: list[str], env: Mapping[str, str], timeout: float, cwd: Path = REPO
) -> tuple[int, str]:
    """Run ``python args...`` to its end; its exit status and its output (stderr in stdout).

    Forked from the torch zygote (``tests/_zygote.py``) where that is on, so that a
    launcher such as torchrun (its agent imports torch) does not import torch afresh;
    what it starts itself (torchrun's ranks) is exec'd as always.

    Raises:
        AssertionError: it did not finish within ``timeout`` seconds (it is killed).
    """
    forked = zygote("torch")
    proc: subprocess.Popen[bytes]
    if forked is not None:
        proc = forked.spawn(args, env, cwd)
    else:
        command = [sys.executable, *args]
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd
        )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        text = out.decode(errors="replace")
        raise AssertionError(f"{args} did not finish within {timeout}s:\n{text}") from None
    return proc.returncode, out.decode(errors="replace")


def pump_lines(
    proc: subprocess.Popen[bytes], rank: int, put: Callable[[dict[str, Any]], None]
) -> threading.Thread:
    """Hand every line the rank prints to ``put`` (non-JSON as an ``_output`` event)."""

    def pump() -> None:
        assert proc.stdout is not None
        with proc.stdout:
            for raw in proc.stdout:
                try:
                    line = json.loads(raw)
                except ValueError:
                    line = None
                if not isinstance(line, dict):
                    line = {"event": "_output", "rank": rank, "line": raw.decode()[:500]}
                put(line)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread

"""torchrun's ranks, for a forked torchrun: each rank is forked by the zygote, not exec'd.

A job the suite runs under ``torchrun`` (the demo's, a simulated node's) starts each of
its ranks as a fresh interpreter, which imports torch again: about 3.5 s of CPU a rank,
a few dozen times in a run of the suite. torchrun itself is forked from a zygote
(``tests/_ranks.py`` ``run_python``, ``tests/_nodes.py`` ``SimNode.popen``); in it,
:func:`install` makes torchrun's agent ask that zygote, which imported torch once, to
fork each rank instead. What a rank then runs is unchanged: the agent's command line
(``python -u SCRIPT ARGS...``), with the environment the agent made for it (``RANK``,
``LOCAL_RANK``, ``TORCHELASTIC_RUN_ID``, ...), the agent's working directory, stdout and
stderr (or the files the agent redirects them to) and mount namespace, in a session of
its own as the agent starts it (the agent stops a rank's process group with
``killpg``). Its pid is its own: the agent signals it, and a test that SIGKILLs it sees
the agent react as to any dead rank.

What differs: its parent is the zygote, not the agent, so the agent learns its exit
status from the zygote over a socket (:class:`tests._zygote.ForkedProcess`), and its
CPU is counted with the agent's. ``CKPTD_TEST_FORK=0`` turns this off with the rest of
the zygote.
"""

from __future__ import annotations

import array
import json
import os
import socket
import sys
from subprocess import Popen
from typing import Any

from tests._zygote_spawn import SOCKET_VAR

LAUNCHERS = (("-m", "torch.distributed.run"),)
"""The ``argv`` beginnings of a forked child that is torchrun's agent."""


def is_launcher(argv: list[str]) -> bool:
    """Whether a forked child running ``argv`` is a torchrun agent."""
    return any(tuple(argv[: len(start)]) == start for start in LAUNCHERS)


def install() -> None:
    """In a forked torchrun: start its ranks through the zygote from now on."""
    if SOCKET_VAR not in os.environ:
        return
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler,
    )

    handler: Any = subprocess_handler.SubprocessHandler
    exec_rank = handler._popen

    def fork_rank(self: Any, args: tuple[str, ...], env: dict[str, str]) -> Popen[bytes]:
        if args[0] != sys.executable:  # ``--no-python``: not a Python rank
            rank: Popen[bytes] = exec_rank(self, args, env)
            return rank
        out = self._stdout.fileno() if self._stdout else 1
        err = self._stderr.fileno() if self._stderr else 2
        return _request(list(args[1:]), env, [out, err])

    handler._popen = fork_rank


def _request(argv: list[str], env: dict[str, str], stdio: list[int]) -> Popen[bytes]:
    """Ask the zygote to fork ``python argv...``, writing to ``stdio``; its handle."""
    from tests._zygote import ForkedProcess

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(os.environ[SOCKET_VAR])
        request = {
            "argv": argv,
            "env": env,
            "cwd": os.getcwd(),
            "mount_ns": os.getpid(),
            "parent": os.getpid(),
            "stdio": True,
            "setsid": True,
        }
        passed = array.array("i", stdio)
        message = [json.dumps(request).encode() + b"\n"]
        conn.sendmsg(message, [(socket.SOL_SOCKET, socket.SCM_RIGHTS, passed)])
        return ForkedProcess(argv, conn, None)
    except BaseException:
        conn.close()
        raise

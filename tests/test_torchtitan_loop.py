"""torchtitan's training loop on ckptd: cold, SIGKILLed mid-save, resumed.

A real daemon serves the checkpoint folder as ``orchestrator.torchtitan.root_toml``
says for ``keep_latest_k=2`` (``final_prefix = "step-"``, ``keep_last = 2``). The job
(``tests/_titan_worker.py loop``: 2 gloo ranks calling the manager exactly as
torchtitan's ``Trainer`` does, ``async_mode = "async"``, a save every step) runs from
cold to step 5. At step 5 rank 1 stops before its save while rank 0 saves: rank 0's
upload waits in DCP's collective, and the test SIGKILLs both ranks with it in flight.
The daemon fails step 5 once the ranks' lease runs out; nothing incomplete is ever named
``step-N``. The job is started again as a new run: it resumes from the newest complete
step (4) with the state saved there, and trains to step 8. ``keep_latest_k`` is the
daemon's: two complete steps are kept at every point, an incomplete one never counted.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests._titan import TitanJob, step_dirs, titan_daemon

pytestmark = pytest.mark.slow


def at(step: int) -> Callable[[dict[str, Any]], bool]:
    """An event matcher for ``step``."""
    return lambda event: event.get("step") == step


def test_cold_then_killed_mid_save_then_resumed(tmp_path: Path) -> None:
    socket_dir = Path(tempfile.mkdtemp(prefix="ck-tl-", dir="/tmp"))
    daemon, root = titan_daemon(tmp_path, socket_dir, keep_latest_k=2)
    args = ["loop", str(root), "--keep", "2", "--interval", "1", "--async-mode", "async"]
    try:
        # Cold: steps 1-4 promoted, the daemon keeping the newest two.
        first = TitanJob(daemon, [*args, "--steps", "8", "--die-at", "5"], run="titan-a")
        for rank in (0, 1):
            loaded = first.wait("loaded", rank)
            assert loaded["loaded"] is False and loaded["daemon"] is True
        for step in (1, 2, 3, 4):
            daemon.wait_event("checkpoint.promoted", match=at(step))
        saved_4 = first.wait("saved", 0, step=4)["digest"]
        for step in (1, 2):
            daemon.wait_event("checkpoint.retired", match=at(step))

        # Step 5: rank 1 never saves, rank 0's upload is in flight. Kill the job.
        first.wait("dying", 1, step=5)
        first.wait("saved", 0, step=5)
        first.kill()
        failed = daemon.wait_event("checkpoint.failed", match=at(5))
        assert step_dirs(root) == ["step-3", "step-4"], failed
        assert (root / "latest").resolve().name == "step-4"

        # A new run resumes from the newest complete step, with its state.
        second = TitanJob(daemon, [*args, "--steps", "8"], run="titan-b")
        for rank in (0, 1):
            loaded = second.wait("loaded", rank)
            assert loaded["loaded"] is True and loaded["step"] == 4, loaded
            assert loaded["position"] == 4
            assert loaded["digest"] == saved_4
        for step in (5, 6, 7, 8):
            daemon.wait_event("checkpoint.promoted", match=at(step))
        second.wait("closed", 0)
        second.finish()
        for step in (3, 4, 5, 6):
            daemon.wait_event("checkpoint.retired", match=at(step))
        assert step_dirs(root) == ["step-7", "step-8"]
        assert (root / "latest").resolve().name == "step-8"
        assert not [p.name for p in root.iterdir() if p.name.startswith("tmp_step_")]
    finally:
        daemon.kill()
        if daemon.proc is not None and daemon.proc.stdout is not None:
            daemon.proc.stdout.close()

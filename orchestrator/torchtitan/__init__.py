"""torchtitan on ckptd: its ``CheckpointManager``, with the daemon promoting every step.

Select it in a torchtitan config (``docs/torchtitan.md``)::

    checkpoint=orchestrator.torchtitan.CheckpointManager.Config(enable=True, ...)

and serve the checkpoint folder with the table :func:`root_toml` writes
(``final_prefix = "step-"``, ``keep_last = keep_latest_k``). Importing this package
imports torchtitan (the ``torchtitan`` extra).
"""

from __future__ import annotations

from ._daemon import FINAL_PREFIX, root_toml
from ._manager import AsyncMode, CheckpointManager, staging_options
from ._saves import files_under

__all__ = [
    "FINAL_PREFIX",
    "AsyncMode",
    "CheckpointManager",
    "files_under",
    "root_toml",
    "staging_options",
]

"""NeMo-RL's ``nemo_rl.utils.checkpoint``, on ckptd: the driver's ``CheckpointManager``.

A drop-in: the same names, signatures, config keys, warnings and directory layout. With
a daemon serving the checkpoint root, the driver's manager hands the rename and the
pruning to it (its workers save through :mod:`orchestrator.automodel`, naming the
manager's :attr:`CheckpointManager.run`); without one it behaves exactly as NeMo-RL's
own. See ``docs/nemo-rl.md``.
"""

from __future__ import annotations

from ._config import CheckpointingConfig, PathLike, describe_policy, retention_table, retention_toml
from ._daemon import StepFailed
from ._manager import CheckpointManager

__all__ = [
    "CheckpointManager",
    "CheckpointingConfig",
    "PathLike",
    "StepFailed",
    "describe_policy",
    "retention_table",
    "retention_toml",
]

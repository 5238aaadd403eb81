"""Retention: which promoted checkpoints a root keeps, and removing the rest off the training path.

- :mod:`.policy`: the keep rules as a pure function (no I/O, no clock).
- :mod:`.config`: the ``[roots.retention]`` table, validated.
- :mod:`.state`: metrics, pins and holds (pure; journaled records in, records out).
- :mod:`.disk`: the blocking filesystem work (finding checkpoints, the ``best`` pointer,
  renaming retired ones into the trash, reading ``training_info.json``).
- :mod:`.applier`: the daemon's side: a pass per root after each promotion.
- :mod:`.requests`: ``score``, ``pin``, ``unpin``, ``hold`` and ``retention``.
- :mod:`.cli`: the ``ckptd`` commands for them.
"""

from __future__ import annotations

from ..config._retention import RetentionConfig, parse_retention
from .policy import KeepBest, Policy, StepFacts, Verdict, best_step, judge

__all__ = [
    "KeepBest",
    "Policy",
    "RetentionConfig",
    "StepFacts",
    "Verdict",
    "best_step",
    "judge",
    "parse_retention",
]

"""Retention: which promoted checkpoints a root keeps, and removing the rest off the training path.

- :mod:`.policy`: the keep rules as a pure function (no I/O, no clock); the policy's
  types and its ``[roots.retention]`` table are :mod:`daemon.config._retention`'s.
- :mod:`.state`: metrics, pins and holds (pure; journaled records in, records out).
- :mod:`.applier`: the daemon's side: a pass per root after each promotion, its
  filesystem work (finding checkpoints, the ``best`` pointer, retiring into the trash,
  ``training_info.json``) through the storage (:mod:`daemon.store._steps` on POSIX).
- :mod:`.facts`: each step's pin, hold and metrics on the root, taken back by a daemon
  that lost its state; the ``best`` pointer's name, so a renamed one is removed.
- :mod:`.requests`: ``score``, ``pin``, ``unpin``, ``hold`` and ``retention``.
- :mod:`.report`: what each root's last pass found, for the ``ckptd_retention_*``
  metrics.

The ``ckptd`` commands for them are :mod:`daemon.ops._retention_cmds`.
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

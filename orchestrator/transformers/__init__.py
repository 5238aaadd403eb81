"""transformers on ckptd: its ``Trainer``, with the daemon promoting every checkpoint.

The switch is one line (``docs/transformers.md``)::

    from orchestrator.transformers import Trainer          # was: from transformers import Trainer
    SFTTrainer = orchestrator.transformers.with_ckptd(trl.SFTTrainer)   # any subclass

and serve ``output_dir`` with the table :func:`root_toml` writes (a staging directory
beside it, ``final_prefix = "checkpoint-"``, ``keep_last = save_total_limit`` and the
best model). The trainer's names (:class:`Trainer`, :class:`CkptdMixin`,
:func:`with_ckptd`) import transformers (the ``transformers`` extra) on first use; the
daemon's table and policy (:func:`root_toml`, :func:`retention_of`) do not.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._daemon import FINAL_PREFIX, STAGING_SUFFIX, Retention, retention_of, root_toml
from ._files import files_of_rank
from ._resume import get_last_checkpoint

if TYPE_CHECKING:
    from ._trainer import CkptdMixin, Trainer, with_ckptd

__all__ = [
    "FINAL_PREFIX",
    "STAGING_SUFFIX",
    "CkptdMixin",
    "Retention",
    "Trainer",
    "files_of_rank",
    "get_last_checkpoint",
    "retention_of",
    "root_toml",
    "with_ckptd",
]

_LAZY = frozenset({"CkptdMixin", "Trainer", "with_ckptd"})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module("._trainer", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

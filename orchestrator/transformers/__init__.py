"""transformers on ckptd: its ``Trainer``, with the daemon promoting every checkpoint.

The switch is one line (``docs/transformers.md``)::

    from orchestrator.transformers import Trainer          # was: from transformers import Trainer
    SFTTrainer = orchestrator.transformers.with_ckptd(trl.SFTTrainer)   # any subclass

and serve ``output_dir`` with the table :func:`root_toml` writes (a staging directory
beside it, ``final_prefix = "checkpoint-"``, ``keep_last = save_total_limit`` and the
best model). Importing this package imports transformers (the ``transformers`` extra).
"""

from __future__ import annotations

from ._daemon import FINAL_PREFIX, STAGING_SUFFIX, Retention, retention_of, root_toml
from ._files import files_of_rank
from ._trainer import CkptdMixin, Trainer, with_ckptd

__all__ = [
    "FINAL_PREFIX",
    "STAGING_SUFFIX",
    "CkptdMixin",
    "Retention",
    "Trainer",
    "files_of_rank",
    "retention_of",
    "root_toml",
    "with_ckptd",
]

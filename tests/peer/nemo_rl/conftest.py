"""NeMo-RL's own unit tests, copied verbatim, run against ckptd's drop-ins.

The two ``test_*.py`` files beside this one are NVIDIA-NeMo/RL's, unchanged (licence
header included), from commit :data:`UPSTREAM_COMMIT`:

- ``tests/unit/utils/test_checkpoint.py`` (``nemo_rl.utils.checkpoint``, the driver's
  ``CheckpointManager``);
- ``tests/unit/models/automodel/test_automodel_checkpoint.py``
  (``nemo_rl.models.automodel.checkpoint``, the policy workers' manager).

The whole mapping is :data:`MODULES`: the upstream module names those files import, and
name in ``mock.patch`` targets, are installed as aliases of the ckptd modules that
define (and look up) the same names, before the files are collected. Nothing else of
them is changed. Two things of the environment are set up here, not in the files:

- the LoRA module of nemo_automodel 0.7.0 is imported with triton hidden (its kernels
  do not import next to triton 3.9; ``tests/automodel/_models.py``), so the file's own
  ``from nemo_automodel.components._peft.lora import ...`` finds it loaded;
- the single-process gloo group the ``init_distributed`` fixture starts (on the fixed
  port 29500, and never destroyed) is started here first, on an in-memory store, and
  destroyed after the test: parallel test workers must not race for one port, and the
  other tests sharing a worker must not inherit a process group.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest

UPSTREAM_COMMIT: Final = "7ea279abfbeb698b092856d0dab61e7cf39bc909"
"""NVIDIA-NeMo/RL main, 2026-08-22, the copied files' version."""

MODULES: Final = {
    "nemo_rl.utils.checkpoint": "orchestrator.nemo_rl._manager",
    "nemo_rl.models.automodel.checkpoint": "orchestrator.automodel._manager",
}
"""Upstream module name -> the ckptd module that stands in for it."""


def _install_aliases() -> None:
    for upstream, ours in MODULES.items():
        parts = upstream.split(".")
        for i in range(1, len(parts)):  # the parent packages, empty
            parent = ".".join(parts[:i])
            if parent not in sys.modules:
                package = types.ModuleType(parent)
                package.__path__ = []
                sys.modules[parent] = package
        module = importlib.import_module(ours)
        sys.modules[upstream] = module
        setattr(sys.modules[".".join(parts[:-1])], parts[-1], module)


def pytest_configure(config: pytest.Config) -> None:
    """Register upstream's marker, import LoRA without triton, install the aliases."""
    config.addinivalue_line("markers", "automodel: needs nemo_automodel (NeMo-RL's marker)")
    from tests.automodel._models import import_nemo_lora

    with warnings.catch_warnings():
        # megatron_fsdp (under the LoRA module) says so on every host without them; it
        # describes the environment, not a defect.
        warnings.filterwarnings("ignore", "Transformer Engine and Apex", UserWarning)
        import_nemo_lora()
    _install_aliases()


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object) -> Any:
    """Upstream's model class is named ``TestModel``: it is not a test class."""
    if name == "TestModel" and isinstance(obj, type):
        return []
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Ignore, in these files only, a warning of the installed nemo_automodel."""
    # Its DCP backport calls tensor.storage() in every safetensors write, and torch
    # warns of it from there: not a defect of the code under test.
    here = Path(__file__).parent
    for item in items:
        if item.path.parent == here:
            item.add_marker(pytest.mark.filterwarnings("ignore:TypedStorage is deprecated"))


@pytest.fixture(autouse=True)
def _own_process_group(request: pytest.FixtureRequest) -> Iterator[None]:
    if "init_distributed" not in request.fixturenames:
        yield
        return
    import torch.distributed as dist
    from torch._C._distributed_c10d import HashStore

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

"""What a :class:`~orchestrator.CheckpointManager` saves of each object, and loads back.

A trainer hands the manager a mapping of names to the objects it checkpoints; each name
is one DCP directory of the step (``model/``, ``optim/``), saved as ``{name: state}``
(the demo's layout, and NeMo-RL's). What the state of each object is:

- a ``torch.nn.Module`` (plain, DDP, FSDP2): ``get_model_state_dict``, loaded back with
  ``set_model_state_dict``;
- a ``torch.optim.Optimizer``: ``get_optimizer_state_dict`` of the mapping's one module,
  loaded back with ``set_optimizer_state_dict``;
- any object with ``state_dict()`` and ``load_state_dict()`` (a scheduler, a dataloader
  that can resume): its own;
- a ``dict``: itself, loaded in place.

torch's ``torch.distributed.checkpoint.state_dict`` functions are what make DDP's
``module.`` prefix and FSDP2's sharded parameters (``DTensor``) save and load as one
model, on any number of ranks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = ["apply", "capture"]

_NAME: Final = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")


def _model(state: Mapping[str, Any], name: str) -> torch.nn.Module:
    modules = [v for v in state.values() if isinstance(v, torch.nn.Module)]
    if len(modules) != 1:
        raise ValueError(
            f"optimizer {name!r} needs exactly one model (torch.nn.Module) in the same "
            f"state, found {len(modules)}: save each model with its optimizer through "
            "its own manager, or pass their state dicts (dicts) instead"
        )
    return modules[0]


def _check(state: Mapping[str, Any]) -> None:
    if not state:
        raise ValueError("the state to checkpoint is empty")
    for name, value in state.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(
                f"state name {name!r}: each name is a directory of the step; use 1 to 128 "
                "letters, digits, '.', '_' or '-', not starting with '.' or '-'"
            )
        stateful = callable(getattr(value, "state_dict", None)) and callable(
            getattr(value, "load_state_dict", None)
        )
        if not (isinstance(value, dict) or stateful):
            raise TypeError(
                f"state {name!r} is a {type(value).__name__}: give a model, an optimizer, "
                "an object with state_dict() and load_state_dict(), or a dict"
            )


def capture(state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The state dict of each object of ``state``, by name (see the module).

    Args:
        state: Names to models, optimizers, stateful objects or dicts.

    Returns:
        Each name's state dict, ready for DCP (a dict is returned as it is).

    Raises:
        ValueError: ``state`` is empty, a name is not a plain directory name, or an
            optimizer has no single model beside it.
        TypeError: a value is none of the kinds above.
    """
    _check(state)
    result: dict[str, dict[str, Any]] = {}
    for name, value in state.items():
        if isinstance(value, torch.nn.Module):
            result[name] = get_model_state_dict(value)
        elif isinstance(value, torch.optim.Optimizer):
            result[name] = get_optimizer_state_dict(_model(state, name), value)
        elif isinstance(value, dict):
            result[name] = value
        else:
            result[name] = dict(value.state_dict())
    return result


def apply(state: Mapping[str, Any], loaded: Mapping[str, dict[str, Any]]) -> None:
    """Load what :func:`capture` gave (now holding a checkpoint's values) into ``state``.

    Args:
        state: The objects, as given to :func:`capture`.
        loaded: Each name's state dict after ``dcp.load`` filled it.
    """
    for name, value in state.items():
        values = loaded[name]
        if isinstance(value, torch.nn.Module):
            set_model_state_dict(value, values)
        elif isinstance(value, torch.optim.Optimizer):
            set_optimizer_state_dict(_model(state, name), value, values)
        elif isinstance(value, dict):
            if values is not value:
                value.update(values)
        else:
            value.load_state_dict(values)

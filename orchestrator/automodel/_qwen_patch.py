"""Re-adding Qwen-VL's ``^visual.`` -> ``model.visual.`` checkpoint key rename.

transformers #44627 (v5.5.0) moved the VLM checkpoint conversions into the main mapping
but copied the Qwen-VL vision rule wrongly: ``visual.*`` checkpoint keys no longer map to
``model.visual.*``. nemo_automodel's ``get_combined_key_mapping`` mirrors transformers'
``WeightRenaming`` entries, so base-model loads through ``Checkpointer.load_base_model``
leave the vision tower's keys unmapped; FSDP2's ``set_model_state_dict(strict=False)``
then drops them and the tower stays randomly initialised. transformers #45358 (v5.6)
fixed the mapping; remove this module once every supported Automodel pins a transformers
that has the fix.

nemo_automodel 0.7.0's ``get_combined_key_mapping(model_type, model_key_mapping=None, *,
model=None)`` returns a first-match regex dict, ``None``, or (when ``model`` has scoped
submodel renames) a callable. The wrapper handles all three.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from typing import Any, Final

__all__ = [
    "DISABLE_ENV",
    "VISION_MODEL_TYPES",
    "_patch_qwen_vl_vision_key_mapping",
    "apply_at_import",
]

logger = logging.getLogger("orchestrator.automodel")

DISABLE_ENV: Final = "NRL_DISABLE_QWENVL_VISION_PATCH"
"""Set to ``1`` to leave ``get_combined_key_mapping`` untouched (NeMo-RL's switch)."""

VISION_MODEL_TYPES: Final = frozenset({"qwen2_5_vl", "qwen2_vl"})
"""Model types whose checkpoints keep the vision tower under ``visual.``."""

_SOURCE: Final = r"^visual\."
_TARGET: Final = "model.visual."
_PROBE: Final = "visual.blocks.0.attn.qkv.weight"
_MARKER: Final = "_nrl_vision_patch"
"""NeMo-RL's marker of the wrapper: its own patch and this one each skip the other."""
_ORIGINAL: Final = "_nrl_orig"
"""Where NeMo-RL's code and tests find the unwrapped function."""

KeyMapping = dict[str, str] | Callable[[str], str] | None


def _targets_visual(mapping: KeyMapping) -> bool:
    """Whether some rule of ``mapping`` already renames keys into ``model.visual``."""
    if mapping is None:
        return False
    if callable(mapping):
        return mapping(_PROBE).startswith("model.visual")
    return any(str(target).startswith("model.visual") for target in mapping.values())


def _with_visual_rule(mapping: KeyMapping) -> KeyMapping:
    if _targets_visual(mapping):
        return mapping
    if mapping is None or isinstance(mapping, dict):
        # Appended last: first-match semantics keep every existing rule in charge of
        # the keys it already matches.
        return {**(mapping or {}), _SOURCE: _TARGET}
    inner = mapping

    def rename(key: str) -> str:
        renamed = inner(key)
        return re.sub(_SOURCE, _TARGET, renamed, count=1)

    return rename


def _patch_qwen_vl_vision_key_mapping() -> None:
    r"""Re-add the Qwen2.5-VL ``^visual`` -> ``model.visual`` checkpoint key rename.

    Wraps nemo_automodel's real ``get_combined_key_mapping`` (the name
    ``Checkpointer.load_base_model`` calls, in
    ``nemo_automodel.components.checkpoint.checkpointing``) so that, for ``qwen2_5_vl`` and
    ``qwen2_vl`` only, a rule ``^visual\.`` -> ``model.visual.`` is added when no
    existing rule already targets ``model.visual``. Other model types get exactly what
    the original returns. Idempotent: applying it again (or after NeMo-RL's own module
    applied its version) changes nothing. The wrapper carries NeMo-RL's marker
    (``_nrl_vision_patch``) and the unwrapped function as ``_nrl_orig`` and
    ``__wrapped__``. Setting
    ``NRL_DISABLE_QWENVL_VISION_PATCH=1`` makes it a no-op.

    Raises:
        Exception: whatever looking up or replacing the function raises (for example an
            Automodel that moved it). Importing ``orchestrator.automodel`` applies it
            through :func:`apply_at_import`, which logs a warning instead.
    """
    if os.environ.get(DISABLE_ENV) == "1":
        return
    import nemo_automodel.components.checkpoint.checkpointing as am_checkpointing

    original = am_checkpointing.get_combined_key_mapping
    if getattr(original, _MARKER, False):  # applied already, here or by NeMo-RL's module
        return

    def get_combined_key_mapping(
        model_type: str, model_key_mapping: dict[str, str] | None = None, **kwargs: Any
    ) -> KeyMapping:
        mapping: KeyMapping = original(model_type, model_key_mapping, **kwargs)
        if model_type in VISION_MODEL_TYPES:
            return _with_visual_rule(mapping)
        return mapping

    setattr(get_combined_key_mapping, _MARKER, True)
    # The unpatched function, so a test can tell when transformers makes this obsolete:
    # under NeMo-RL's name and as functools.wraps would expose it.
    setattr(get_combined_key_mapping, _ORIGINAL, original)
    get_combined_key_mapping.__wrapped__ = original  # type: ignore[attr-defined]
    am_checkpointing.get_combined_key_mapping = get_combined_key_mapping


def apply_at_import() -> None:
    """Apply the patch; never let a failure break ``import orchestrator.automodel``."""
    try:
        _patch_qwen_vl_vision_key_mapping()
    except Exception as exc:  # an Automodel refactor must not stop training from starting
        logger.warning(
            "could not apply the Qwen-VL vision key-mapping workaround "
            "(transformers #44627/#45358); vision towers of qwen2_5_vl/qwen2_vl base "
            "checkpoints may load unmapped: %s",
            exc,
        )

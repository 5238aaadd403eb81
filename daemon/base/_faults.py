"""Crash points for fault-injection tests.

``CKPTD_CRASH_AT=<point>`` in the daemon's environment makes it exit at once, as if
SIGKILLed, the first time it reaches that point; ``CKPTD_CRASH_AT=<point>:<n>`` at the
n-th time. The points sit in the narrow windows of promotion (and of ``gc``) that
random kills rarely hit. Unset (always, in production) it costs one comparison.
"""

from __future__ import annotations

import os
from typing import Final

__all__ = ["GC_POINTS", "NODE_POINTS", "POINTS", "RETENTION_POINTS", "S3_POINTS", "crash_point"]

POINTS: Final = (
    "before_intent",
    "after_intent",
    "after_manifest",
    "after_fsync",
    "after_rename",
    "after_root_fsync",
    "after_pointer",
    "after_promoted",
)
"""Every crash point, in the order promotion reaches them."""

S3_POINTS: Final = (
    "before_intent",
    "after_intent",
    "after_commit",
    "after_pointer",
    "after_promoted",
)
"""Every crash point of a promotion on an object store, in order: there the commit
object (``after_commit``) takes the place of the manifest, fsyncs and rename."""

GC_POINTS: Final = ("gc_after_doom",)
"""Crash points of ``gc``: after its renames into the trash, before it journals or
deletes anything."""

RETENTION_POINTS: Final = ("retention_after_doom",)
"""Crash points of retention: after its renames into the trash, before it journals or
deletes anything."""

NODE_POINTS: Final = ("after_node_marker",)
"""Crash points of a save that spans nodes: after this node's marker is written, before
it is journaled."""

_target: str | None = None
"""The configured point, read from the environment at the first crash point reached
(not at import: a process forked after importing the daemon has its own environment)."""
_remaining = 1


def crash_point(name: str) -> None:
    """Exit immediately (status 137, no cleanup) if ``name`` is the configured point."""
    global _target, _remaining
    if _target is None:
        _target, _, nth = os.environ.get("CKPTD_CRASH_AT", "").partition(":")
        _remaining = int(nth) if nth.isdigit() else 1
    if name != _target:
        return
    _remaining -= 1
    if _remaining <= 0:
        os._exit(137)

"""Finding a root's promoted steps without the daemon: the newest, the best, step N.

The root is the truth (the daemon's state directory is a cache): a trainer that resumes
reads the root's pointers and names, never asks the daemon. On a filesystem a promoted
step is ``ROOT/<final_prefix>N`` (``step_N``; the prefix from the root's layout file),
and the ``latest`` and ``best`` pointers are symlinks (or ``latest.txt``). On an object
store a step is a checkpoint only through its commit object
(``step_N/.ckptd-commit.json``), which names the URL readers load; the pointers are
small JSON objects naming that URL.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Final

import msgspec

from . import protocol as p
from ._objstore import filesystem, is_object_url, latest

__all__ = ["Found", "find_pointer", "find_step", "step_of"]

_COMMIT: Final = ".ckptd-commit.json"
_MAX_COMMIT: Final = 16 * 1024 * 1024
_layout_decoder: Final = msgspec.json.Decoder(p.RootInfo)


@dataclass(frozen=True, slots=True)
class Found:
    """A promoted step and where it is read from.

    Attributes:
        step: The step.
        path: Its directory, or on an object store its attempt's URL.
    """

    step: int
    path: str


def _layout(root: str) -> p.RootInfo | None:
    if is_object_url(root):
        return None
    try:
        with open(os.path.join(root, p.LAYOUT_FILE), "rb") as fh:
            return _layout_decoder.decode(fh.read(64 * 1024))
    except (OSError, msgspec.DecodeError):
        return None


def _final_prefix(root: str) -> str:
    layout = _layout(root)
    return layout.final_prefix if layout is not None else "step_"


def step_of(root: str, path: str) -> int | None:
    """The step a promoted checkpoint's path or URL names, or None.

    Args:
        root: The checkpoint root.
        path: What a pointer names: ``ROOT/step_N``, or ``s3://.../step_N/ATTEMPT``.
    """
    if is_object_url(path):
        match = re.search(r"/step_(\d+)/[^/]+/?$", path)
    else:
        prefix = re.escape(_final_prefix(root))
        match = re.search(rf"(?:^|/){prefix}(\d+)/?$", path)
    return int(match.group(1)) if match else None


def find_pointer(root: str, pointer: str | None = None) -> Found | None:
    """The step a pointer of ``root`` names (default its ``latest``), or None.

    Args:
        root: The checkpoint root.
        pointer: The pointer's name; default the root's ``latest`` pointer (its name
            from the root's layout file).

    Raises:
        OSError: the object store could not be read.
    """
    if pointer is None:
        layout = _layout(root)
        pointer = layout.pointer if layout is not None else "latest"
    where = latest(root, pointer)
    if where is None:
        return None
    step = step_of(root, where)
    return None if step is None else Found(step, where)


def find_step(root: str, step: int) -> Found | None:
    """Promoted step ``step`` of ``root``, or None if it is not one.

    Raises:
        OSError: the object store could not be read.
    """
    if not is_object_url(root):
        path = os.path.join(root, f"{_final_prefix(root)}{step}")
        return Found(step, path) if os.path.isdir(path) else None
    fs = filesystem(root)
    try:
        data = fs.cat_file(f"{root}/step_{step}/{_COMMIT}", start=0, end=_MAX_COMMIT)
    except FileNotFoundError:
        return None
    try:
        commit = json.loads(data)
    except ValueError:
        return None
    url = commit.get("url") if isinstance(commit, dict) else None
    if isinstance(url, str) and url.startswith(f"{root}/step_{step}/"):
        return Found(step, url)
    return None

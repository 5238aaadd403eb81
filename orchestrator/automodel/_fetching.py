"""Loading from an ``s3://`` root: the checkpoint's objects fetched to a local copy first.

nemo_automodel's ``Checkpointer`` reads a checkpoint as files: it lists the model
directory to tell the format, opens ``.metadata``, safetensors indexes, adapter configs
and shards by local path. A committed checkpoint's URL (``orchestrator.latest(root)``:
``s3://BUCKET/PREFIX/step_N/ATTEMPT``) is therefore fetched by :func:`fetched` into a
fresh local directory of this rank (one LIST per directory given, then every object
under it, several at once), read there, and the copy is removed when the load returns.
Only the directories the load reads are fetched (``policy/weights``,
``policy/optimizer``), never the whole step.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from .._objstore import filesystem, is_object_url
from ._staging import staging_base

__all__ = ["fetched"]

_FETCH_BATCH = 8
"""Objects a rank fetches at once."""


@contextmanager
def fetched(*paths: str | None) -> Iterator[list[str | None]]:
    """Local copies of the ``s3://`` directories among ``paths``, for one load.

    Paths that are not URLs (and None) are given back as they are. Each URL's copy is a
    directory with the URL's last name (``.../weights/model`` stays ``.../model``), so a
    loader that looks at the name reads it the same way.

    Args:
        *paths: Directories of a committed checkpoint: local paths or URLs.

    Yields:
        The paths to read, in the order given.

    Raises:
        FileNotFoundError: no object is under a URL given.
        OSError: the store could not be read.
    """
    if not any(path is not None and is_object_url(path) for path in paths):
        yield list(paths)
        return
    base = staging_base()
    os.makedirs(base, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="fetch-", dir=base)
    try:
        local: list[str | None] = []
        for index, path in enumerate(paths):
            if path is None or not is_object_url(path):
                local.append(path)
                continue
            name = path.rstrip("/").rsplit("/", 1)[-1]
            target = os.path.join(scratch, str(index), name)
            fetch_tree(path, target)
            local.append(target)
        yield local
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def fetch_tree(url: str, target: str) -> int:
    """Fetch every object under ``url`` into ``target`` (keys become relative paths).

    Returns:
        How many objects were fetched.

    Raises:
        FileNotFoundError: no object is under ``url``.
    """
    fs = filesystem(url)
    fs.invalidate_cache(url)  # a listing this process cached may predate the commit
    prefix = fs._strip_protocol(url).rstrip("/") + "/"
    keys = [key for key in fs.find(url) if key.startswith(prefix)]
    if not keys:
        raise FileNotFoundError(f"no checkpoint objects under {url}")
    locals_: list[str] = []
    for key in keys:
        rel = key[len(prefix) :]
        if rel.startswith("/") or ".." in rel.split("/"):
            raise ValueError(f"refusing to fetch {key!r}: it leaves {target}")
        locals_.append(os.path.join(target, *rel.split("/")))
    for path in locals_:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    fs.get(keys, locals_, batch_size=_FETCH_BATCH)
    return len(keys)

"""Roots on an object store, seen from the trainer: DCP's fsspec writer and reader, ``latest``.

A root named ``s3://BUCKET/PREFIX`` is written by each rank straight to the store
through DCP's ``FsspecWriter`` (s3fs over aiobotocore), under the attempt's own prefix
that the daemon's ``begin`` reply names; the daemon never carries a byte of it. Where
the store is and who the trainer is there come from the standard AWS environment
(``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ...),
which s3fs and botocore read themselves.

:func:`latest` reads a root's ``latest`` pointer with one GET (no LIST) and returns the
URL ``FsspecReader`` loads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any, Final

__all__ = [
    "attempt_writer",
    "filesystem",
    "is_object_url",
    "latest",
    "open_file",
    "storage_reader",
    "storage_writer",
]

_SCHEMES: Final = ("s3://",)
_MAX_POINTER: Final = 64 * 1024


def is_object_url(path: str) -> bool:
    """Whether ``path`` names a root (or a step) on an object store."""
    return path.startswith(_SCHEMES)


def _options() -> dict[str, Any]:
    """s3fs options from the environment that s3fs does not read by itself."""
    options: dict[str, Any] = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["endpoint_url"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        options["client_kwargs"] = {"region_name": region}
    return options


def filesystem(url: str) -> Any:
    """The fsspec filesystem (s3fs) of ``url``, with the environment's S3 settings."""
    import fsspec

    fs, _ = fsspec.core.url_to_fs(url, **_options())
    return fs


def storage_writer(url: str, **kwargs: Any) -> Any:
    """DCP's ``FsspecWriter`` for ``url`` with the environment's S3 settings.

    Args:
        url: Where the DCP directory goes (``s3://BUCKET/PREFIX/step_N/ATTEMPT/model``).
        **kwargs: Passed to ``FsspecWriter`` (``thread_count``, ...).
    """
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    # Objects are visible once their PUT returns: fsync has nothing to add.
    kwargs.setdefault("sync_files", False)
    return FsspecWriter(url, **kwargs, **_options())


def attempt_writer(root: str, resolve: Callable[[], str], **kwargs: Any) -> Any:
    """An ``FsspecWriter`` that learns where it writes on DCP's upload thread.

    An attempt's prefix is named by the daemon's ``begin`` reply; waiting for it on the
    training thread would stall training for a round trip to the daemon and the store.
    This writer is made with the root's URL and asks ``resolve`` for the real one when
    DCP sets it up, on the upload thread, before anything is written (where
    :class:`orchestrator.AfterBeginPlanner` waits for the same reply).

    Args:
        root: The ``s3://`` root (where the writer points until it is set up).
        resolve: Returns the DCP directory's URL (may wait for the ``begin`` reply).
        **kwargs: Passed to ``FsspecWriter``.
    """
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    class AttemptWriter(FsspecWriter):
        def __init__(self) -> None:
            kwargs.setdefault("sync_files", False)
            super().__init__(root, **kwargs, **_options())
            self._resolved = False

        def _resolve(self) -> None:
            if not self._resolved:
                self._resolved = True
                self.reset(resolve())

        def storage_meta(self) -> Any:
            self._resolve()
            return super().storage_meta()

        def set_up_storage_writer(self, *args: Any, **kw: Any) -> None:
            self._resolve()
            super().set_up_storage_writer(*args, **kw)

    return AttemptWriter()


def storage_reader(url: str) -> Any:
    """DCP's ``FsspecReader`` for a committed checkpoint's URL (what :func:`latest` gives)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(url, **_options())


def open_file(path: str, mode: str = "rb") -> Any:
    """Open a small file of a step (``training_info.json``) on a filesystem or a store.

    Args:
        path: A path, or a URL in an ``s3://`` root.
        mode: As for ``open`` (``"w"``, ``"rb"``, ...).

    Returns:
        A file object (a context manager); on a store, written when it is closed.
    """
    if not is_object_url(path):
        return open(path, mode)
    import fsspec

    return fsspec.open(path, mode, **_options()).open()


def latest(root: str, pointer: str = "latest") -> str | None:
    """Where the newest promoted checkpoint of ``root`` is, without asking the daemon.

    On an object store: one GET of the root's pointer object, which only ever names a
    committed step (no LIST). On a filesystem: the ``latest`` symlink (or ``latest.txt``).

    Args:
        root: The checkpoint root, a directory or ``s3://BUCKET/PREFIX``.
        pointer: The pointer's name (the root's ``pointer`` setting).

    Returns:
        The checkpoint's path or URL (give it to ``dcp.load`` with
        :func:`storage_reader` for a URL), or None if the root has none yet.

    Raises:
        OSError: the store could not be read (other than the pointer being absent).
    """
    if not is_object_url(root):
        link = os.path.join(root, pointer)
        try:
            target = os.readlink(link)
        except OSError:
            try:
                with open(f"{link}.txt", encoding="utf-8") as fh:
                    target = fh.read(4096).strip()
            except FileNotFoundError:
                return None
        full = os.path.join(root, target)
        return full if os.path.isdir(full) else None
    import fsspec

    fs, _ = fsspec.core.url_to_fs(root, **_options())
    try:
        data = fs.cat_file(f"{root}/{pointer}", start=0, end=_MAX_POINTER)
    except FileNotFoundError:
        return None
    try:
        found = json.loads(data)
    except ValueError:
        return None
    url = found.get("url") if isinstance(found, dict) else None
    return url if isinstance(url, str) and url.startswith(root + "/") else None

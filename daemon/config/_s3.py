"""Roots on an object store: ``s3://BUCKET/PREFIX`` names and their per-root settings.

A root whose path is an ``s3://`` URL lives in an S3 (or S3-compatible) bucket. Where
the store is and who the daemon is there come from the standard AWS environment and
files (``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``,
``~/.aws/config`` ...), each of which a root's ``[roots.s3]`` TOML table may override.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

from ..base._errors import ConfigError

__all__ = ["S3_SCHEME", "S3Options", "is_s3_url", "parse_s3_options", "split_s3_url"]

S3_SCHEME: Final = "s3://"
"""How a root on an object store is named."""

# Bucket names as S3 allows them (3-63 lower-case letters, digits, '.', '-').
_BUCKET: Final = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_SEGMENT: Final = re.compile(r"^[A-Za-z0-9!_.*'()=+,;:@-]+$")
_ADDRESSING: Final = ("auto", "path", "virtual")


def is_s3_url(path: str) -> bool:
    """Whether ``path`` names a root on an object store (``s3://...``)."""
    return path.startswith(S3_SCHEME)


def split_s3_url(url: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of ``s3://BUCKET/PREFIX`` (prefix without slashes at its ends).

    Raises:
        ConfigError: the URL is not of that form, naming what to fix.
    """
    if not is_s3_url(url):
        raise ConfigError(f"{url!r} is not an s3:// URL")
    rest = url[len(S3_SCHEME) :]
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise ConfigError(
            f"root {url!r}: bucket {bucket!r} is not a valid S3 bucket name (3-63 lower-case "
            "letters, digits, '.' or '-'); write the root as s3://BUCKET/PREFIX"
        )
    if prefix.endswith("/") or (prefix and not all(_ok_segment(s) for s in prefix.split("/"))):
        raise ConfigError(
            f"root {url!r}: the prefix must be plain names joined by '/', with no '.', '..', "
            "empty part or trailing '/' (e.g. s3://ckpt/runs/run-42)"
        )
    return bucket, prefix


def _ok_segment(segment: str) -> bool:
    return segment not in ("", ".", "..") and bool(_SEGMENT.match(segment))


@dataclass(kw_only=True, slots=True, frozen=True)
class S3Options:
    """Per-root overrides of the AWS environment (TOML ``[roots.s3]``); empty: from it."""

    endpoint_url: str = ""
    """The store's endpoint (``http://127.0.0.1:8333`` for a local SeaweedFS); empty:
    ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, the profile's, or AWS's own."""
    region: str = ""
    """The bucket's region; empty: ``AWS_REGION``, ``AWS_DEFAULT_REGION``, the profile's,
    else ``us-east-1``."""
    profile: str = ""
    """The profile in the AWS config and credentials files; empty: ``AWS_PROFILE``."""
    access_key_id: str = ""
    """An access key for this root only (with :attr:`secret_access_key`); empty: the
    standard chain (environment, files, instance role)."""
    secret_access_key: str = ""
    """The secret of :attr:`access_key_id`."""
    addressing_style: str = "auto"
    """``path`` (most on-prem stores), ``virtual`` or ``auto`` (botocore's choice)."""
    connect_timeout: float = 5.0
    """Seconds to connect to the endpoint before the request fails."""
    read_timeout: float = 60.0
    """Seconds to wait for a response before the request fails."""

    def __post_init__(self) -> None:
        if bool(self.access_key_id) != bool(self.secret_access_key):
            raise ConfigError(
                "[roots.s3] needs both access_key_id and secret_access_key, or neither (then "
                "the standard AWS credential chain is used)"
            )
        if self.endpoint_url and not re.match(r"^https?://[^/\s]+/?$", self.endpoint_url):
            raise ConfigError(
                f"[roots.s3] endpoint_url {self.endpoint_url!r} must be http(s)://HOST[:PORT]"
            )
        if self.addressing_style not in _ADDRESSING:
            raise ConfigError(
                f"[roots.s3] addressing_style {self.addressing_style!r} must be one of "
                f"{_ADDRESSING}"
            )
        for name in ("connect_timeout", "read_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 < value <= 3600):
                raise ConfigError(f"[roots.s3] {name} must be from 0 to 3600 seconds")


def parse_s3_options(table: object, root: str) -> S3Options:
    """The ``[roots.s3]`` table of ``root`` as :class:`S3Options`.

    Raises:
        ConfigError: an unknown key or a value of the wrong type, naming it.
    """
    if not isinstance(table, dict):
        raise ConfigError(f"[roots.s3] of root {root} must be a table")
    known = set(S3Options.__dataclass_fields__)
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(
            f"unknown keys in [roots.s3] of root {root}: {unknown}; known: {sorted(known)}"
        )
    values: dict[str, Any] = {}
    for key, value in table.items():
        default = S3Options.__dataclass_fields__[key].default
        kind: type = float if isinstance(default, float) else type(default)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ConfigError(f"[roots.s3] {key} of root {root} must be a {kind.__name__}")
        values[key] = value
    return S3Options(**values)

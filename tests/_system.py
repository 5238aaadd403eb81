"""System tools some tests need (Debian packages that ``.ci/run`` installs).

Outside CI a missing tool skips the test with the reason; in CI (``CI=true``) it fails
it, so a missing install step can never pass as a green run.
"""

from __future__ import annotations

import os
import shutil

import pytest

__all__ = ["in_ci", "require_root", "require_tool"]


def in_ci() -> bool:
    """Whether the suite runs in CI, where every test must be able to run."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_tool(name: str, package: str | None = None) -> str:
    """The absolute path of ``name``; skip (or, in CI, fail) the test if it is missing."""
    path = shutil.which(name)
    if path is None:
        reason = (
            f"{name} is not installed (Debian package {package or name}; "
            f"`apt-get install -y {package or name}`, which .ci/run does)"
        )
        if in_ci():
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def require_root(why: str) -> None:
    """Skip (or, in CI, fail) the test unless it runs as root."""
    if os.geteuid() != 0:
        reason = f"needs root: {why}"
        if in_ci():
            pytest.fail(reason)
        pytest.skip(reason)

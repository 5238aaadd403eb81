"""The daemon's exceptions. Each says when it is raised."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from orchestrator.protocol import ErrorCode

__all__ = [
    "CkptdError",
    "ConfigError",
    "PromotionError",
    "RequestError",
    "UnknownRoot",
    "VerificationError",
]


class CkptdError(Exception):
    """Base of every error the daemon raises on purpose."""


class ConfigError(CkptdError, ValueError):
    """Raised when flags, the TOML file or the environment describe an unusable setup."""


class UnknownRoot(ConfigError):
    """Raised by an operator's command given a path that does not exist or is no root."""


class RequestError(CkptdError, ValueError):
    """Raised while handling a request that must be refused; becomes an error reply.

    Attributes:
        code: The wire error code.
        effects: Ledger effects of a change the refusal itself caused (a save found
            expired while handling it), to be committed before the reply.
    """

    def __init__(self, code: ErrorCode, message: str, effects: Sequence[Any] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.effects = list(effects)


class VerificationError(CkptdError):
    """Raised when a save's files on disk do not prove it complete; it is never promoted."""


class PromotionError(CkptdError, OSError):
    """Raised when the filesystem refuses a step of promotion (rename, fsync, pointer)."""

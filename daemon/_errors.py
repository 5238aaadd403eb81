"""The daemon's exceptions. Each says when it is raised."""

from __future__ import annotations

from orchestrator.protocol import ErrorCode

__all__ = ["CkptdError", "ConfigError", "PromotionError", "RequestError", "VerificationError"]


class CkptdError(Exception):
    """Base of every error the daemon raises on purpose."""


class ConfigError(CkptdError, ValueError):
    """Raised when flags, the TOML file or the environment describe an unusable setup."""


class RequestError(CkptdError, ValueError):
    """Raised while handling a request that must be refused; becomes an error reply.

    Attributes:
        code: The wire error code.
    """

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class VerificationError(CkptdError):
    """Raised when a save's files on disk do not prove it complete; it is never promoted."""


class PromotionError(CkptdError, OSError):
    """Raised when the filesystem refuses a step of promotion (rename, fsync, pointer)."""

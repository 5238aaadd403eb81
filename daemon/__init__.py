"""ckptd daemon: promotes async DCP checkpoints once every rank's writes have landed.

Run it with ``ckptd serve``; embed it with :func:`serve`. This package never imports
torch and never unpickles checkpoint files.
"""

from __future__ import annotations

from .base._errors import CkptdError, ConfigError, PromotionError, RequestError, VerificationError
from .base._events import Events, configure_logging
from .config._config import Config, RootConfig, default_socket_path, load_config
from .ledger._ledger import Ledger, SaveKey
from .server._lifecycle import serve
from .server._server import VERSION, Daemon
from .store._local import LocalStorage
from .store._storage import Storage
from .store._verify import MANIFEST_NAME, Manifest, verify_checkpoint

__all__ = [
    "MANIFEST_NAME",
    "VERSION",
    "CkptdError",
    "Config",
    "ConfigError",
    "Daemon",
    "Events",
    "Ledger",
    "LocalStorage",
    "Manifest",
    "PromotionError",
    "RequestError",
    "RootConfig",
    "SaveKey",
    "Storage",
    "VerificationError",
    "configure_logging",
    "default_socket_path",
    "load_config",
    "serve",
    "verify_checkpoint",
]

"""What a trainer's drop-in asks once, as it starts: does a daemon serve its directory?

torchtitan's ``CheckpointManager`` and transformers' ``Trainer`` (``orchestrator.torchtitan``,
``orchestrator.transformers``) each ask it in their constructor, on every rank:

1. :func:`probe`: is there a daemon, does it serve the directory, with which retention
   policy (a policy other than the trainer's is the daemon's to apply: a warning says
   so, with the table to configure);
2. the drop-in checks the root's layout file against what its trainer's discovery can
   read (:func:`read_layout`);
3. :func:`agree`: the ranks agree (all of them use the daemon, or none does), so a save
   never has ranks writing to two different directories; a layout the trainer cannot
   read raises on every rank, and without a daemon one warning says why.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Final

import msgspec

from . import protocol as p
from ._client import CheckpointClient
from ._errors import DaemonError

__all__ = ["Daemon", "agree", "probe", "read_layout"]

_PROBE_TIMEOUT: Final = 2.0
_layout_decoder: Final = msgspec.json.Decoder(p.RootInfo)


class Daemon:
    """The daemon that promotes one directory's checkpoints, as a drop-in uses it.

    Args:
        client: A client whose daemon serves ``root``.
        root: The trainer's checkpoint directory, absolute: the daemon's root.
        owned: Whether the drop-in made ``client`` (and so closes it).
    """

    def __init__(self, client: CheckpointClient, root: str, *, owned: bool) -> None:
        self.client = client
        self.root = root
        self.owned = owned

    def close(self) -> None:
        """Wait for this process's saves to be reported, then close a client of our own."""
        if self.owned:
            self.client.close()
        else:
            self.client.wait_saves()
            self.client.flush()


def probe(
    location: str,
    client: CheckpointClient | None,
    *,
    policy: str,
    table: str,
    logger: logging.Logger,
) -> tuple[Daemon | None, str]:
    """The daemon serving ``location`` (made absolute), or None and why not.

    Args:
        location: The trainer's checkpoint directory, as configured.
        client: The drop-in's client; None: one on the default socket, if a daemon
            answers there (the drop-in then owns it).
        policy: The trainer's rotation as the daemon describes a policy
            (``RetentionInfo.policy``; "" keeps everything).
        table: The ``[[roots]]`` table that serves the directory as the trainer needs,
            for the warning when the daemon's policy differs.
        logger: The drop-in's logger.
    """
    if "://" in location:
        return None, f"{location} is remote; ckptd serves checkpoint directories on a filesystem"
    root = os.path.abspath(location)
    owned = client is None
    if client is None:
        path = p.default_socket_path()
        if not os.path.exists(path):
            return None, f"no daemon at {path}"
        client = CheckpointClient(path)
    try:
        if not client.ping(_PROBE_TIMEOUT):
            raise DaemonError("unreachable", f"no answer at {client.socket_path}")
        reply = client.call(p.Retention(id=0, root=root, apply=False), 60.0)
        served = msgspec.convert(reply, p.RetentionReply).info.policy
    except DaemonError as exc:  # e.g. root_not_configured: the trainer's own behaviour
        if owned:
            client.close(timeout=0, report_timeout=0)
        return None, f"the daemon does not serve {root} ({exc})"
    if served != policy:
        logger.warning(
            "ckptd: the daemon's retention for %s is %r, not the trainer's %r; the "
            "daemon's is applied. Configure the root as:\n%s",
            root,
            served or "(none: keep everything)",
            policy or "(none: keep everything)",
            table,
        )
    return Daemon(client, root, owned=owned), ""


def read_layout(root: str) -> p.RootInfo | None:
    """``ROOT/.ckptd-layout.json`` (how the daemon names the root's steps); None if unreadable."""
    try:
        with open(os.path.join(root, p.LAYOUT_FILE), "rb") as fh:
            return _layout_decoder.decode(fh.read(64 * 1024))
    except (OSError, msgspec.DecodeError):
        return None


def agree(
    daemon: Daemon | None,
    why: str,
    error: str | None,
    *,
    location: str,
    without: str,
    logger: logging.Logger,
) -> Daemon | None:
    """What every rank uses: ``daemon`` if every rank reached one and none refused.

    A collective when ``torch.distributed`` is initialized with more than one rank.

    Args:
        daemon: This rank's daemon (:func:`probe`), or None.
        why: Why this rank has none.
        error: This rank's objection to the daemon's layout, or None.
        location: The checkpoint directory, for the warning.
        without: What the trainer then does itself ("transformers' Trainer saves and
            rotates the checkpoints in"), for the warning.
        logger: The drop-in's logger.

    Raises:
        ValueError: a rank objected to the layout (every rank raises the first
            objection: none is left waiting in a collective).
    """
    said = _every_rank((daemon is not None, error))
    errors = [e for _, e in said if e is not None]
    if errors or not all(ok for ok, _ in said):
        if daemon is not None and daemon.owned:
            daemon.client.close(timeout=0, report_timeout=0)
        daemon = None
        if errors:
            raise ValueError(errors[0])
        why = why or "not every rank reached a daemon serving it"
    if daemon is None:
        logger.warning("ckptd: %s; %s %s itself", why, without, location)
        return None
    logger.info("ckptd: the daemon promotes and retires the checkpoints in %s", daemon.root)
    return daemon


def _every_rank(mine: tuple[bool, str | None]) -> list[tuple[bool, str | None]]:
    import torch.distributed as dist  # a drop-in's process has torch

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    said: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(said, mine)
    return [(bool(ok), error) for ok, error in said]

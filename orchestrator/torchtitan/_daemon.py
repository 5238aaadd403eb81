"""Whether ckptd serves a torchtitan checkpoint folder, and whether it is laid out for it.

torchtitan finds checkpoints by a ``re.search`` for ``step-`` and digits over the folder's
entries and resumes from the highest one holding ``.metadata`` (or an HF index). So the
root the daemon serves must promote to ``step-N`` (``final_prefix = "step-"``) and stage
under a name that search cannot match (the default ``tmp_step_N`` does not: an
underscore, not a dash). :func:`connect` asks the daemon once, when the manager is
built, on every rank; the ranks agree (all of them use the daemon, or none does), so a
save never has ranks writing to two different directories.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Final

import msgspec
import torch.distributed as dist

from .. import protocol as p
from .._client import CheckpointClient
from .._errors import DaemonError

__all__ = ["FINAL_PREFIX", "Daemon", "connect", "policy_for", "root_toml"]

logger = logging.getLogger("orchestrator.torchtitan")

FINAL_PREFIX: Final = "step-"
"""What torchtitan names a checkpoint (``_create_checkpoint_id``): the root's
``final_prefix``."""
STEP_SEARCH: Final = re.compile(r"step-(\d+)")
"""torchtitan's discovery pattern (``_find_load_step``, ``_purge_stale_checkpoints``),
applied with ``re.search``."""
_PROBE_TIMEOUT: Final = 2.0
_layout_decoder: Final = msgspec.json.Decoder(p.RootInfo)


class Daemon:
    """The daemon that promotes one torchtitan folder's steps, as the manager uses it.

    Args:
        client: A client whose daemon serves ``root``.
        root: The checkpoint folder, absolute: the daemon's ``--root``.
        owned: Whether the manager made ``client`` (and so closes it).
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


def policy_for(keep_latest_k: int) -> str:
    """The daemon's description (``RetentionInfo.policy``) of ``keep_latest_k``'s rule."""
    return f"keep_last={keep_latest_k}" if keep_latest_k > 0 else ""


def root_toml(root: str, keep_latest_k: int) -> str:
    """The daemon's ``[[roots]]`` table for a torchtitan checkpoint folder.

    Args:
        root: The checkpoint folder (``dump_folder/checkpoint.folder``), absolute.
        keep_latest_k: torchtitan's ``checkpoint.keep_latest_k`` (0: keep every step).

    Returns:
        TOML for ``ckptd serve --config``.
    """
    lines = ["[[roots]]", f'path = "{root}"', f'final_prefix = "{FINAL_PREFIX}"']
    if keep_latest_k > 0:
        lines += ["", "[roots.retention]", f"keep_last = {keep_latest_k}"]
    return "\n".join(lines) + "\n"


def connect(folder: str, keep_latest_k: int, client: CheckpointClient | None) -> Daemon | None:
    """The daemon serving ``folder`` on every rank, or None (one warning says why).

    A collective when ``torch.distributed`` is initialized with more than one rank:
    every rank must call it, as every rank builds its checkpoint manager.

    Raises:
        ValueError: a daemon serves the folder but names its steps so that torchtitan
            would not find them, or would find staged ones; the message gives the
            root's table to use.
    """
    root = os.path.abspath(folder)
    daemon, why = _probe(folder, root, keep_latest_k, client)
    error = None
    if daemon is not None:
        error = _layout_error(root, keep_latest_k)
    said = _every_rank((daemon is not None, error))
    errors = [e for _, e in said if e is not None]
    if errors or not all(ok for ok, _ in said):
        if daemon is not None and daemon.owned:
            daemon.client.close(timeout=0, report_timeout=0)
        daemon = None
        if errors:  # every rank raises: none is left waiting in a collective
            raise ValueError(errors[0])
        why = why or "not every rank reached a daemon serving it"
    if daemon is None:
        logger.warning(
            "ckptd: %s; torchtitan's CheckpointManager saves and purges %s itself",
            why,
            folder,
        )
        return None
    logger.info("ckptd: the daemon promotes and retires the checkpoints in %s", root)
    return daemon


def _probe(
    folder: str, root: str, keep_latest_k: int, client: CheckpointClient | None
) -> tuple[Daemon | None, str]:
    if "://" in folder:
        return None, f"{folder} is remote; ckptd serves torchtitan folders on a filesystem"
    owned = client is None
    if client is None:
        path = p.default_socket_path()
        if not os.path.exists(path):
            return None, f"no daemon at {path}"
        client = CheckpointClient(path)
    daemon = Daemon(client, root, owned=owned)
    try:
        if not client.ping(_PROBE_TIMEOUT):
            raise DaemonError("unreachable", f"no answer at {client.socket_path}")
        reply = client.call(p.Retention(id=0, root=root, apply=False), 60.0)
        policy = msgspec.convert(reply, p.RetentionReply).info.policy
    except DaemonError as exc:  # e.g. root_not_configured: torchtitan's own behaviour
        if owned:
            client.close(timeout=0, report_timeout=0)
        return None, f"the daemon does not serve {root} ({exc})"
    if policy != policy_for(keep_latest_k):
        logger.warning(
            "ckptd: the daemon's retention for %s is %r, not keep_latest_k=%s; the "
            "daemon's is applied. Configure the root as:\n%s",
            root,
            policy or "(none: keep everything)",
            keep_latest_k,
            root_toml(root, keep_latest_k),
        )
    return daemon, ""


def _layout_error(root: str, keep_latest_k: int) -> str | None:
    info = _read_layout(root)
    fix = f"Configure the root as:\n{root_toml(root, keep_latest_k)}"
    if info is None:
        return (
            f"ckptd serves {root} but its {p.LAYOUT_FILE} is missing or unreadable, so "
            f"the names of its steps are unknown. {fix}"
        )
    if info.final_prefix != FINAL_PREFIX:
        return (
            f"ckptd promotes the steps of {root} to {info.final_prefix}N, where torchtitan "
            f"looks for {FINAL_PREFIX}N. {fix}"
        )
    if STEP_SEARCH.search(f"{info.tmp_prefix}0") is not None:
        return (
            f"ckptd stages the steps of {root} as {info.tmp_prefix}N, which torchtitan's "
            f"search for step-(\\d+) would take for a checkpoint. {fix}"
        )
    return None


def _read_layout(root: str) -> p.RootInfo | None:
    try:
        with open(os.path.join(root, p.LAYOUT_FILE), "rb") as fh:
            return _layout_decoder.decode(fh.read(64 * 1024))
    except (OSError, msgspec.DecodeError):
        return None


def _every_rank(mine: tuple[bool, str | None]) -> list[tuple[bool, str | None]]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    said: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(said, mine)
    return [(bool(ok), error) for ok, error in said]

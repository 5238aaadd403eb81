"""``CheckpointManager``: NeMo-RL's algorithm-level checkpoint manager, on the daemon.

The same names, signatures, return values, warnings and layout as
``nemo_rl.utils.checkpoint.CheckpointManager``. With a daemon serving the root, the
driver no longer renames or deletes: its workers' saves (``orchestrator.automodel``)
begin and report each step, the daemon promotes ``tmp_step_N`` once they have all
landed, and prunes by the policy that keeps what NeMo-RL would keep
(:func:`~orchestrator.nemo_rl.retention_table`). Without one it is NeMo-RL's own
behaviour (``_local.py``), and says so once.
"""

from __future__ import annotations

import glob  # noqa: F401  # NeMo-RL's tests reach glob through this module
import json
import logging
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal

from .._client import CheckpointClient
from .._errors import DaemonError
from .._layout import read_layout
from .._run import run_identity
from ..protocol import TIER_RUN_FILE
from ._config import CheckpointingConfig, PathLike, describe_policy, retention_table
from ._config import retention_toml as _toml
from ._daemon import DaemonRoot, probe
from ._finalize import Finalizer
from ._local import (
    best_of,
    history,
    kept_steps,
    latest_step_dir,
    missing_metric_warnings,
    rename_into_place,
    resume_paths,
)

__all__ = ["CheckpointManager", "CheckpointingConfig", "_load_megatron_common_state_dict"]

logger = logging.getLogger("orchestrator.nemo_rl")


def _load_megatron_common_state_dict(iteration_dir: Path) -> dict[str, Any]:
    """The common state of a Megatron checkpoint (legacy ``common.pt`` or current).

    Raises:
        RuntimeError: Megatron-Core is not installed.
    """
    try:
        from megatron.core.dist_checkpointing import (  # type: ignore[import-not-found]
            load_common_state_dict,
        )
    except ImportError as error:
        raise RuntimeError(
            "Megatron-Core is required to read the optimizer state embedded in the "
            f"Megatron checkpoint at {iteration_dir}; install NeMo-RL's mcore extra."
        ) from error
    state: dict[str, Any] = load_common_state_dict(str(iteration_dir))
    return state


class CheckpointManager(Finalizer):
    """Manages the checkpoints of a training run: NeMo-RL's, promoted by ckptd.

    Layout: ``checkpoint_dir/tmp_step_N/`` while a step is written
    (``training_info.json``, ``config.yaml``, then the workers' ``policy/weights``,
    ``policy/optimizer``, ...), ``checkpoint_dir/step_N/`` once complete.

    With a daemon (:attr:`uses_daemon`): ``begin_finalization`` returns at once and the
    daemon renames the step when every worker's writes have landed; ``finalize_pending``
    waits for its verdict; retention is the daemon's. The workers must save through
    ``orchestrator.automodel.AutomodelCheckpointManager`` and name this manager's
    :attr:`run` (``save_checkpoint(..., run=manager.run)``). Without one it renames and
    prunes itself, exactly as NeMo-RL does.

    Attributes: NeMo-RL's, from the config (``checkpoint_dir``, ``metric_name``,
    ``higher_is_better``, ``keep_top_k``, ``save_period``, ``ft_keep_latest_k``,
    ``save_optimizer``, ...), and :attr:`run`.

    Args:
        config: NeMo-RL's ``checkpointing`` block.
        client: The daemon client (default: one on ``$CKPTD_SOCKET``, if it answers).
        use_daemon: False: never (NeMo-RL's behaviour); None (default): if a daemon
            answers now and serves ``checkpoint_dir``.
        run: The run the workers' saves name (default: the launcher's, else a new id).

    Raises:
        ValueError: ``run`` does not fit the protocol (1-128 of ``A-Za-z0-9._:-``).
    """

    def __init__(
        self,
        config: CheckpointingConfig,
        *,
        client: CheckpointClient | None = None,
        use_daemon: bool | None = None,
        run: str | None = None,
    ) -> None:
        self.config: Mapping[str, Any] = config
        self.checkpoint_dir = Path(config["checkpoint_dir"])
        self.metric_name: str | None = config["metric_name"]
        self.higher_is_better = config["higher_is_better"]
        self.keep_top_k: int | None = config.get("keep_top_k")
        self.save_period: int = config["save_period"]
        self.ft_keep_latest_k: int | None = config.get("ft_keep_latest_k", None)
        self.save_optimizer = config.get("save_optimizer", True)
        self.model_save_format = config.get("model_save_format", "safetensors")
        self.save_consolidated = config.get("save_consolidated", False)
        self.model_cache_dir = config.get("model_cache_dir", "")
        self.model_repo_id = config.get("model_repo_id", "")
        self.is_peft = config.get("is_peft", False)
        self.run: str = run_identity(run) or f"nemo-rl-{uuid.uuid4().hex}"
        """The run every worker's save names: the same for all of them, and new for
        each run of the job (``AutomodelCheckpointManager.save_checkpoint(run=...)``)."""
        super().__init__()
        self._daemon = self._connect(client, use_daemon)
        self._fast: Path | None = self._fast_tier()

    # -- where the daemon comes in ------------------------------------------------------

    @property
    def uses_daemon(self) -> bool:
        """Whether the daemon promotes and prunes this root's steps."""
        return self._daemon is not None

    def _connect(self, client: CheckpointClient | None, use: bool | None) -> DaemonRoot | None:
        root = os.path.abspath(self.checkpoint_dir)
        found = None if use is False else probe(client)
        if found is not None:
            daemon = DaemonRoot(found, root)
            try:
                policy = daemon.retention(apply=False).info.policy
            except DaemonError as exc:  # e.g. not_configured: the reference mode
                logger.warning("ckptd: the daemon does not serve %s (%s)", root, exc)
            else:
                self._check_policy(root, policy)
                logger.info("ckptd: the daemon promotes and prunes %s (run %s)", root, self.run)
                return daemon
        logger.warning(
            "ckptd: no daemon serves %s; this CheckpointManager renames and prunes its "
            "checkpoints itself, as NeMo-RL does",
            root,
        )
        return None

    def _fast_tier(self) -> Path | None:
        """The root's fast tier, with the daemon, where its layout file names one."""
        if self._daemon is None:
            return None
        info = read_layout(self._daemon.root)
        if info is None or not info.fast:
            return None
        logger.info(
            "ckptd: steps of %s are written into its fast tier %s", self._daemon.root, info.fast
        )
        return Path(info.fast)

    def _check_policy(self, root: str, policy: str) -> None:
        table = retention_table(self.config)
        if describe_policy(table) != policy:
            logger.warning(
                "ckptd: the daemon's retention for %s is %r, not what this config keeps "
                "(%r); the daemon's is applied. Configure the root as:\n%s",
                root,
                policy or "(none: keep everything)",
                describe_policy(table) or "(none: keep everything)",
                _toml(root, table),
            )

    # -- NeMo-RL's API --------------------------------------------------------------------

    @staticmethod
    def get_resume_paths(
        last_checkpoint_path: PathLike | None,
        *,
        model_component: Literal["policy", "value"] = "policy",
    ) -> tuple[Path | None, Path | None]:
        """Weights and optimizer paths to resume ``model_component`` from.

        Args:
            last_checkpoint_path: The checkpoint (``step_N``), or None to start fresh.
            model_component: The model subtree (``policy`` or ``value``).

        Returns:
            ``(weights_path, optimizer_path)``; both None without a checkpoint, the
            optimizer's None (with a ``UserWarning``) when it was not saved.

        Raises:
            RuntimeError: a Megatron checkpoint, and Megatron-Core is not installed.
        """
        return resume_paths(last_checkpoint_path, model_component, _load_megatron_common_state_dict)

    def init_tmp_checkpoint(
        self, step: int, training_info: Mapping[str, Any], run_config: Any = None
    ) -> PathLike:
        """Create ``tmp_step_N`` with ``training_info.json`` (and ``config.yaml``).

        A stale ``tmp_step_N`` of an interrupted save is removed first. With the daemon,
        an attempt of this step still open (a run that died, whose lease runs) is waited
        for first, and these files, being there before any worker begins the step, are
        promoted with it. Write any other file of the driver here before the workers'
        save: a step is complete when the workers' saves are (``docs/nemo-rl.md``).

        Args:
            step: The training step.
            training_info: Training metrics and state (tensors and arrays as numbers).
            run_config: The run's configuration (a pydantic model), saved as YAML.

        Returns:
            The absolute path of ``tmp_step_N``.

        On a root with a fast tier (its layout file names one), ``tmp_step_N`` is the
        fast tier's, marked with this manager's :attr:`run` so that the daemon keeps
        these files at the workers' first ``begin`` (``docs/tiers.md``).

        Raises:
            FileExistsError: with the daemon, ``step_N`` is already a complete
                checkpoint (the daemon never replaces one; not asked on a fast tier,
                whose ``step_N`` of an earlier run a new run's save replaces).
        """
        save_dir = (self._fast or self.checkpoint_dir) / f"tmp_step_{step}"
        if self._daemon is not None and self._fast is None:
            # A fast tier's step of another run is replaced by this run's: the daemon
            # starts a new save of the step at the first begin naming this run.
            self._free(step)
        if save_dir.exists():
            began = time.monotonic()
            shutil.rmtree(save_dir)
            logger.info("removed stale %s in %.2fs", save_dir.name, time.monotonic() - began)
        save_dir.mkdir(parents=True, exist_ok=True)
        if self._fast is not None:
            # The daemon keeps a fast-tier directory at the workers' first begin only if
            # it names their run: these files are then the step's (sealed and drained).
            (save_dir / TIER_RUN_FILE).parent.mkdir(exist_ok=True)
            (save_dir / TIER_RUN_FILE).write_text(self.run, encoding="utf-8")
        info = {key: _plain(value) for key, value in dict(training_info).items()}
        with open(save_dir / "training_info.json", "w") as fh:
            json.dump(info, fh)
        if run_config is not None:
            import yaml

            with open(save_dir / "config.yaml", "w") as fh:
                yaml.safe_dump(run_config.model_dump(), fh)
        return Path(os.path.abspath(save_dir))

    def _free(self, step: int) -> None:
        assert self._daemon is not None
        reply = self._daemon.known(step)
        if reply.state == "pending" and reply.attempt:
            logger.warning(
                "ckptd: step %s of %s has an attempt still open (attempt %s); waiting for "
                "it to end before saving the step again",
                step,
                self._daemon.root,
                reply.attempt,
            )
            reply = self._daemon.settle(step)
        if reply.state == "promoted":
            raise FileExistsError(
                f"step {step} of {self._daemon.root} is already a complete checkpoint; "
                "ckptd never replaces one: resume from the latest checkpoint, or remove it "
                "(ckptd gc) before saving the step again"
            )

    def remove_old_checkpoints(self, exclude_latest: bool = True) -> None:
        """Remove the checkpoints NeMo-RL's retention does not keep.

        A checkpoint survives if any rule keeps it: periodic ones (``step %
        save_period == 0``), all of them or only the ``keep_top_k`` best (by the metric,
        a step without it the worst, ties the newer; by recency without a metric);
        the ``ft_keep_latest_k`` newest; the newest (``exclude_latest``). Nothing is
        removed when ``keep_top_k`` and ``ft_keep_latest_k`` are both None.

        With the daemon, this asks it for a pass of the root's policy (it retires, off
        the training path); the daemon always keeps the newest step.

        Args:
            exclude_latest: Whether the newest checkpoint is protected.
        """
        if self._daemon is not None:
            self._daemon.retention(apply=True)
            return
        checkpoints = history(self.checkpoint_dir)
        if not checkpoints or (self.keep_top_k is None and self.ft_keep_latest_k is None):
            return
        kept = kept_steps(checkpoints, self.config, exclude_latest=exclude_latest)
        for checkpoint in checkpoints:
            if checkpoint.step not in kept:
                logger.info("removing checkpoint %s (step %s)", checkpoint.path, checkpoint.step)
                shutil.rmtree(checkpoint.path)

    def get_best_checkpoint_path(self) -> str | None:
        """The best checkpoint by the metric (ties: the newer), as NeMo-RL chooses it.

        With the daemon, its ``best`` pointer. Checkpoints without the metric are left
        out, with a warning; when none has it, the latest checkpoint (a second warning).

        Returns:
            Its path, or None when there is no checkpoint.
        """
        if self._daemon is not None:
            reply = self._daemon.retention(apply=False)
            complete = [s for s in reply.steps if "incomplete" not in s.kept]
            if not complete:
                return None
            without = sorted(s.step for s in complete if self.metric_name not in s.metrics)
            if missing_metric_warnings(without, len(complete), self.metric_name):
                return self.get_latest_checkpoint_path()
            if reply.info.best is not None:
                return str(self.checkpoint_dir / f"step_{reply.info.best}")
            return self.get_latest_checkpoint_path()
        checkpoints = history(self.checkpoint_dir)
        if not checkpoints:
            return None
        without = [c.step for c in checkpoints if self.metric_name not in c.info]
        if missing_metric_warnings(without, len(checkpoints), self.metric_name):
            return self.get_latest_checkpoint_path()
        return best_of(checkpoints, self.metric_name, bool(self.higher_is_better))

    def get_latest_checkpoint_path(self) -> str | None:
        """The checkpoint with the highest step (with the daemon: ``latest``'s target).

        On a root with a fast tier, the step the daemons decided this run resumes from
        (``restore``): the fast tier's ``step_N`` when this node holds all of it, else
        the durable root's newest; NeMo-RL's own search of the root if they cannot
        decide.

        Returns:
            Its path, or None when there is none.
        """
        if self._daemon is not None and self._fast is not None:
            try:
                reply = self._daemon.restore(self.run)
            except DaemonError as exc:
                logger.warning(
                    "ckptd: no restore decision for %s (%s); searching the root as NeMo-RL "
                    "does", self._daemon.root, exc,
                )  # fmt: skip
            else:
                return reply.path if reply.step is not None else None
        if self._daemon is not None:
            step = self._daemon.latest()
            if step is not None:
                return str(self.checkpoint_dir / f"step_{step}")
        return latest_step_dir(self.checkpoint_dir)

    def load_training_info(self, checkpoint_path: PathLike | None = None) -> dict[str, Any] | None:
        """The ``training_info.json`` of a checkpoint.

        Args:
            checkpoint_path: The checkpoint; None gives None.

        Returns:
            The training info, or None.
        """
        if checkpoint_path is None:
            return None
        with open(Path(checkpoint_path) / "training_info.json") as fh:
            info: dict[str, Any] = json.load(fh)
            return info

    # -- what Finalizer calls ---------------------------------------------------------------

    def _finalize_step(self, path: Path, wait_fn: Callable[[], None] | None) -> None:
        step = int(path.name.split("_")[-1])
        if self._daemon is not None:
            if self._daemon.known(step).attempt is not None or not _is_tmp(path):
                self._daemon.verdict(step)
                return
            logger.warning(
                "ckptd: no worker began step %s with the daemon (its workers do not save "
                "through orchestrator.automodel, or name another run); renaming it here",
                step,
            )
        if wait_fn is not None:
            wait_fn()
        rename_into_place(path)

    def _rename_checkpoint(self, checkpoint_path: PathLike) -> None:
        rename_into_place(Path(checkpoint_path))

    @staticmethod
    def _warn_on_delete_failure(future: Future[None]) -> None:
        """Warn when a background pruning failed: training goes on, it must not be silent."""
        exc = future.exception()
        if exc is not None:
            warnings.warn(
                f"Failed to prune old checkpoints in the background: {exc!r}. "
                "Training is unaffected, but stale checkpoints may remain on disk.",
                stacklevel=2,
            )


def _is_tmp(path: Path) -> bool:
    return path.name.startswith("tmp_step_") and path.exists()


def _plain(value: Any) -> Any:
    """A tensor's or an array's number (as NeMo-RL writes them); anything else as it is."""
    module = type(value).__module__.split(".")[0]
    if module in ("torch", "numpy") and hasattr(value, "item"):
        return value.item()
    return value

"""``Trainer``: transformers' ``Trainer`` with ckptd promoting its checkpoints.

:class:`CkptdMixin` changes only where a checkpoint's files go and who renames and
deletes. Everything else is transformers' own code, run as it is: what is saved and
how (``save_model``, ``_save_optimizer_and_scheduler``, ``_save_scaler``,
``_save_rng_state``, ``TrainerState.save_to_json``), when (the save strategy), the
best-model bookkeeping, resuming (``get_last_checkpoint``, ``resume_from_checkpoint``,
``_load_from_checkpoint``) and loading the best model at the end.

With a daemon serving ``output_dir`` (probed once, in the constructor, agreed by every
rank), each checkpoint is written into the root's staging directory, outside
``output_dir``, begun with and reported to the daemon, which renames it to
``output_dir/checkpoint-N`` once every rank's files have landed and been verified, and
retires old ones by the root's policy (``save_total_limit`` and the best model: the
table :func:`~orchestrator.transformers.root_toml` writes). The trainer never renames
or deletes, and does not wait for the rename. Without one, it is transformers' own
``Trainer``, and says so once.
"""

from __future__ import annotations

import logging
import os
from functools import cache
from typing import TYPE_CHECKING, Any, TypeVar

import transformers
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

from .._errors import DaemonError
from .._tracking import describe
from ._daemon import Daemon, connect, retention_of
from ._files import files_of_rank
from ._jit import take_over
from ._resume import decided_checkpoint

if TYPE_CHECKING:
    from .._client import CheckpointClient

__all__ = ["CkptdMixin", "Trainer", "with_ckptd"]

logger = logging.getLogger("orchestrator.transformers")

_T = TypeVar("_T", bound=type)

_BEST_WAIT = 600.0
"""Seconds the end of training waits for the best checkpoint's promotion before it
loads the best model (it is usually the last one saved)."""
_PING_WAIT = 2.0
"""Seconds the end of training waits for the daemon's answer before it waits on it."""
_REPORT_WAIT = 600.0
"""Seconds the end of training waits for this process's saves to be reported."""


class CkptdMixin:
    """What makes a ``transformers.Trainer`` (or any subclass) save through ckptd.

    Put it first among the bases, or use :func:`with_ckptd`. The constructor takes
    the trainer's own arguments, and one of its own.

    Args:
        *args: The trainer's.
        ckptd_client: The daemon client; default one on ``$CKPTD_SOCKET`` (else
            ckptd's default socket), made if a daemon answers there.
        **kwargs: The trainer's.

    Raises:
        ValueError: the trainer's own, and a daemon that serves ``output_dir`` with a
            layout transformers cannot resume from, or that would show it saves in
            flight (the message gives the root's table).
    """

    def __init__(
        self, *args: Any, ckptd_client: CheckpointClient | None = None, **kwargs: Any
    ) -> None:
        self._ckptd: Daemon | None = None
        self._ckptd_saved: set[int] = set()
        super().__init__(*args, **kwargs)
        trainer: Any = self
        self._ckptd = connect(trainer.args.output_dir, retention_of(trainer.args), ckptd_client)
        if self._ckptd is not None:
            take_over(trainer)  # enable_jit_checkpoint: no partial checkpoint-N in output_dir

    @property
    def uses_daemon(self) -> bool:
        """Whether the daemon promotes and retires this trainer's checkpoints."""
        return getattr(self, "_ckptd", None) is not None

    @property
    def ckptd(self) -> Daemon | None:
        """The daemon that promotes this trainer's checkpoints, if one does."""
        daemon: Daemon | None = getattr(self, "_ckptd", None)
        return daemon

    # -- transformers' hooks -------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kw: Any) -> Any:
        """Train as transformers does; ``resume_from_checkpoint=True`` asks the daemons.

        With the daemon serving a root with a fast tier, ``True`` resumes from the
        checkpoint the daemons decided for the run (``docs/tiers.md``): this node's
        ``FAST/checkpoint-N`` when it is complete and at least as new as the durable
        root's newest, else the durable one. Otherwise, or without an answer, it is
        transformers' ``get_last_checkpoint(output_dir)``.
        """
        trainer: Any = self
        daemon = self.ckptd
        if resume_from_checkpoint is True and daemon is not None:
            args_ = trainer.args
            found = decided_checkpoint(
                daemon.root, daemon.client, args_.process_index, args_.world_size
            )
            if found is not None:
                resume_from_checkpoint = found
        return super().train(resume_from_checkpoint, *args, **kw)  # type: ignore[misc]

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Save a checkpoint as transformers does; with the daemon, staged and reported.

        With the daemon, the same files are written by the same calls, into the step's
        staged directory; ``best_model_checkpoint`` names the promoted
        ``checkpoint-N``; nothing is rotated here (the daemon retires); and each rank
        reports its files, with the checkpoint's score when it is the best so far.
        """
        trainer: Any = self
        daemon = self.ckptd
        if (
            daemon is None
            or trial is not None
            or trainer.hp_search_backend is not None
            or os.path.abspath(trainer._get_output_dir(trial=trial)) != daemon.root
        ):
            # A hyperparameter search's trials save into run-*/ below output_dir:
            # transformers' own way, rotation included.
            super()._save_checkpoint(model, trial)  # type: ignore[misc]
            return
        args = trainer.args
        state = trainer.state
        step = state.global_step
        trainer.store_flos()
        handle = daemon.client.save(daemon.root, step, args.process_index, args.world_size)
        if handle.refusal is not None:
            logger.warning(
                "ckptd: the daemon refused checkpoint %s of %s (%s: %s); it is not saved",
                step,
                daemon.root,
                handle.refusal.code,
                handle.refusal.message,
            )
            return
        staged = handle.path
        try:
            trainer.save_model(staged, _internal_call=True)
            self._name_best(daemon.root, step)
            if not args.save_only_model:
                trainer._save_optimizer_and_scheduler(staged)
                trainer._save_scaler(staged)
                trainer._save_rng_state(staged)
            if args.should_save:
                self._save_state(staged)
            if args.push_to_hub:
                trainer._push_from_checkpoint(staged)
            files = files_of_rank(staged, args.process_index, saves=args.should_save)
        except BaseException as exc:
            handle.fail(f"the Trainer's checkpoint raised {describe(exc)}")
            raise
        handle.add_files(files)
        if args.should_save and state.best_global_step == step and state.best_metric is not None:
            metric = retention_of(args).metric
            if metric is not None:  # this checkpoint is the trainer's best so far
                handle.add_metrics({metric: float(state.best_metric)})
        handle.seal()
        self._ckptd_saved.add(step)

    def _load_best_model(self) -> None:
        """Load the best model as transformers does, once its checkpoint is promoted."""
        trainer: Any = self
        daemon = self.ckptd
        best = trainer.state.best_model_checkpoint
        if daemon is not None and best is not None:
            step = _step_of(daemon.root, best)
            if step is not None and step in self._ckptd_saved:
                _await_promotion(daemon, step)
        super()._load_best_model()  # type: ignore[misc]

    def _finalize_training(self, trial: Any, num_train_samples: Any, start_time: Any) -> Any:
        """End training as transformers does; with the daemon, nothing is deleted.

        transformers deletes every checkpoint but the best here when
        ``save_total_limit == 1``; with the daemon, its retention keeps the newest and
        the best. This process's saves are reported before it returns (not their
        promotion).
        """
        trainer: Any = self
        daemon = self.ckptd
        if daemon is None:
            return super()._finalize_training(trial, num_train_samples, start_time)  # type: ignore[misc]
        limit = trainer.args.save_total_limit
        trainer.args.save_total_limit = None  # transformers' own deletion, skipped
        try:
            result = super()._finalize_training(trial, num_train_samples, start_time)  # type: ignore[misc]
        finally:
            trainer.args.save_total_limit = limit
        daemon.client.wait_saves(_REPORT_WAIT)
        daemon.client.flush()
        return result

    # -- helpers -----------------------------------------------------------------------------

    def _name_best(self, root: str, step: int) -> None:
        """Point ``best_model_checkpoint`` at the promoted name of the best checkpoint.

        transformers names it when its directory exists; here the best checkpoint may
        be the one being saved, or one still being promoted: a step this trainer saved
        (or one already in ``output_dir``) is named by the path it is promoted to.
        """
        trainer: Any = self
        state = trainer.state
        if (
            trainer.args.save_strategy
            not in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
            or not state.best_global_step
        ):
            return
        best = state.best_global_step
        final = os.path.join(root, f"{PREFIX_CHECKPOINT_DIR}-{best}")
        if best == step or best in self._ckptd_saved or os.path.exists(final):
            state.best_model_checkpoint = final

    def _save_state(self, staged: str) -> None:
        """``trainer_state.json`` with the callbacks' states, as transformers writes it."""
        trainer: Any = self
        state = trainer.state
        callbacks = [*trainer.callback_handler.callbacks, trainer.control]
        for cb in [cb for cb in callbacks if isinstance(cb, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(state.stateful_callbacks[name], list):
                state.stateful_callbacks[name].append(cb.state())
            else:
                state.stateful_callbacks[name] = cb.state()
        state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))


def _await_promotion(daemon: Daemon, step: int) -> None:
    """Wait for this trainer's checkpoint ``step`` to be promoted or fail; say if it was not.

    A daemon that does not answer a ping is not waited for: transformers then loads what
    ``output_dir`` holds, as it does for a best checkpoint that is missing.
    """
    daemon.client.wait_saves(_REPORT_WAIT)
    try:
        if not daemon.client.ping(_PING_WAIT):
            raise DaemonError("unreachable", f"no answer at {daemon.client.socket_path}")
        reply = daemon.client.wait(daemon.root, step, _BEST_WAIT)
    except DaemonError as exc:
        logger.warning(
            "ckptd: cannot learn whether checkpoint %s of %s is promoted (%s); the best "
            "model is loaded from what output_dir holds",
            step,
            daemon.root,
            exc,
        )
        return
    if reply.state != "promoted":
        logger.warning(
            "ckptd: checkpoint %s of %s, the best, is %s (%s); it cannot be loaded",
            step,
            daemon.root,
            reply.state,
            reply.reason or "not promoted in time",
        )


def _step_of(root: str, checkpoint: str) -> int | None:
    """The step of ``root/checkpoint-N``, or None for any other path."""
    head, name = os.path.split(os.path.abspath(checkpoint))
    digits = name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-")
    return int(digits) if head == root and digits.isdigit() and digits != name else None


@cache
def with_ckptd(trainer_class: _T) -> _T:
    """``trainer_class`` (a ``transformers.Trainer`` subclass) saving through ckptd.

    The one-line switch for any trainer built on transformers' ``Trainer``, e.g. TRL's::

        SFTTrainer = orchestrator.transformers.with_ckptd(trl.SFTTrainer)

    Args:
        trainer_class: ``transformers.Trainer`` or a subclass of it.

    Returns:
        A subclass of it with :class:`CkptdMixin` first; the same class for the same
        argument.

    Raises:
        TypeError: ``trainer_class`` is not a ``transformers.Trainer``.
    """
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise TypeError(f"{trainer_class!r} is not a subclass of transformers.Trainer")
    if issubclass(trainer_class, CkptdMixin):
        return trainer_class
    made = type(trainer_class.__name__, (CkptdMixin, trainer_class), {})
    made.__doc__ = f"{trainer_class.__name__}, its checkpoints promoted by ckptd."
    return made  # type: ignore[return-value]


class Trainer(CkptdMixin, transformers.Trainer):
    """transformers' ``Trainer``, its checkpoints promoted and retired by ckptd.

    The same arguments as ``transformers.Trainer``, and ``ckptd_client`` (see
    :class:`CkptdMixin`).
    """

"""The Lightning pieces ``qkmonitor train`` runs with: its logger (whose own writes go through the
monitors' guard), its checkpoints (saved only into a writable run directory) and its progress bar
(counted in optimizer steps); and :func:`quiet_lightning`, the chatter turned down around the run
(exported by :mod:`qkmonitor.cli`, where users import it). Each class is made when first asked
for, and Lightning imported when the quiet block is entered, so importing this module loads no
Lightning."""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings

__all__ = [
    "checkpoint_io_class",
    "guarded_logger_class",
    "quiet_lightning",
    "step_progress",
    "step_progress_class",
]


def guarded_logger_class():
    from lightning.pytorch.loggers import TensorBoardLogger

    from qkmonitor.output.logger_sinks import guarded_sink

    class GuardedTensorBoardLogger(TensorBoardLogger):
        """``qkmonitor train``'s logger: a ``TensorBoardLogger`` whose own writes go through the
        guard of the monitors' writes to its directory (``output.guard``): a directory deleted,
        replaced or read-only mid-run loses writes, counted in the summary's ``writes lost``
        line, not the run; writing resumes when it can be written again, and a deleted
        directory is never made again by the logger (the monitors' writes do not make it either).
        """

        def log_metrics(self, metrics, step=None):
            guarded_sink(self).write(super().log_metrics, metrics, step, step=step)

        def log_hyperparams(self, params, *args, **kwargs):
            # as Lightning's own signature has it: (params, metrics) in 2.4, (…, step) from 2.5
            step = kwargs.get("step", args[1] if len(args) > 1 else None)
            write = functools.partial(super().log_hyperparams, params, *args, **kwargs)
            guarded_sink(self).write(write, step=step)

        def save(self):
            guard = guarded_sink(self)
            guard.confirm()  # what the writer took: written, or counted lost
            if not guard.failing:
                guard.write(super().save)  # a flush and hparams.yaml

        def finalize(self, status):
            guard = guarded_sink(self)
            guard.confirm()
            if not guard.failing:
                guard.write(super().finalize, status)

    return GuardedTensorBoardLogger


def checkpoint_io_class():
    from lightning.fabric.plugins import TorchCheckpointIO

    class RunCheckpointIO(TorchCheckpointIO):
        """``qkmonitor train``'s checkpoints: saved only while the run directory is a writable
        directory (one deleted or replaced mid-run is not made again for them), and a save that
        fails does not end the run; ``error`` says why the last save was not made (None: it
        was)."""

        def __init__(self, run_dir: str) -> None:
            super().__init__()
            self.run_dir = run_dir
            self.error: str | None = None

        def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
            import os

            if not (os.path.isdir(self.run_dir) and os.access(self.run_dir, os.W_OK)):
                self.error = f"{self.run_dir} is no longer a writable directory"
                return
            try:
                super().save_checkpoint(checkpoint, path, storage_options)
            except OSError as err:
                self.error = f"{type(err).__name__}: {err}"
            else:
                self.error = None

    return RunCheckpointIO


def step_progress_class():
    from lightning.pytorch.callbacks import TQDMProgressBar
    from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

    class StepProgress(TQDMProgressBar):
        """Lightning's progress bar counted in optimizer steps of the whole run (``step N/total``)
        with the task's loss and accuracy; no epoch counter and no logger version."""

        @property
        def train_description(self) -> str:
            return "step"

        def init_validation_tqdm(self):
            return Tqdm(disable=True)  # the validation scores come in the summary

        def on_train_epoch_start(self, trainer, *_):
            if trainer.current_epoch == 0:
                self.train_progress_bar.reset(total=trainer.max_steps)
                self.train_progress_bar.set_description("step")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            bar = self.train_progress_bar
            if bar is not None and not bar.disable:
                bar.n = trainer.global_step
                bar.set_postfix(self.get_metrics(trainer, pl_module))
                bar.refresh()

        def on_train_epoch_end(self, trainer, pl_module):
            pass  # one bar for the whole run

        def get_metrics(self, trainer, pl_module):
            metrics = super().get_metrics(trainer, pl_module)
            metrics.pop("v_num", None)
            return {
                k.removeprefix("train_"): v for k, v in metrics.items() if k.startswith("train_")
            }

    return StepProgress


def step_progress():
    """A new progress bar of ``qkmonitor train``."""
    return step_progress_class()()


@contextlib.contextmanager
def quiet_lightning():
    """Turn Lightning's chatter down while the block runs: its info lines (tips, the device report,
    why ``fit`` stopped) and one known deprecation warning from torch's pytree that Lightning
    triggers (filtered by its message). Warnings (qkmonitor's alerts among them) and the progress
    bar stay; qkmonitor's own info lines under Lightning (the layers it found) go through
    Lightning's logger and are turned down too. ``qkmonitor train`` and the examples run in it.

    Example::

        with quiet_lightning():
            trainer = pl.Trainer(max_steps=100, callbacks=[QKSpectrumMonitor()])
            trainer.fit(model)
    """
    import lightning.pytorch  # noqa: F401 -- its import sets its loggers' levels: set ours after it

    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*"
            )
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)

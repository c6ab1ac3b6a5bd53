"""The monitor engines in a Hugging Face ``transformers.Trainer``: a thin ``TrainerCallback``.

The same engines, tags and dashboards as the Lightning callbacks and
:class:`~qkmonitor.engine.Monitoring` (which this drives): the Trainer's ``on_step_begin`` opens the
window of the optimizer step (probes opened on probe steps), the first micro-batch's end
(``on_substep_end`` under gradient accumulation, else ``on_step_end``) measures and logs it — the
first micro-batch of a step, as the Lightning callbacks measure — and ``on_step_end`` reads the
weights after the update (so the spectrum is logged at steps 0, n, 2n, ... and after the last update
that lands on one, as in Lightning), ``on_train_end`` closes it. Needs ``transformers`` and
``accelerate`` (``pip install "qkmonitor[hf]"``).

``transformers.Trainer`` gives callbacks no hook when a step raises. A ``KeyboardInterrupt`` in the
model's forward closes the window on its way out; one elsewhere in a step (the backward, the
optimizer) leaves it open until the next ``train()`` (which says so), :meth:`close`, or the
interpreter's exit. The callback is a context manager that closes it on the way out::

    with HFQKMonitorCallback() as monitor:
        Trainer(model, args, train_dataset=data, callbacks=[monitor]).train()
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from transformers import TrainerCallback

from qkmonitor.engine import AttentionEntropy, EffectiveRank, MonitorEngine, Monitoring, QKSpectrum
from qkmonitor.engine.session import checked_engines
from qkmonitor.output.sinks import check_writer
from qkmonitor.output.tags import HF_HPARAMS_METRICS
from qkmonitor.validation import check_optional_positive_int

__all__ = ["HFQKMonitorCallback"]


class HFQKMonitorCallback(TrainerCallback):
    """Watch attention in a ``transformers.Trainer`` run.

    Args:
        engines: the engines (each used by this callback only); default: one
            :class:`~qkmonitor.engine.QKSpectrum`, :class:`~qkmonitor.engine.AttentionEntropy` and
            :class:`~qkmonitor.engine.EffectiveRank`, with their default arguments.
        writer: a ``torch.utils.tensorboard.SummaryWriter`` (or any
            :class:`~qkmonitor.output.sinks.Sink`); default: a writer in
            ``$TENSORBOARD_LOGGING_DIR`` if set, else ``{output_dir}/runs/qkmonitor`` (beside the
            Trainer's own TensorBoard runs), opened on the main process only.
        every_n_steps: the probe interval of engines that did not set one; default: the
            Trainer's ``logging_steps`` when it is a step count, else 50.

    The run's hyper-parameters in TensorBoard's HPARAMS tab are the ``TrainingArguments``
    (``to_sanitized_dict``) and every engine's rule thresholds. An alert with
    ``alert_action="stop"`` sets ``control.should_training_stop``.

    Example::

        >>> import tempfile
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
        >>> from qkmonitor.callbacks.hf_trainer import HFQKMonitorCallback
        >>> model = LlamaForCausalLM(LlamaConfig(
        ...     vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, max_position_embeddings=8))
        >>> tokens = torch.randint(32, (8, 8), generator=torch.Generator().manual_seed(0))
        >>> data = [{"input_ids": t, "labels": t} for t in tokens]
        >>> with tempfile.TemporaryDirectory() as out:  # doctest: +ELLIPSIS
        ...     args = TrainingArguments(out, max_steps=2, per_device_train_batch_size=4,
        ...                              logging_strategy="no", save_strategy="no", report_to=[],
        ...                              use_cpu=True, disable_tqdm=True)
        ...     with HFQKMonitorCallback(every_n_steps=1) as monitor:
        ...         _ = Trainer(model, args, train_dataset=data, callbacks=[monitor]).train()
        {'train_runtime': ...}
        >>> # the TensorBoard run went to out/runs/qkmonitor; the values stay with each engine
        >>> spectrum = monitor.engines[0]  # QKSpectrum, AttentionEntropy, EffectiveRank
        >>> len(spectrum.latest["kappa"]), spectrum.latest["kappa"][0].shape  # layers; heads
        (2, torch.Size([2]))
    """

    def __init__(
        self,
        engines: Sequence[MonitorEngine] | None = None,
        *,
        writer: Any = None,
        every_n_steps: int | None = None,
    ) -> None:
        engines = (
            [QKSpectrum(), AttentionEntropy(), EffectiveRank()]
            if engines is None
            else checked_engines(engines)
        )
        check_writer(writer)  # here, not when training starts
        check_optional_positive_int("every_n_steps", every_n_steps)
        self.engines = engines
        self.writer = writer
        self.every_n_steps = every_n_steps
        #: the :class:`~qkmonitor.engine.Monitoring` of the current (or last) ``train()``
        self.monitoring: Monitoring | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs) -> None:
        if self.monitoring is not None:  # a window an interrupted train() left open, said
            self.monitoring.close_abandoned(
                "the next train() began",
                "Use `with HFQKMonitorCallback() as monitor:`, or call `monitor.close()` after "
                "an interrupted train().",
            )
        self.close()
        if model is None:
            raise ValueError("HFQKMonitorCallback: the Trainer passed no `model` to on_train_begin")
        writer = None
        if state.is_world_process_zero:
            writer = self.writer if self.writer is not None else self._default_writer(args)
            self.writer = writer
        every = self.every_n_steps
        if every is None:
            steps = args.logging_steps
            every = int(steps) if float(steps) >= 1 and float(steps).is_integer() else 50
        self.monitoring = Monitoring(
            model,
            self.engines,
            writer=writer,
            hparams=args.to_sanitized_dict(),
            optimizer=optimizer,
            every_n_steps=every,
            hparams_metrics=HF_HPARAMS_METRICS,
        )

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        if self.monitoring is not None:
            self.monitoring.abort()  # a step that raised before its end
            self.monitoring.begin(state.global_step)

    def on_substep_end(self, args, state, control, **kwargs) -> None:
        """The end of a micro-batch that is not a step's last: the first one closes the window."""
        if self.monitoring is not None:
            self.monitoring.end()  # later micro-batches of the step find it closed

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if self.monitoring is not None:
            self.monitoring.end()  # no-op when on_substep_end closed it
            self.monitoring.observe_weights(
                state.global_step
            )  # after the update, as Lightning's does
            if self.monitoring.should_stop:
                control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        """The logged training loss, for the rules that tell learning from failing: they see it
        every ``logging_steps`` (set it to at most 10 for them to have the loss at each probe)."""
        loss = (logs or {}).get("loss")
        if self.monitoring is not None and isinstance(loss, (int, float)):
            self.monitoring.observe_loss(float(loss), step=max(0, state.global_step - 1))

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self.close()

    def close(self) -> None:
        """Close any open probe and flush the writer; idempotent."""
        if self.monitoring is not None:
            self.monitoring.close()

    def __enter__(self) -> HFQKMonitorCallback:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _default_writer(args) -> Any:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = os.getenv("TENSORBOARD_LOGGING_DIR") or os.path.join(
            args.output_dir, "runs", "qkmonitor"
        )
        return SummaryWriter(log_dir=os.path.expanduser(log_dir))

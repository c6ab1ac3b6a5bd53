"""Several engines on one model, driven from a plain PyTorch loop; the run header they share.

:class:`Monitoring` is the plain-loop counterpart of putting the Lightning callbacks in a Trainer:
the same engines, tags and dashboards, logged to a ``torch.utils.tensorboard.SummaryWriter``.
:func:`write_run_header` writes what a run holds once — one custom-scalars layout covering every
prefix and one hparams record with the model's hyper-parameters and every engine's thresholds —
for both paths.
"""

from __future__ import annotations

import atexit
import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from os import PathLike
from typing import Any

import torch
from torch import Tensor, nn

from qkmonitor import private_apis
from qkmonitor.attention.compiled import guard_interrupts
from qkmonitor.engine.base import MonitorEngine
from qkmonitor.engine.group import EngineGroup
from qkmonitor.engine.host import PlainHost
from qkmonitor.engine.losses import check_loss
from qkmonitor.output.dashboards import LayoutSection, custom_scalars_layout
from qkmonitor.output.guard import GuardedSink, report_write_faults
from qkmonitor.output.publisher import PUBLISHER
from qkmonitor.output.sinks import Sink, SummaryWriterSink, is_summary_writer
from qkmonitor.output.tags import HPARAMS_METRICS, alert_tag
from qkmonitor.validation import check_non_negative_int, check_positive_int

__all__ = ["Monitoring", "check_tag_collisions", "write_run_header"]


def check_tag_collisions(engines: Sequence[MonitorEngine]) -> None:
    """Two engines of one kind under one prefix would write the same tags: refuse that."""
    seen: dict[tuple[str, str], MonitorEngine] = {}
    for engine in engines:
        key = (engine.monitor, engine.prefix)
        if key in seen:
            raise ValueError(
                f"Two {engine.monitor}s log under the same `log_key_prefix` {engine.prefix!r} "
                f"(layers {seen[key].selection()!r} and {engine.selection()!r}); their tags would "
                "collide. Give each its own `log_key_prefix`, e.g. 'qkmonitor/encoder' and "
                "'qkmonitor/decoder'."
            )
        seen[key] = engine


def write_run_header(
    sinks: Sequence[Sink],
    engines: Sequence[MonitorEngine],
    hparams: dict[str, Any] | None = None,
    *,
    metrics: Sequence[str] = HPARAMS_METRICS,
) -> None:
    """One layout and one hparams record for the run, to every sink that draws.

    TensorBoard keeps the first hparams record of a run, so this goes first. A sink with a
    ``tag_prefix`` (a Lightning logger's ``prefix``, which its ``log_metrics`` puts on the scalars)
    gets the layout and the hparams metrics under that prefix too. The HPARAMS tab compares runs
    by ``metrics`` (the training code's scalar tags: loss, accuracy) and the alert counters; it
    shows a metric's last value, and an empty cell for a tag the run lacks (an alert counter: the
    rule never fired).
    """
    params: dict[str, Any] = dict(hparams or {})
    for engine in engines:
        params.update(engine.thresholds())
    for sink in sinks:
        if not sink.draws:
            continue
        tag_prefix = getattr(sink, "tag_prefix", "")
        sections = [
            LayoutSection(
                tag_prefix + e.prefix,
                e.metric_names,
                len(e.layers),
                tuple(r.name for r in e.alerting.tracker.rules),
                tuple(e.own_specs.values()),
            )
            for e in engines
        ]
        sink.log_layout(custom_scalars_layout(sections, tag_prefix=tag_prefix))
        sink.log_hparams(
            params,
            {
                **{tag_prefix + tag: 0.0 for tag in metrics},
                **{
                    alert_tag(tag_prefix + e.prefix, r.name): 0.0
                    for e in engines
                    for r in e.alerting.tracker.rules
                },
            },
        )


#: the Monitorings whose window :meth:`Monitoring.begin` opened and nothing closed yet: a Ctrl+C
#: outside the model's forward (in the backward, the optimizer, a hook of the model's own call)
#: leaves a loop without ``with`` no way to close it; the next ``begin`` does, or the exit
_OPEN: weakref.WeakSet[Monitoring] = weakref.WeakSet()


#: what :meth:`Monitoring.close_abandoned`'s warning tells a plain loop to do
_REMEDY = "Close a failed step with `monitoring.abort()`, or use `with monitoring.step(step):`."


@atexit.register
def _close_open_windows() -> None:
    """At the interpreter's exit: every window still open closed, unlogged (nothing is left on a
    model that code run at exit may still call or save)."""
    for monitoring in list(_OPEN):
        with contextlib.suppress(Exception):
            monitoring.abort()


def checked_engines(engines: object) -> list[MonitorEngine]:
    """``engines`` as a list, each an engine instance, or a ValueError (TypeError for a class)
    that names what was given (``Monitoring``'s and the Hugging Face callback's argument)."""
    if isinstance(engines, MonitorEngine):
        name = type(engines).__name__
        raise ValueError(
            f"Expected `engines` to be a list of engines, got one {name}: pass `[{name}(...)]`"
        )
    if isinstance(engines, type) and issubclass(engines, MonitorEngine):
        raise TypeError(
            f"Expected `engines` to be a list of engine instances, got the class "
            f"`{engines.__name__}`: pass `[{engines.__name__}()]`"
        )
    if not isinstance(engines, Iterable) or isinstance(engines, (str, bytes, Mapping)):
        raise ValueError(
            f"Expected `engines` to be a non-empty list of MonitorEngine, got "
            f"{type(engines).__name__} {engines!r}"
        )
    engines = list(engines)
    for engine in engines:
        if isinstance(engine, type) and issubclass(engine, MonitorEngine):
            raise TypeError(
                f"Expected engine instances in `engines`, got the class `{engine.__name__}`: "
                f"pass an instance: `{engine.__name__}()`"
            )
    if not engines or not all(isinstance(e, MonitorEngine) for e in engines):
        raise ValueError(
            f"Expected `engines` to be a non-empty list of MonitorEngine, got {engines!r}"
        )
    return engines


def _sink_of(writer: object) -> GuardedSink:
    """The sink of ``Monitoring(writer=...)``, guarded (:mod:`~qkmonitor.output.guard`: a write
    that fails is lost, not the run): a TensorBoard ``SummaryWriter`` as a
    :class:`SummaryWriterSink`, retried once its directory can be written again; a qkmonitor
    :class:`Sink` as it is. Anything else is a ValueError that says what to pass."""
    if is_summary_writer(writer):
        sink = SummaryWriterSink(writer)
        where = sink.log_dir
        return GuardedSink(sink, str(where), directory=where, reset=sink.reset, asynchronous=True)
    if isinstance(writer, Sink) and not isinstance(writer, (str, bytes, PathLike)):
        return GuardedSink(writer, type(writer).__name__)
    hint = (
        f": pass `SummaryWriter({str(writer)!r})` (torch.utils.tensorboard)"
        if isinstance(writer, (str, bytes, PathLike))
        else ""
    )
    raise ValueError(
        "Expected `writer` to be a torch.utils.tensorboard.SummaryWriter, a qkmonitor Sink or "
        f"None, got {type(writer).__name__} {writer!r}{hint}"
    )


def _hookable(optimizer: object) -> torch.optim.Optimizer | None:
    """The torch optimizer that steps, under wrappers that hold it as ``.optimizer`` (accelerate's
    ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``); None where there is none."""
    for _ in range(4):
        if isinstance(optimizer, torch.optim.Optimizer) and private_apis.takes_step_pre_hooks(
            optimizer
        ):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def _check_optimizer(optimizer: object) -> None:
    """``Monitoring(optimizer=...)`` is read for its learning rate: a torch optimizer (or a wrapper
    with its ``param_groups``), or None."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return
    groups = getattr(optimizer, "param_groups", None)
    if not (isinstance(groups, list) and all(isinstance(g, Mapping) for g in groups)):
        raise ValueError(
            "Expected `optimizer` to be a torch.optim.Optimizer (read for the learning rate) or "
            f"None, got {type(optimizer).__name__} {optimizer!r}"
        )


class Monitoring:
    """Engines on one model in a plain loop.

    Args:
        model: the model whose attention is watched.
        engines: :class:`~qkmonitor.engine.QKSpectrum`, :class:`~qkmonitor.engine.AttentionEntropy`,
            :class:`~qkmonitor.engine.EffectiveRank` (or your own), each at most once per prefix.
        writer: a ``torch.utils.tensorboard.SummaryWriter`` (or any :class:`Sink`); None logs
            nothing but keeps each engine's ``.latest`` and fires alerts.
        hparams: the run's hyper-parameters, for TensorBoard's HPARAMS tab.
        hparams_metrics: the scalar tags your loop writes that the HPARAMS tab compares runs by
            (its loss, its accuracy), besides the alert counters.
        optimizer: read for the learning rate in alert messages.
        every_n_steps: the probe interval of engines that did not set one.

    Example::

        >>> import tempfile
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from torch.utils.tensorboard import SummaryWriter
        >>> from qkmonitor.engine import AttentionEntropy, Monitoring, QKSpectrum
        >>> from qkmonitor.models import DecoderLM, TransformerConfig
        >>> model = DecoderLM(TransformerConfig(vocab_size=16, d_model=16, n_heads=2))
        >>> optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        >>> loader = torch.randint(16, (4, 2, 8)).unbind()  # four batches of two sequences
        >>> runs = tempfile.TemporaryDirectory()
        >>> monitoring = Monitoring(
        ...     model,
        ...     [QKSpectrum(), AttentionEntropy()],
        ...     writer=SummaryWriter(runs.name),
        ...     hparams={"lr": 3e-4},
        ...     optimizer=optimizer,
        ...     every_n_steps=2,
        ... )
        >>> for step, batch in enumerate(loader):
        ...     with monitoring.step(step):  # measures this step's forward on probe steps
        ...         logits = model(batch[:, :-1])
        ...         loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        ...         monitoring.observe_loss(loss)  # trend alerts stay quiet while the loss falls
        ...         loss.backward()
        ...         optimizer.step()
        ...         optimizer.zero_grad()
        ...     if monitoring.should_stop:  # an alert with alert_action="stop" fired
        ...         break
        >>> monitoring.close()
        >>> spectrum, entropy = monitoring.engines
        >>> spectrum.latest_at, len(spectrum.latest["kappa"])  # the probe step; a grid per layer
        (2, 2)
        >>> runs.cleanup()
    """

    #: the window with probes that :meth:`begin` opened and nothing closed yet, in words
    _open_window: str | None = None

    def __init__(
        self,
        model: nn.Module,
        engines: Sequence[MonitorEngine],
        *,
        writer: Any = None,
        hparams: dict[str, Any] | None = None,
        hparams_metrics: Sequence[str] = HPARAMS_METRICS,
        optimizer: torch.optim.Optimizer | None = None,
        every_n_steps: int = 50,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"Expected `model` to be a torch.nn.Module, got {type(model).__name__}"
            )
        engines = checked_engines(engines)
        check_positive_int("every_n_steps", every_n_steps)
        sinks = [] if writer is None else [_sink_of(writer)]
        _check_optimizer(optimizer)
        if hparams is not None and not isinstance(hparams, Mapping):
            raise ValueError(
                f"Expected `hparams` to be a dict of hyper-parameters or None, got "
                f"{type(hparams).__name__} {hparams!r}"
            )
        if isinstance(hparams_metrics, str) or not all(
            isinstance(tag, str) for tag in hparams_metrics
        ):
            raise ValueError(
                f"Expected `hparams_metrics` to be a list of scalar tags, got {hparams_metrics!r}"
            )
        for engine in engines:
            owner = engine._session() if engine._session is not None else None
            if owner is not None and owner is not self and not owner.closed:
                raise ValueError(
                    f"{type(engine).__name__} (prefix {engine.prefix!r}) is already used by "
                    "another Monitoring that is not closed: give each Monitoring its own engines, "
                    "or call close() on the first one"
                )
        self.engines = engines
        self.closed = False
        for engine in engines:
            engine._session = weakref.ref(self)
        self._step: int | None = None  # the open training window's step
        self._model = model
        #: while a window is open: what stops the model's forward from closing it on an interrupt
        self._unguard: Callable[[], None] | None = None
        self._group = EngineGroup(engines)  # the schedule in common, a probe's scalars held
        self.host = PlainHost(sinks, optimizer, owner=self)
        self.host.scalar_batch = self._group.scalars
        check_tag_collisions(engines)
        for engine in engines:
            engine.switch_model_in_windows = True  # a loop may call torch.compile(model) unseen
        self._group.bind(model, self.host, default_every_n_steps=every_n_steps)
        write_run_header(sinks, engines, hparams, metrics=hparams_metrics)
        #: the optimizer's step pre-hook that tells the engines an update comes (the q/k update
        #: metrics); removed by :meth:`close`
        self._update_hook = None
        inner = _hookable(optimizer)
        if self._group.weights and inner is not None:
            self._update_hook = inner.register_step_pre_hook(self._before_update)

    def _before_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The optimizer is about to step: the update after the open window's step."""
        if self._step is not None and not self.closed:
            self._group.before_update(self.host, self._step)

    @property
    def should_stop(self) -> bool:
        """True once an alert with ``alert_action="stop"`` has fired."""
        return self.host.should_stop

    @contextmanager
    def step(self, step: int) -> Iterator[Monitoring]:
        """The window of one optimizer step: weights are read as they are at its start (after
        ``step`` updates), the forwards inside are measured on probe steps and logged at its end.
        If the body raises, every probe is closed and nothing is logged."""
        self._check_step(step)
        with self._window(step, validation=False):
            yield self

    @contextmanager
    def validation(self, step: int) -> Iterator[Monitoring]:
        """Measure the forwards inside (e.g. one validation batch) and log them under
        ``{prefix}/val``."""
        self._check_step(step)
        with self._window(step, validation=True):
            yield self

    @contextmanager
    def _window(self, step: int, validation: bool) -> Iterator[None]:
        if not validation and step in self._group.between:  # no engine works at this step
            self._step = step
            yield
            return
        try:
            self.begin(step, validation=validation)
            yield
            self.end()
        finally:  # a failed step, or an alert raised by one engine: nothing stays installed
            self.abort()

    def begin(self, step: int, *, validation: bool = False) -> None:
        """Open the window of ``step`` (what :meth:`step` does on entry): read the weights (training
        only) and open the probes on probe steps. For loops whose step is not one block of code
        (a framework's callbacks); pair it with :meth:`end`, and :meth:`abort` on failure. A
        window still open from an earlier ``begin`` (a step that raised, a Ctrl+C outside the
        model's forward, with no ``abort``) is closed first, unlogged, with one warning
        (:meth:`close_abandoned`)."""
        self._check_step(step)
        if not validation:  # a validation window may sit inside a training window
            self.close_abandoned(f"begin({step}) came")
        self._step = None if validation else step
        if not validation:
            self.observe_weights(step)
        self._group.open(self.host, step, validation=validation)
        if self._unguard is None and any(engine.probing for engine in self.engines):
            # a KeyboardInterrupt in the forward closes the window on its way up, where the loop
            # around gives no hook to (transformers.Trainer without a context manager)
            self._unguard = guard_interrupts(self._model, self.abort)
            self._open_window = f"the {'validation ' if validation else ''}window of step {step}"
            _OPEN.add(self)

    def observe_loss(self, loss: Tensor | float, step: int | None = None) -> None:
        """The training loss of this step (of the open :meth:`step` window by default), for the
        rules that tell learning from failing (``AlertRule.learning_drop``). Call it at every step;
        it reads nothing from the device until a probe needs it.

        Raises:
            ValueError: ``loss`` is not a number or a tensor of one element, or no ``step`` is
                given outside a step window.
        """
        step = self._step if step is None else step
        if step is None:
            raise ValueError(
                "Expected `step`: observe_loss outside a step window needs the step it belongs to"
            )
        self._check_step(step)
        if type(loss) is not Tensor or loss.numel() != 1 or not loss.is_floating_point():
            check_loss(loss)
        if step not in self._group.quiet:  # no rule reads the loss of a quiet step
            self._group.observe_loss(step, loss)

    def observe_weights(self, step: int) -> None:
        """Measure and log the weights as they are after ``step`` updates, if that is a probe step
        (once per step: a second call for the same step does nothing)."""
        self._group.observe_weights(self.host, step)

    def end(self) -> None:
        """Close the window: measure, log and alert; every probe is closed even if logging
        raises."""
        try:
            step = self._step
            if step is None:  # a validation window
                self._group.finish_validation(self.host)
            else:
                self._group.finish(self.host, step)
        finally:
            self.abort()

    def close_abandoned(self, why: str, remedy: str = _REMEDY) -> bool:
        """Close a window that :meth:`begin` opened and no :meth:`end` or :meth:`abort` closed,
        unlogged, with one warning saying so; False if none was open. A Ctrl+C in the model's
        forward closes the window on its way out; one elsewhere in a step (the backward, the
        optimizer) leaves it open where the loop has no ``with``.

        Args:
            why: what noticed it, for the warning (``"begin(5) came"``).
            remedy: the warning's last sentence: what the loop should do instead.
        """
        what = self._open_window
        if what is None:
            return False
        self.abort()
        self.host.warn(
            f"qkmonitor: {what} was left open (the step raised, or was interrupted, outside the "
            f"model's forward, and nothing closed it); {why}, so its probes are closed now, "
            f"unlogged. {remedy}",
            RuntimeWarning,
        )
        return True

    def abort(self) -> None:
        """Close every open probe without logging (idempotent)."""
        unguard, self._unguard = self._unguard, None
        if self._open_window is not None:
            self._open_window = None
            _OPEN.discard(self)
        try:
            self._group.abort(self.host)
        finally:
            if unguard is not None:
                unguard()

    @staticmethod
    def _check_step(step: object) -> None:
        check_non_negative_int("step", step)

    def flush(self) -> None:
        """Wait for the visuals drawn in the background (:mod:`qkmonitor.output.publisher`) and
        flush the sinks: everything logged so far is written."""
        PUBLISHER.drain()
        for sink in self.host.sinks():
            flush = getattr(sink, "flush", None)
            if callable(flush):
                flush()

    def close(self) -> None:
        """Close any open probe, wait for the visuals and flush the writer; the engines may then
        join another Monitoring."""
        hook, self._update_hook = self._update_hook, None
        if hook is not None:
            hook.remove()
        unguard, self._unguard = self._unguard, None
        if unguard is not None:
            unguard()
        self._open_window = None
        _OPEN.discard(self)
        self._group.end(self.host)  # the scalars held written, the pictures of the final state
        self.closed = True
        for sink in self.host.sinks():
            flush = getattr(sink, "flush", None)
            if callable(flush):
                flush()
        report_write_faults(self.host, self.host.sinks())  # how many writes were lost, if any

    def __enter__(self) -> Monitoring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        return {f"{e.monitor}[{e.prefix}]": e.state_dict() for e in self.engines}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for engine in self.engines:
            engine.load_state_dict(state.get(f"{engine.monitor}[{engine.prefix}]", {}))
        self._group.bound()

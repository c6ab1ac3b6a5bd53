"""The probe protocol: how a monitor measures the forwards of one attention layer, and stops.

A *probe* is owned by one monitor, for one layer, for one probe window (a training step or a
validation batch). ``layer.open_probe(request)`` installs what the layer needs to see its forwards
(a registered observer on qkmonitor's own attention, a forward pre-hook on
``nn.MultiheadAttention``, a per-module route into the Hugging Face attention function) and records
exactly that; :meth:`Probe.close` removes exactly that and returns what was measured. Closing is
idempotent, so monitors close in ``finally``, on exceptions and on teardown without bookkeeping.

Every forward of the module while the probe is open reaches :meth:`Probe.observe` as an
:class:`AttentionCall`; the probe keeps one entry per call (weight sharing, per-sequence loops and
``generate()`` are all measured, never only the last call). Several probes on one module are
independent: each observes every forward, and none can close another.

A metric problem never stops training: a call whose statistics cannot be computed is counted in
:attr:`ProbeResult.failures` with the reason, and the monitor warns.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from qkmonitor import private_apis
from qkmonitor.attention.compiled import NeverCompiled
from qkmonitor.attention.context_parallel import context_parallel_reason
from qkmonitor.kernels import AttentionStats, attention_max_logits, attention_stats, autocast_off
from qkmonitor.measures.sharding import HeadPlacement
from qkmonitor.validation import check_bool, check_non_negative_int, is_int

__all__ = [
    "AttentionCall",
    "KernelCall",
    "ObserverSet",
    "Probe",
    "ProbeRequest",
    "ProbeResult",
]


_SIDE = threading.local()


@contextmanager
def side_computation() -> Iterator[None]:
    """Mark qkmonitor's own computations inside a model's forward (measuring a call), so that the
    interception of :mod:`qkmonitor.attention.intercept` does not take them for the model's."""
    _SIDE.depth = getattr(_SIDE, "depth", 0) + 1
    try:
        yield
    finally:
        _SIDE.depth -= 1


def in_side_computation() -> bool:
    return getattr(_SIDE, "depth", 0) > 0


def recomputing() -> bool:
    """Whether autograd is running a backward on this thread. A forward there is activation
    checkpointing recomputing one that already ran (reentrant or not: the same call again, same
    inputs), so probes do not count it twice."""
    return private_apis.in_backward()


@dataclass(frozen=True)
class ProbeRequest:
    """What a monitor wants from one layer during one probe window.

    Attributes:
        stats: the per-row attention statistics of every call (:class:`AttentionStats`).
        sink_tokens: with ``stats``, also the attention mass on the first this-many keys (0: off).
        probs_slice: ``(sequences, rows)``: also the explicit attention probabilities of the first
            ``sequences`` sequences and ``rows`` query rows (all keys), ``(S, H, R, M)`` float32.
        layout: a layout probe: the layer checks the W_Q/W_K layout it read by name against the
            first call (:mod:`qkmonitor.attention.intercept`), instead of being measured.
        max_logits: each head's largest scaled logit of every call, ``(B, H)``, without the
            softmax (what QK-Clip needs; from the statistics where the call has them already).
    """

    stats: bool = True
    sink_tokens: int = 0
    probs_slice: tuple[int, int] | None = None
    layout: bool = False
    max_logits: bool = False

    def __post_init__(self) -> None:
        for name in ("stats", "layout", "max_logits"):
            check_bool(name, getattr(self, name))
        check_non_negative_int("sink_tokens", self.sink_tokens)
        if self.probs_slice is not None and not (
            isinstance(self.probs_slice, tuple)
            and len(self.probs_slice) == 2
            and all(is_int(n, 1) for n in self.probs_slice)
        ):
            raise ValueError(
                f"Expected `probs_slice` to be (sequences, rows) positive ints or None, "
                f"got {self.probs_slice!r}"
            )


@runtime_checkable
class AttentionCall(Protocol):
    """One forward of an attention module, as a probe sees it."""

    def stats(self, sink_tokens: int = 0) -> AttentionStats:
        """Per-row statistics of the call, every field (B, H, N) float32."""
        ...

    def probs(self, sequences: int, rows: int) -> Tensor:
        """(S, H, R, M) attention probabilities of the first sequences and query rows, float32."""
        ...

    def max_logits(self) -> Tensor:
        """(B, H): each head's largest scaled logit over the rows and the keys they may attend,
        float32 or better; ``-inf`` where no key may be attended."""
        ...


@dataclass
class ProbeResult:
    """What one probe measured: one entry per observed call.

    Attributes:
        stats: the statistics of each call (empty unless requested).
        probs: the probability slice of each call (empty unless requested).
        max_logits: each call's (B, H) largest logits (empty unless requested).
        calls: forwards observed.
        failures: reasons of the calls whose measurement failed (they are in no list above).
        unread: why a forward that ran gave no call to read (what it called, what is missing).
        sharded: why a forward's attention is refused because its heads are split across ranks
            (tensor parallelism, :attr:`~qkmonitor.attention.calls.UnreadCall.sharded`): each
            rank holds part of them where they are not split by whole heads, so no per-head
            value of one rank is the model's; or its keys (context parallelism): no row's
            statistics of one rank are over all its keys.
        placement: where the heads of the calls measured are among the layer's, where they are
            this rank's part (tensor parallelism, split by whole heads); None: all of them.
    """

    stats: list[AttentionStats] = field(default_factory=list)
    probs: list[Tensor] = field(default_factory=list)
    max_logits: list[Tensor] = field(default_factory=list)
    calls: int = 0
    failures: list[str] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)
    sharded: list[str] = field(default_factory=list)
    placement: HeadPlacement | None = None


class Probe:
    """An open probe on one layer; :meth:`close` removes what opening installed.

    Args:
        name: the layer's name, for messages.
        request: what to measure.
        remove: undoes what opening installed; called once, by the first :meth:`close`.
    """

    def __init__(
        self, name: str, request: ProbeRequest, remove: Callable[[], None] | None = None
    ) -> None:
        self.name = name
        self.request = request
        self._remove = remove
        self._result = ProbeResult()
        self.closed = False

    def record_undo(self, remove: Callable[[], None]) -> None:
        """Record the function that undoes what opening installed; :meth:`close` calls it once."""
        self._remove = remove

    def observe(self, call: AttentionCall) -> None:
        """Measure one forward (called by what opening installed, inside the model's forward); it
        never raises there: a failure is a failed measurement of that call
        (``ProbeResult.failures``, warned once naming the layer), not a failed training step."""
        try:
            self._observe(call)
        except Exception as err:  # noqa: BLE001 -- a metric problem must never stop training
            self._result.failures.append(f"{type(err).__name__}: {err}")

    def _observe(self, call: AttentionCall) -> None:
        """One forward's measurement, under ``no_grad``; a checkpoint's recomputation of a forward
        in the backward is not a new one and is left out."""
        if self.closed or recomputing():
            return
        reason = getattr(call, "unread_reason", None)
        if reason is not None:  # a forward that ran with nothing to read (calls.UnreadCall)
            if getattr(call, "sharded", False):  # refused: its heads or keys are split
                self._result.sharded.append(reason)
            else:
                self._result.unread.append(reason)
            return
        # a call any family made under context parallelism (its q, k, or torch's context_parallel
        # in place, say so) is over this rank's chunk of the keys: refused, never measured
        split = context_parallel_reason(getattr(call, "q", None), getattr(call, "k", None))
        if split is not None:
            self._result.sharded.append(split)
            return
        self._result.calls += 1
        placement = getattr(call, "placement", None)
        if placement is not None:
            self._result.placement = placement
        with torch.no_grad(), autocast_off(), side_computation():
            request = self.request
            stats = call.stats(request.sink_tokens) if request.stats else None
            probs = call.probs(*request.probs_slice) if request.probs_slice else None
            largest = call.max_logits() if request.max_logits else None
        if stats is not None:
            self._result.stats.append(stats)
        if probs is not None:
            self._result.probs.append(probs)
        if largest is not None:
            self._result.max_logits.append(largest)

    def close(self) -> ProbeResult:
        """Remove what opening installed (once) and return the measurements; idempotent."""
        if not self.closed:
            self.closed = True
            remove, self._remove = self._remove, None
            if remove is not None:
                remove()
        return self._result

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Probe({self.name!r}, {'closed' if self.closed else 'open'}, "
            f"calls={self._result.calls})"
        )


class ObserverSet:
    """The observers registered on one module, for modules that call probes themselves.

    ``add(observer, sink_tokens)`` returns a function that removes exactly that observer. A module
    holds one ``ObserverSet`` and, in its forward, asks :meth:`sink_tokens` how many sink keys to
    measure and hands each call to :meth:`notify`.
    """

    def __init__(self) -> None:
        self._observers: dict[int, tuple[Callable[[AttentionCall], None], int, bool]] = {}
        self._next = 0
        self._sink = 0
        self._stats = False

    def add(
        self, observer: Callable[[AttentionCall], None], sink_tokens: int = 0, stats: bool = True
    ) -> Callable[[], None]:
        """Register ``observer``; ``stats=False``: it reads no per-row statistics (only the
        largest logits, or the probabilities), so a forward may skip computing them."""
        _notify.prepare()  # eagerly, before dynamo may trace a forward that notifies
        key, self._next = self._next, self._next + 1
        self._observers[key] = (observer, sink_tokens, stats)
        self._sink = max(self._sink, sink_tokens)
        self._stats = self._stats or stats

        def remove() -> None:
            self._observers.pop(key, None)
            self._sink = max((sink for _, sink, _ in self._observers.values()), default=0)
            self._stats = any(wants for _, _, wants in self._observers.values())

        return remove

    def __bool__(self) -> bool:
        return bool(self._observers)

    def __len__(self) -> int:
        return len(self._observers)

    def __reduce__(self):
        """A copy (``copy.deepcopy``, ``pickle``) is an empty set: observers belong to the probe
        window of the module they were registered on, never to a copy of it
        (:mod:`qkmonitor.attention.installs`)."""
        return (ObserverSet, ())

    def sink_tokens(self) -> int:
        """The most sink keys any observer asked for (an int kept up to date: under
        ``torch.compile`` the forward reads one value, not the observers)."""
        return self._sink

    def wants_stats(self) -> bool:
        """Whether any observer reads the per-row statistics (kept up to date, like
        :meth:`sink_tokens`)."""
        return self._stats

    def notify(self, call: AttentionCall) -> None:
        """Hand ``call`` to every observer registered now. Never traced by ``torch.compile``: a
        compiled forward calls the observers of the current probe window, not those it saw when it
        was traced."""
        _notify(self, call)


def _notify_observers(observers: ObserverSet, call: AttentionCall) -> None:
    for observer, _, _ in list(observers._observers.values()):
        observer(call)


_notify = NeverCompiled(_notify_observers)


class KernelCall:
    """A call described by its queries and keys, causal flag and key padding: the kernel's cases.

    Args:
        q: (B, H, N, D) queries as the layer scores them (after projections, norms, RoPE; a
            per-row temperature may be folded in).
        k: (B, H_kv, M, D) keys.
        scale: the factor on ``q·k``.
        causal: bottom-right aligned causal mask (row i attends keys j <= i + M - N).
        key_padding_mask: (B, M) bool, True where a key may be attended.
        stats: statistics the forward already computed, and ``stats_sink`` the sink keys in them.
    """

    def __init__(
        self,
        q: Tensor,
        k: Tensor,
        *,
        scale: float,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
        stats: AttentionStats | None = None,
        stats_sink: int = 0,
    ) -> None:
        self.q, self.k = q.detach(), k.detach()
        self.scale, self.causal, self.key_padding_mask = scale, causal, key_padding_mask
        self._stats = {stats_sink: stats} if stats is not None else {}

    def stats(self, sink_tokens: int = 0) -> AttentionStats:
        cached = self._stats.get(sink_tokens)
        if cached is None and sink_tokens == 0 and self._stats:  # any sink count holds the rest
            cached = next(iter(self._stats.values()))
        if cached is None:
            # the kernel accumulates in float32 whatever the inputs; no enclosing autocast applies
            with autocast_off():
                cached = attention_stats(**self._kernel_arguments(), sink_tokens=sink_tokens)
            self._stats[sink_tokens] = cached
        return cached

    def max_logits(self) -> Tensor:
        """From the statistics where they were computed (the bundled kernel's running max),
        else from blocks of scores without the softmax
        (:func:`qkmonitor.kernels.attention_max_logits`)."""
        if self._stats:
            return _rows_max(next(iter(self._stats.values())).max_logit)
        return attention_max_logits(**self._kernel_arguments())

    def _kernel_arguments(self) -> dict:
        """This call as the fused kernels take it."""
        return dict(
            q=self.q, k=self.k, causal=self.causal, key_padding_mask=self.key_padding_mask,
            scale=self.scale,
        )  # fmt: skip

    def probs(self, sequences: int, rows: int) -> Tensor:
        from qkmonitor.measures.probabilities import attention_probs

        q = self.q[:sequences, :, :rows]
        n, m = self.q.shape[2], self.k.shape[2]
        bias = None
        if self.causal:  # rows [:R] of the full N x M matrix keep the bottom-right offset
            allowed = torch.ones(q.shape[2], m, dtype=torch.bool, device=q.device).tril(
                diagonal=m - n
            )
            bias = torch.zeros(q.shape[2], m, device=q.device).masked_fill(~allowed, -math.inf)
        pad = None if self.key_padding_mask is None else self.key_padding_mask[:sequences]
        return attention_probs(
            q, self.k[:sequences], scale=self.scale, key_padding_mask=pad, bias=bias
        )


def _rows_max(max_logit: Tensor) -> Tensor:
    """(B, H, N) per-row largest logits -> (B, H); ``-inf`` without rows."""
    if max_logit.shape[-1] == 0:
        return max_logit.new_full(max_logit.shape[:2], float("-inf"))
    return max_logit.amax(dim=-1)

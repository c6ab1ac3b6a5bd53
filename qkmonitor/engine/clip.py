r"""QKClipEngine: after each optimizer step, bound every head's attention logits by ``tau``.

At every ``every_n_steps``-th step (default: every step, as in Kimi Team 2025) the training forward
is probed like :class:`~qkmonitor.engine.AttentionEntropy`'s; once the step's optimizer update is
done (the window closes after it), each head's largest scaled logit over the step's forwards

.. math::

    S_h = \max_{b, i, j} s_{hij}, \qquad \gamma_h = \min(1, \tau / S_h)

is taken (the largest over the ranks under DDP, so every rank scales alike), and the query and key
projections of every head with :math:`\gamma_h < 1` are scaled in place so that its logits shrink
by :math:`\gamma_h` (:mod:`qkmonitor.attention.clip`: :math:`\sqrt{\gamma_h}` on each projection, or
:math:`\gamma_h` on the queries of a key head shared by several query heads). The forward and
backward passes and the optimizer state are untouched; heads at or below ``tau`` are not written.

Layers with QK-norm are not clipped (the norm after the projections undoes the scaling; their
logits are bounded by its gain), nor are layers whose family gives no query/key rows; both are
warned about once. It logs, per head, ``clip_max_logit`` (:math:`S_h`), ``clip_factor``
(:math:`\gamma_h`) and ``clip_count`` (the steps the head was clipped so far, kept across a resume).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from qkmonitor.attention.clip import QKRows, clip_factors, head_max_logits
from qkmonitor.attention.probes import Probe, ProbeRequest, ProbeResult
from qkmonitor.engine.activation import ActivationEngine, Window
from qkmonitor.engine.host import Host
from qkmonitor.engine.publishing import Values
from qkmonitor.measures.catalogue import CLIP
from qkmonitor.validation import check_real

__all__ = ["QKClipEngine"]

#: Kimi Team 2025's bound on the scaled attention logits.
DEFAULT_TAU = 100.0


class QKClipEngine(ActivationEngine):
    """Scales the query and key projections of every head whose largest logit exceeded ``tau``.

    Args:
        tau: the bound, > 0, in the units of the layer's scaled logits (``scale · q·k``, what the
            softmax sees; the paper's 100).
        **kwargs: ``options`` or the fields of :class:`~qkmonitor.engine.MonitorOptions`;
            ``every_n_steps`` defaults to 1 here (clip after every optimizer step).
    """

    monitor = CLIP
    default_rules = ()

    def __init__(self, *, tau: float = DEFAULT_TAU, **kwargs: Any) -> None:
        check_real("tau", tau, above=0.0)
        self.tau = float(tau)
        if "options" not in kwargs:
            kwargs.setdefault("every_n_steps", 1)
        super().__init__(**kwargs)
        self._counts: list[Tensor] = []
        self._loaded_counts: list[list[int]] | None = None
        self._layout_probes: list[tuple[int, Probe]] = []
        self._messages: list[tuple[str, str]] = []  # warnings raised while measuring, for finish

    def thresholds(self) -> dict[str, float | int | str]:
        return {**super().thresholds(), f"{self.prefix}/{self.monitor}/tau": self.tau}

    # -- binding ----------------------------------------------------------------------------------

    def _prepare(self, model: nn.Module) -> None:
        super()._prepare(model)
        loaded, self._loaded_counts = self._loaded_counts, None
        self._counts = [
            torch.tensor(loaded[i])
            if loaded and i < len(loaded)
            else torch.zeros(0, dtype=torch.long)
            for i in range(len(self.layers))
        ]

    def _rows_of(self, i: int) -> QKRows | None:
        """Layer i's query/key rows, read now (views on the parameters as they are), or None
        (warned once) where it cannot or must not be clipped."""
        layer = self.layers[i]
        try:
            rows = layer.qk_rows()
        except (NotImplementedError, ValueError) as err:
            return self._skip(f"rows:{layer.name}", f"layer {layer.name!r} is not clipped: {err}.")
        if rows.qk_norm:
            why = "the norm after the projections undoes a scaling of W_Q and W_K"
            return self._skip(
                f"qk_norm:{layer.name}",
                f"layer {layer.name!r} has QK-norm and is not clipped: {why}.",
            )
        return rows

    def _skip(self, key: str, message: str) -> None:
        """Leave a layer unclipped, with one warning (given at the window's end, by ``finish``)."""
        self._messages.append((key, message))

    # -- the window ------------------------------------------------------------------------------

    def open(self, step: int, *, validation: bool = False) -> bool:
        if validation:  # a cure for training steps only
            return False
        return super().open(step)

    def _request(self) -> ProbeRequest:
        return ProbeRequest(stats=False, max_logits=True)  # the largest logits alone

    def _open_extra(self) -> None:
        """Layers whose weights are read by name check their layout on the window's forward."""
        for i, layer in enumerate(self.layers):
            if layer.needs_layout_check:
                self._layout_probes.append(
                    (i, layer.open_probe(ProbeRequest(stats=False, layout=True)))
                )

    def _close_extra(self) -> None:
        probes, self._layout_probes = self._layout_probes, []
        for i, probe in probes:
            message = self.layers[i].check_layout(probe.close())
            if message:
                self._messages.append((f"layout:{self.layers[i].name}", message))

    def close_window(self, host: Host) -> Window | None:
        try:
            return super().close_window(host)
        finally:
            messages, self._messages = self._messages, []
            for key, message in messages:
                self.warn_once(host, key, message)

    def _values(self, carried: tuple[Values, dict[str, Any]]) -> tuple[Values, dict[str, Any]]:
        """The values :meth:`_accumulate` made (no aggregator: its maxima crossed the ranks in
        their own ``all_reduce``)."""
        return carried

    def _accumulate(
        self, results: list[ProbeResult], step: int, *, visuals: bool
    ) -> tuple[Values, dict[str, Any]]:
        """Each head's largest logit over the ranks, its factor, the heads above ``tau`` scaled
        in place, and the values with their ``undefined`` flags (NaN where the layer did not run
        or the ranks disagree on its heads)."""
        s, disagree = _largest_over_ranks(
            [self._largest(i, result) for i, result in enumerate(results)]
        )
        for i in disagree:
            name = self.layers[i].name
            self._skip(
                f"heads:{name}",
                f"layer {name!r} is not clipped at step {step}: the processes disagree on its "
                "head count (a rank whose forward did not run it reads its configured one).",
            )
        values: Values = {"clip_max_logit": [], "clip_factor": [], "clip_count": []}
        undefined: dict[str, list[Tensor]] = {"clip_max_logit": [], "clip_factor": []}
        for i, (result, s_layer) in enumerate(zip(results, s)):
            ran = result.calls > 0
            gamma = clip_factors(s_layer, self.tau)
            # from the largest logits over every rank alone: a rank whose forward did not run the
            # layer scales it as the others do (its replica stays theirs)
            rows = self._rows_of(i) if bool((gamma < 1).any()) else None
            if rows is None:
                gamma = torch.ones_like(gamma)
            else:
                placement = self.layers[i].head_placement  # the rows are this rank's heads'
                try:
                    rows.scale_logits(gamma if placement is None else gamma[placement.slots])
                except Exception as err:  # noqa: BLE001 -- a cure that fails leaves training alone
                    name, why = self.layers[i].name, f"{type(err).__name__}: {err}"
                    self._skip(
                        f"scale:{name}", f"scaling layer {name!r} failed ({why}); not clipped."
                    )
                    gamma = torch.ones_like(gamma)
            counts = self._counts[i]
            if counts.numel() != gamma.numel():
                counts = torch.zeros(gamma.numel(), dtype=torch.long)
            self._counts[i] = counts + (gamma < 1).long()
            missing = torch.full(gamma.shape, not ran or i in disagree)  # NaN: undefined
            values["clip_max_logit"].append(torch.where(missing, math.nan, s_layer).float())
            values["clip_factor"].append(torch.where(missing, math.nan, gamma).float())
            values["clip_count"].append(self._counts[i].float())
            undefined["clip_max_logit"].append(missing)
            undefined["clip_factor"].append(missing)
        return values, {"undefined": undefined}

    def _largest(self, i: int, result: ProbeResult) -> Tensor:
        """Layer i's largest logit of each of its heads (``(H,)`` float64) in this rank's calls;
        where they hold this rank's part of the heads (tensor parallelism), the others' are
        ``-inf`` (the maximum over the ranks fills them)."""
        placement = result.placement
        if placement is not None:
            out = torch.full((placement.total,), -math.inf, dtype=torch.float64)
            out[placement.slots] = head_max_logits(result.max_logits, placement.count)
            return out
        heads = (
            result.max_logits[0].shape[1] if result.max_logits else self.layers[i].num_heads_hint
        )
        return head_max_logits(result.max_logits, heads)

    # -- resume ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "clip_counts": [c.tolist() for c in self._counts]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._loaded_counts = state.get("clip_counts")

    @property
    def clip_counts(self) -> list[Tensor]:
        """Per layer, ``(H,)``: the steps at which each head was clipped so far."""
        return list(self._counts)


def _largest_over_ranks(per_layer: list[Tensor]) -> tuple[list[Tensor], list[int]]:
    """Each head's largest logit over the processes of a distributed run, and the layers whose
    head count the processes disagree on (NaN there, on every rank: not clipped).

    A NaN counts as ``+inf`` in the reduction, so that every rank leaves that head alone. Two
    ``all_reduce`` calls: the head counts (their largest and smallest), then the maxima.
    """
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return per_layer, []
    device = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    )
    sizes = torch.tensor([t.numel() for t in per_layer], dtype=torch.float64)
    spread = torch.cat([sizes, -sizes]).to(device)
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)  # the largest count, and minus the smallest
    largest, smallest = spread.cpu().chunk(2)
    smallest = -smallest
    disagree = [i for i in range(len(per_layer)) if largest[i] != smallest[i]]
    parts = [
        torch.full((int(largest[i]),), -math.inf, dtype=torch.float64) if i in disagree else t
        for i, t in enumerate(per_layer)
    ]  # the same sizes on every rank
    flat = torch.cat(parts).nan_to_num(nan=math.inf, posinf=math.inf, neginf=-math.inf)
    flat = flat.to(device)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    reduced = list(flat.cpu().split([p.numel() for p in parts]))
    for i in disagree:
        reduced[i] = torch.full(per_layer[i].shape, math.nan, dtype=torch.float64)
    return reduced, disagree

r"""A per-head metric of your own: a :class:`~qkmonitor.measures.catalogue.MetricSpec` and the
function that computes it from each head's attention probabilities.

:class:`~qkmonitor.engine.EffectiveRank` takes them (``head_metrics=``) and measures each on the
probability slice its probes already capture — the first ``max_probe_sequences`` sequences and
``max_probe_tokens`` query rows of every probed call, over all the keys:

.. math::

    P \in [0, 1]^{S \times H \times R \times M}, \qquad
    v = \mathrm{measure}(P) \in \mathbb{R}^{S \times H},

one value per probe sequence and head. A head's value at a probe is the mean of ``v`` over the
sequences of every call in the window and over the ranks (its aggregator is the engine's
:class:`~qkmonitor.measures.metrics.HeadMean`, reduced with the other engines' in one collective);
a NaN sample makes it NaN. From there it goes where the engine's own metrics go: the tags
``{prefix}/{name}/layer_LL`` with ``_min``/``_max`` (and ``_head_HH`` with ``per_head=True``), the
custom-scalars layout (a category named by ``spec.family``), a heatmap where ``spec.heatmap`` is
set, ``qkmonitor report``, and the rules (an :class:`~qkmonitor.alerts.AlertRule` whose ``metric``
is ``spec.name``, given in ``alerts=``). docs/architecture.md, "A new per-head metric, end to
end", walks through it.

Example (each head's mean attention distance, :math:`\frac1R \sum_i \sum_j p_{ij}\,|i - j|`)::

    def mean_distance(probs):  # (S, H, R, M) -> (S, H)
        rows, keys = probs.shape[-2:]
        i = torch.arange(rows, device=probs.device)[:, None]
        j = torch.arange(keys, device=probs.device)[None, :]
        return (probs * (i - j).abs()).sum(-1).mean(-1)

    distance = HeadMetric(
        MetricSpec("attn_distance", RANK, True, "tokens", (0.0, math.inf), "", "attention distance",
                   "mean over query rows of sum_j p_ij |i - j|"),
        mean_distance,
    )
    EffectiveRank(head_metrics=[distance], alerts=[...])
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from torch import Tensor

from qkmonitor.measures.catalogue import CATALOGUE, RANK, MetricSpec

__all__ = ["HeadMetric", "measure_heads"]

#: what a metric's name may hold: it is a tag component (``{prefix}/{name}/layer_LL``)
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


@dataclasses.dataclass(frozen=True)
class HeadMetric:
    """One per-head metric measured on the attention probabilities (see the module's docstring).

    Args:
        spec: what it is: ``per_head=True``, ``monitor`` the measuring engine's
            (:data:`~qkmonitor.measures.catalogue.RANK`, ``"EffectiveRankMonitor"``), a name of
            letters, digits and ``_`` that no catalogue metric has; its ``family`` names its
            dashboard category, its ``heatmap`` (or None) its heatmap's bounds.
        measure: ``(S, H, R, M)`` probabilities (sequences, the call's heads, query rows, keys;
            each row sums to 1 over the keys it attends, 0 beyond) -> ``(S, H)`` values. It runs
            under ``torch.no_grad()`` on the probabilities' device and dtype (float32 or wider).

    Raises:
        ValueError: a spec that is not per head, of another monitor, or whose name is taken or
            not a tag component; a ``measure`` that is not callable.
    """

    spec: MetricSpec
    measure: Callable[[Tensor], Tensor]

    def __post_init__(self) -> None:
        spec = self.spec
        if not isinstance(spec, MetricSpec):
            raise ValueError(f"Expected `spec` to be a MetricSpec, got {type(spec).__name__}")
        if not (isinstance(spec.name, str) and _NAME.fullmatch(spec.name)):
            raise ValueError(
                "Expected the metric's name to be letters, digits and '_' (a tag component), "
                f"got {spec.name!r}"
            )
        if spec.name in {known.name for known in CATALOGUE}:
            raise ValueError(f"Metric {spec.name!r} is in the catalogue already; name yours apart")
        if not spec.per_head or spec.monitor != RANK:
            raise ValueError(
                f"Expected a per-head metric of {RANK} (per_head=True, monitor={RANK!r}), got "
                f"per_head={spec.per_head!r}, monitor={spec.monitor!r}"
            )
        if not callable(self.measure):
            raise ValueError(
                f"Expected `measure` to be a function of the probabilities, got "
                f"{type(self.measure).__name__}"
            )


def measure_heads(metric: HeadMetric, probs: Tensor) -> Tensor:
    """``metric.measure(probs)``, checked: ``(S, H, R, M)`` -> ``(S, H)``.

    Raises:
        ValueError: the function gave another shape (a metric problem: one warning, the engine's
            values of that probe dropped, training goes on: :func:`~qkmonitor.engine.failures.
            guarded`).
    """
    values = metric.measure(probs)
    if not isinstance(values, Tensor) or tuple(values.shape) != tuple(probs.shape[:2]):
        got = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
        raise ValueError(
            f"Expected the measure of {metric.spec.name!r} to give one value per sequence and "
            f"head, shape {tuple(probs.shape[:2])}, got {got}"
        )
    return values

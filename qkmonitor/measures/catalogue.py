"""The metric catalogue: one table that says what every logged metric is.

Tags (:mod:`qkmonitor.output.tags`), the TensorBoard layout and heatmaps
(:mod:`qkmonitor.output.dashboards`), ``qkmonitor report``, the CLI summary and the table in
docs/metrics.md are all derived from :data:`CATALOGUE`; a metric is added here once and appears
everywhere. The definitions themselves are in :mod:`qkmonitor.measures.spectra`,
:mod:`qkmonitor.measures.ranks`, :mod:`qkmonitor.measures.entropies` and ``docs/architecture.md``.

Example::

    >>> from qkmonitor.measures.catalogue import metric, metrics_of
    >>> metric("kappa").worse, metric("kappa").range
    ('high', (0.0, 1.0))
    >>> [m.name for m in metrics_of("EffectiveRankMonitor")][:2]
    ['hidden_erank', 'hidden_collapse']
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "CATALOGUE",
    "FAMILIES",
    "MONITORS",
    "MetricSpec",
    "markdown_table",
    "metric",
    "metrics_of",
    "names_of",
]

#: when a normalized entropy has no value: H_i / log n_i is 0/0 for a row with one key
_ONE_KEY = (
    "no query row may attend two keys (sequences of one token, or every row masked down to one "
    "key): H_i / log 1 = 0/0"
)

SPECTRUM, ENTROPY, RANK = "QKSpectrumMonitor", "AttentionEntropyMonitor", "EffectiveRankMonitor"
#: QK-Clip (the callback :class:`qkmonitor.callbacks.QKClip`, its engine
#: :class:`qkmonitor.engine.QKClipEngine`): a cure that logs what it did.
CLIP = "QKClip"
#: The monitors, in the order of the docs.
MONITORS = (SPECTRUM, ENTROPY, RANK, CLIP)


@dataclass(frozen=True)
class MetricSpec:
    """One metric.

    Attributes:
        name: the tag component (``{prefix}/{name}/layer_LL``).
        monitor: the monitor class that logs it.
        per_head: one value per head (with ``_min``/``_max`` band tags and optional head tags), or
            one value per layer.
        unit: what the number counts.
        range: the values it can take (``math.inf`` for unbounded).
        worse: ``"high"`` or ``"low"``: which end means trouble; ``""`` where neither does.
        family: the dashboard category it is charted in.
        heatmap: the bounds of its layer x head heatmap's colour range, or None for no heatmap
            (within them, the range follows the run's values: ``dashboards.HeatmapScale``).
        undefined: when the value is NaN by definition (documented, never reported as broken).
        meaning: one line for the docs.
        optional: logged only when a monitor option asks for it.
        summary: the columns of ``qkmonitor train``'s closing table: aggregates over heads among
            ``"mean"``, ``"min"``, ``"max"`` (none: not shown).
        reading: how to read a value, for the closing table's legend: what its ends mean and
            what is normal in a run that learns.
    """

    name: str
    monitor: str
    per_head: bool
    unit: str
    range: tuple[float, float]
    worse: str
    family: str
    meaning: str
    heatmap: tuple[float, float] | None = None
    undefined: str = ""
    optional: bool = False
    summary: tuple[str, ...] = ()
    reading: str = ""


_INF = math.inf
_SQUARE = "W_QK is not square (key input width != query input width): no eigenvalues"
_ZERO = "W_QK^h = 0 (e.g. a zero-initialised W_Q): 0/0"
_NO_UPDATE = (
    "no optimizer update was seen before the read (step 0; a plain loop's Monitoring without "
    "optimizer=), or the layer's family gives no query/key rows"
)
_ZERO_UPDATE = "the update moved neither W_Q^h nor W_K^g (a frozen step, a rate of 0): 0/0"

CATALOGUE: tuple[MetricSpec, ...] = (
    MetricSpec(
        "kappa",
        SPECTRUM,
        True,
        "ratio",
        (0.0, 1.0),
        "high",
        "QK spectrum",
        "sigma_1 / sum_i sigma_i of W_QK^h: 1 = one direction dominates the query-key form",
        heatmap=(0.0, 1.0),
        undefined=_ZERO,
        summary=("mean", "max"),
        reading=(
            "1/d_k: all directions of W_QK equal, 1: one direction; it rises as heads specialise, "
            "a concern when it keeps rising while the loss stalls (the kappa alert)"
        ),
    ),
    MetricSpec(
        "kappa_eig",
        SPECTRUM,
        True,
        "ratio",
        (0.0, 1.0),
        "high",
        "QK spectrum",
        "|lambda|_max / sum_i |lambda_i| over the eigenvalues of W_QK^h",
        undefined=f"{_SQUARE}; {_ZERO}",
    ),
    MetricSpec(
        "eig_mean",
        SPECTRUM,
        True,
        "logit/unit^2",
        (-_INF, _INF),
        "",
        "QK spectrum",
        "mean of the eigenvalues of W_K^T W_Q (real: trace / d_k; Bao et al. 2024)",
        undefined=_SQUARE,
    ),
    MetricSpec(
        "eig_var",
        SPECTRUM,
        True,
        "(logit/unit^2)^2",
        (0.0, _INF),
        "",
        "QK spectrum",
        "variance of those eigenvalues (Bao et al. 2024 tie mean and variance to localization)",
        undefined=_SQUARE,
    ),
    MetricSpec(
        "qk_erank",
        SPECTRUM,
        True,
        "directions",
        (1.0, _INF),
        "low",
        "QK spectrum",
        "effective rank exp(-sum p_i log p_i), p_i = sigma_i / sum_j sigma_j, of W_QK^h",
        undefined=_ZERO,
        summary=("mean",),
        reading="d_k: every direction of W_QK used, 1: one direction; it falls as heads specialise",
    ),
    MetricSpec(
        "qk_spectral_norm",
        SPECTRUM,
        True,
        "logit/unit^2",
        (0.0, _INF),
        "high",
        "QK spectrum",
        "sigma_1 * scale: how sharp the head's logits can get (Zhai et al. 2023, sigmaReparam)",
        undefined="the layer's forward does not tell its logit scale (soft-capped logits; a "
        "per-head bias with one sequence), named in a warning",
    ),
    MetricSpec(
        "q_update_ratio",
        SPECTRUM,
        True,
        "ratio",
        (0.0, _INF),
        "high",
        "optimizer's view",
        "||W_Q^h' - W_Q^h||_F / ||W_Q^h||_F over the update before the read: the update-to-weight "
        "RMS ratio of the head's query rows (Wortsman et al. 2023)",
        undefined=_NO_UPDATE,
    ),
    MetricSpec(
        "k_update_ratio",
        SPECTRUM,
        True,
        "ratio",
        (0.0, _INF),
        "high",
        "optimizer's view",
        "the same for the rows of the key head the head reads (W_K^g)",
        undefined=_NO_UPDATE,
    ),
    MetricSpec(
        "q_grad_norm",
        SPECTRUM,
        True,
        "gradient norm",
        (0.0, _INF),
        "high",
        "optimizer's view",
        "||grad of W_Q^h||_F: the gradient the update before the read was computed from",
        undefined=_NO_UPDATE,
    ),
    MetricSpec(
        "k_grad_norm",
        SPECTRUM,
        True,
        "gradient norm",
        (0.0, _INF),
        "high",
        "optimizer's view",
        "||grad of W_K^g||_F, of the key head the head reads",
        undefined=_NO_UPDATE,
    ),
    MetricSpec(
        "qk_update_entropy",
        SPECTRUM,
        True,
        "fraction of log r",
        (0.0, 1.0),
        "low",
        "optimizer's view",
        "-sum p_i log p_i / log r, p_i = sigma_i / sum_j sigma_j over the singular values of the "
        "update before the read to W_QK^h, its first-order term dW_Q W_K^T + W_Q dW_K^T; r = "
        "min(2 d_k, d, d'): 1 = spread over every direction it can take, 0 = one (Huang et al. "
        "2026), with update_spectrum=True",
        undefined=f"{_NO_UPDATE}; {_ZERO_UPDATE}",
        optional=True,
    ),
    MetricSpec(
        "qk_update_top_share",
        SPECTRUM,
        True,
        "ratio",
        (0.0, 1.0),
        "high",
        "optimizer's view",
        "sigma_1 / sum_i sigma_i of that update: 1 = one direction carries it all, with "
        "update_spectrum=True",
        undefined=f"{_NO_UPDATE}; {_ZERO_UPDATE}",
        optional=True,
    ),
    MetricSpec(
        "entropy",
        ENTROPY,
        True,
        "nats",
        (0.0, _INF),
        "low",
        "attention entropy",
        "mean over rows of H_i = -sum_j p_ij log p_ij over the keys row i may attend",
    ),
    MetricSpec(
        "entropy_norm",
        ENTROPY,
        True,
        "fraction of log n_i",
        (0.0, 1.0),
        "low",
        "attention entropy",
        "mean over rows with n_i > 1 of H_i / log n_i: 1 = uniform, 0 = one-hot",
        heatmap=(0.0, 1.0),
        undefined=_ONE_KEY,
        summary=("mean", "min"),
        reading=(
            "1: uniform over the keys, 0: all on one key; sharp heads are normal where a task "
            "looks things up, a concern when heads keep sharpening while the loss stalls"
        ),
    ),
    MetricSpec(
        "max_prob",
        ENTROPY,
        True,
        "probability",
        (0.0, 1.0),
        "high",
        "attention entropy",
        "mean over rows of max_j p_ij",
        heatmap=(0.0, 1.0),
    ),
    MetricSpec(
        "max_logit",
        ENTROPY,
        True,
        "logit",
        (-_INF, _INF),
        "high",
        "attention entropy",
        "largest pre-softmax score max_ij s_ij (after scaling) of the probe step",
        summary=("max",),
        reading=(
            "the sharpest softmax input; it grows as heads sharpen, a concern when it grows "
            "exponentially while the loss stalls (the logit alerts)"
        ),
    ),
    MetricSpec(
        "sink_mass",
        ENTROPY,
        True,
        "probability",
        (0.0, 1.0),
        "high",
        "attention entropy",
        "mean attention mass on the first k keys (attention sinks), with sink_tokens=k",
        optional=True,
    ),
    MetricSpec(
        "hidden_erank",
        RANK,
        False,
        "directions",
        (1.0, _INF),
        "low",
        "effective rank",
        "effective rank of each sequence's block output X (n x d), mean over probe sequences",
    ),
    MetricSpec(
        "hidden_collapse",
        RANK,
        False,
        "ratio",
        (0.0, 1.0),
        "low",
        "effective rank",
        "||X - 1 mean(X)^T||_F / ||X||_F: -> 0 under rank collapse (Dong et al. 2021)",
        undefined=(
            "every probed sequence is one token long: X = 1 mean(X)^T, so the ratio is 0 by "
            "construction, not a collapse"
        ),
        summary=("mean",),
        reading=(
            "1: the tokens' representations share no mean, 0: all tokens one vector (rank "
            "collapse); the instability suite's runs, failed ones included, stayed at 0.15 or "
            "above"
        ),
    ),
    MetricSpec(
        "attn_erank",
        RANK,
        True,
        "directions",
        (1.0, _INF),
        "low",
        "effective rank",
        "effective rank of the head's attention matrix A on the probe slice",
        summary=("mean",),
        reading=(
            "1: every query attends alike, up to the probe slice's rows (identity-like "
            "attention); low together with a low entropy is the malignant collapse"
        ),
    ),
    MetricSpec(
        "attn_erank_norm",
        RANK,
        True,
        "ratio",
        (0.0, 1.0),
        "low",
        "effective rank",
        "attn_erank / min(rows, keys) of the probe slice",
    ),
    MetricSpec(
        "attn_entropy_norm",
        RANK,
        True,
        "fraction of log n_i",
        (0.0, 1.0),
        "low",
        "effective rank",
        "entropy_norm of the same probe slice (the malignant_collapse rule pairs it with "
        "attn_erank)",
        undefined=_ONE_KEY,
    ),
    MetricSpec(
        "clip_max_logit",
        CLIP,
        True,
        "logit",
        (-_INF, _INF),
        "high",
        "QK-Clip",
        "S_h: the largest scaled logit of the step's forwards, before the clip",
        undefined="the layer did not run in the step",
    ),
    MetricSpec(
        "clip_factor",
        CLIP,
        True,
        "ratio",
        (0.0, 1.0),
        "low",
        "QK-Clip",
        "gamma_h = min(1, tau / S_h): what the head's logits were scaled by after the step (1: "
        "left alone)",
        undefined="the layer did not run in the step",
    ),
    MetricSpec(
        "clip_count",
        CLIP,
        True,
        "clips",
        (0.0, _INF),
        "high",
        "QK-Clip",
        "steps at which the head was clipped, since the run's start",
    ),
)

_BY_NAME = {spec.name: spec for spec in CATALOGUE}

#: Dashboard categories and their metrics, in display order.
FAMILIES: dict[str, tuple[str, ...]] = {}
for _spec in CATALOGUE:
    FAMILIES.setdefault(_spec.family, ())
    FAMILIES[_spec.family] += (_spec.name,)


def metric(name: str) -> MetricSpec:
    """The catalogue entry of ``name``.

    Raises:
        KeyError: for a metric the catalogue does not know, listing those it does.
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(
            f"Unknown metric {name!r}; the catalogue has {', '.join(_BY_NAME)}"
        ) from None


def metrics_of(monitor: str, *, optional: bool = False) -> tuple[MetricSpec, ...]:
    """The metrics a monitor logs, in catalogue order; ``optional`` ones only when asked."""
    return tuple(s for s in CATALOGUE if s.monitor == monitor and (optional or not s.optional))


def names_of(monitor: str, *, optional: bool = False) -> tuple[str, ...]:
    """:func:`metrics_of` as names."""
    return tuple(s.name for s in metrics_of(monitor, optional=optional))


def _fmt_bound(value: float) -> str:
    return "∞" if value == _INF else "−∞" if value == -_INF else f"{value:g}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table() -> str:
    """docs/metrics.md's table of every metric (generated here; a test keeps the page in step).

    A ``|`` inside a cell (``|lambda|``, ``||X||_F``) is escaped, so it does not split the cell.
    """
    lines = [
        "| metric | monitor | per | range | unit | worse | meaning | undefined when |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in CATALOGUE:
        lo, hi = s.range
        rng = f"[{_fmt_bound(lo)}, {_fmt_bound(hi)}]"
        name = f"`{s.name}`" + (" (optional)" if s.optional else "")
        lines.append(
            f"| {name} | {s.monitor} | {'head' if s.per_head else 'layer'} | {rng} | {s.unit} | "
            f"{s.worse or '—'} | {_cell(s.meaning)} | {_cell(s.undefined) or '—'} |"
        )
    return "\n".join(lines)

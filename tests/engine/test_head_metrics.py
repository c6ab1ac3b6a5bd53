"""A per-head metric added from outside the package, end to end (docs/architecture.md, "A new
per-head metric, end to end"): each head's mean attention distance, measured by EffectiveRank on
its probability slice in a Lightning fit of the bundled decoder, logged under its tags (the layer
mean, the ``_min``/``_max`` bands, the heads), charted in the custom-scalars layout, read back by
``qkmonitor report`` and watched by an AlertRule; the logged values against a float64 reference
computed with plain loops from the probabilities the engine measured."""

from __future__ import annotations

import math
import re

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from qkmonitor.alerts import AlertRule, QKMonitorWarning
from qkmonitor.callbacks import ActivationMonitor
from qkmonitor.cli import main
from qkmonitor.engine import EffectiveRank, HeadMetric
from qkmonitor.measures.catalogue import RANK, MetricSpec

from .tiny import TinyTask

NAME = "attn_distance"
SPEC = MetricSpec(
    NAME,
    RANK,
    True,
    "tokens",
    (0.0, math.inf),
    "",
    "attention distance",
    "mean over query rows i of sum_j p_ij |i - j|: how far back a head looks",
)


class FarAttentionWarning(QKMonitorWarning):
    """A user's own alert class."""


#: fires on every head at the first probe (every distance is >= 0)
FAR = AlertRule(name="far_attention", metric=NAME, threshold=0.0, above=True, patience=1,
                margin=0.0, warning=FarAttentionWarning, meaning="it looks far back",
                advice="nothing: a test")  # fmt: skip


def mean_distance(probs: torch.Tensor) -> torch.Tensor:
    """(S, H, R, M) probabilities -> (S, H): the mean over query rows i of sum_j p_ij |i - j|."""
    rows, keys = probs.shape[-2:]
    i = torch.arange(rows, device=probs.device)[:, None]
    j = torch.arange(keys, device=probs.device)[None, :]
    return (probs * (i - j).abs()).sum(-1).mean(-1)


def reference(probs: torch.Tensor) -> list[float]:
    """Each head's mean attention distance, with plain float64 loops: the mean over sequences of
    the mean over rows of sum_j p_ij |i - j|."""
    p = probs.double().tolist()
    heads = []
    for h in range(len(p[0])):
        per_sequence = []
        for seq in p:
            rows = seq[h]
            per_row = [
                sum(pij * abs(i - j) for j, pij in enumerate(row)) for i, row in enumerate(rows)
            ]
            per_sequence.append(sum(per_row) / len(per_row))
        heads.append(sum(per_sequence) / len(per_sequence))
    return heads


def test_a_users_per_head_metric_is_measured_logged_charted_reported_and_watched(tmp_path, capsys):
    seen: list[torch.Tensor] = []  # the slices the engine measured, in its order (layer 0, 1)

    def measured(probs: torch.Tensor) -> torch.Tensor:
        seen.append(probs.detach().cpu().clone())
        return mean_distance(probs)

    engine = EffectiveRank(
        head_metrics=[HeadMetric(SPEC, measured)],
        alerts=[FAR],
        per_head=True,
        every_n_steps=1,
        visuals_every_n_probes=0,
    )
    logger = TensorBoardLogger(tmp_path, name="run")
    trainer = pl.Trainer(
        max_steps=3,
        logger=logger,
        callbacks=[ActivationMonitor(engine)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
    )
    with pytest.warns(FarAttentionWarning, match=r"\[qkmonitor:far_attention\].*attn_distance"):
        trainer.fit(TinyTask())
    log_dir = logger.log_dir

    # measured and logged: the layer mean, the bands and each head, at each probe step
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}
    assert len(seen) == 3 * 2  # three probes of two layers, one call each
    for k, probs in enumerate(seen):
        step, layer = divmod(k, 2)
        assert probs.shape[:2] == (2, 4)  # two sequences, four heads
        assert torch.allclose(probs.sum(-1), torch.ones(()), atol=1e-5)  # rows of probabilities
        heads = reference(probs)
        tag = f"qkmonitor/{NAME}/layer_{layer:02d}"
        assert scalars[tag][step] == pytest.approx(sum(heads) / len(heads), rel=1e-5)
        low, high = (f"qkmonitor/{NAME}_{band}/layer_{layer:02d}" for band in ("min", "max"))
        assert scalars[low][step] == pytest.approx(min(heads), rel=1e-5)
        assert scalars[high][step] == pytest.approx(max(heads), rel=1e-5)
        for h, value in enumerate(heads):
            assert scalars[f"{tag}_head_{h:02d}"][step] == pytest.approx(value, rel=1e-5)
        assert 0 < min(heads) <= max(heads) < 12  # causal rows of 12 tokens look back
    assert engine.latest[NAME][1].tolist() == pytest.approx(reference(seen[-1]), rel=1e-5)

    # watched: the rule fired on every head at the first probe (and holds: no new alert while
    # the heads stay past it), counted at each probe and written as text
    assert scalars["qkmonitor/alerts/far_attention"] == {0: 8.0, 1: 8.0, 2: 8.0}
    texts = acc.Tensors("qkmonitor/alerts/far_attention/text_summary")
    assert [e.step for e in texts] == [0] * 8

    # charted: its family's category (a line per layer) and the margin charts of its bands
    config = acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0]
    layout = layout_pb2.Layout.FromString(config)
    category = next(c for c in layout.category if c.title == "qkmonitor: attention distance")
    assert [chart.title for chart in category.chart] == [f"{NAME} (a line per layer)"]
    margins = next(
        c for c in layout.category if c.title.startswith("qkmonitor: attention distance,")
    )
    series = [s for chart in margins.chart for s in chart.margin.series]
    tags = {s.value for s in series} | {s.lower for s in series} | {s.upper for s in series}
    for layer in (0, 1):
        layer_tags = {f"qkmonitor/{NAME}{band}/layer_{layer:02d}" for band in ("", "_min", "_max")}
        assert layer_tags <= tags

    # reported: `qkmonitor report` reads it back, its row and the alerts
    assert main(["report", log_dir, "--out", str(tmp_path / "report")]) == 0
    report = capsys.readouterr().out
    assert re.search(rf"^{NAME}\s+0\s", report, re.MULTILINE), report
    assert re.search(rf"^{NAME}\s+1\s", report, re.MULTILINE), report
    assert "far_attention" in report
    assert {f"{NAME}.png", f"{NAME}_heads.png"} <= {p.name for p in (tmp_path / "report").iterdir()}


def test_a_head_metric_is_checked_where_it_is_made():
    with pytest.raises(ValueError, match="per-head metric of EffectiveRankMonitor"):
        HeadMetric(MetricSpec(NAME, RANK, False, "", (0, 1), "", "f", "m"), mean_distance)
    with pytest.raises(ValueError, match="per-head metric of EffectiveRankMonitor"):
        HeadMetric(
            MetricSpec(NAME, "QKSpectrumMonitor", True, "", (0, 1), "", "f", "m"), mean_distance
        )
    with pytest.raises(ValueError, match="in the catalogue already"):
        HeadMetric(MetricSpec("attn_erank", RANK, True, "", (0, 1), "", "f", "m"), mean_distance)
    with pytest.raises(ValueError, match="a tag component"):
        HeadMetric(MetricSpec("a/b", RANK, True, "", (0, 1), "", "f", "m"), mean_distance)
    with pytest.raises(ValueError, match="a function of the probabilities"):
        HeadMetric(SPEC, "mean_distance")
    with pytest.raises(ValueError, match="distinct names"):
        EffectiveRank(head_metrics=[HeadMetric(SPEC, mean_distance)] * 2)
    with pytest.raises(ValueError, match="a list of qkmonitor.engine.HeadMetric"):
        EffectiveRank(head_metrics=HeadMetric(SPEC, mean_distance))


def test_a_rule_on_a_metric_no_engine_measures_is_refused_as_before():
    with pytest.raises(ValueError, match="EffectiveRankMonitor does not log"):
        EffectiveRank(alerts=[FAR])

"""The TensorBoard dashboards the monitors write, read back with TensorBoard's own readers."""

from __future__ import annotations

import math
import re
import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.hparams import plugin_data_pb2

from qkmonitor.alerts import KAPPA_RULE
from qkmonitor.callbacks import AttentionEntropyMonitor, EffectiveRankMonitor, QKSpectrumMonitor
from qkmonitor.output.dashboards import (
    LayoutSection,
    attention_image,
    custom_scalars_layout,
    heatmap_image,
)


def all_monitors(**kwargs):
    return [
        QKSpectrumMonitor(every_n_steps=2, **kwargs),
        AttentionEntropyMonitor(every_n_steps=2, **kwargs),
        EffectiveRankMonitor(every_n_steps=2, max_probe_tokens=6, pattern_heads=2, **kwargs),
    ]


def runs_below(log_dir) -> EventMultiplexer:
    """Every run TensorBoard finds in ``log_dir``, as it finds them: the run itself (``.``) and
    its layers' runs (``layers/layer_LL``)."""
    runs = EventMultiplexer(size_guidance={"scalars": 0}).AddRunsFromDirectory(str(log_dir))
    runs.Reload()
    return runs


def scalar_tags(log_dir) -> set[str]:
    """The scalar tags of every run in ``log_dir``: what the custom-scalars charts can find."""
    return {tag for run in runs_below(log_dir).Runs().values() for tag in run["scalars"]}


def fit(tmp_path, make_task, logger, **kwargs):
    task, data = make_task()
    pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=3,
        logger=logger,
        callbacks=all_monitors(**kwargs),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        log_every_n_steps=1,
    ).fit(task, datamodule=data)


def test_run_has_layout_heatmaps_histograms_attention_images_and_thresholds(tmp_path, make_task):
    # visuals at every probe here; the default cadence (every 20th) is
    # tests/engine/test_visuals.py's
    fit(tmp_path, make_task, TensorBoardLogger(tmp_path, "run", 0), visuals_every_n_probes=1)
    run = tmp_path / "run" / "version_0"
    acc = EventAccumulator(str(run), size_guidance={"images": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()

    images = set(tags["images"])
    assert {
        "qkmonitor/heatmap/kappa",
        "qkmonitor/heatmap/entropy_norm",
        "qkmonitor/heatmap/max_prob",
        "qkmonitor/attention/layer_01_head_01",
    } <= images
    assert "qkmonitor/attention/layer_00_head_02" not in images  # pattern_heads=2
    heat = acc.Images("qkmonitor/heatmap/kappa")
    assert [e.step for e in heat] == [0, 2]
    assert (
        heat[0].height > heat[0].width / 4
    )  # a readable picture of 2 layers x 4 heads, not a strip

    hist = acc.Histograms("qkmonitor/qk_singular_values/layer_01")
    assert hist[-1].histogram_value.num == 4 * 8  # every singular value of 4 heads with d_k = 8

    # one custom-scalars layout for the run, whose charts match the scalars logged
    layouts = [e for e in acc.Tensors("custom_scalars__config__")]
    assert len(layouts) == 1
    layout = layout_pb2.Layout.FromString(layouts[0].tensor_proto.string_val[0])
    charts = {chart.title: chart for category in layout.category for chart in category.chart}
    # the overlay charts one series a layer, each in the layer's own run (a colour each)
    kappa = charts["kappa (a line per layer)"].multiline.tag[0]
    runs = runs_below(run)
    assert sorted(runs.Runs()) == [".", "layers/layer_00", "layers/layer_01"]
    for name, found in runs.Runs().items():
        charted = [t for t in found["scalars"] if re.search(kappa, t)]
        assert charted == ([] if name == "." else ["qkmonitor/kappa"]), name
    for layer in (0, 1):  # the run's own values, step by step
        own = [(e.step, e.value) for e in acc.Scalars(f"qkmonitor/kappa/layer_{layer:02d}")]
        read = runs.Scalars(f"layers/layer_{layer:02d}", "qkmonitor/kappa")
        assert [(e.step, e.value) for e in read] == own and len(own) == 2
    margin = charts["entropy_norm layer 01 (heads: min, mean, max)"].margin.series
    assert [(s.value, s.lower, s.upper) for s in margin] == [
        (
            "qkmonitor/entropy_norm/layer_01",
            "qkmonitor/entropy_norm_min/layer_01",
            "qkmonitor/entropy_norm_max/layer_01",
        )
    ]
    assert {margin[0].value, margin[0].lower, margin[0].upper} <= set(tags["scalars"])
    assert "hidden_collapse layer 00 (heads: min, mean, max)" not in charts  # one value per layer
    # first the loss, found under the tag the task logs it with (qkmonitor does not write it)
    assert layout.category[0].title == "training"
    loss = charts["loss (training and validation)"].multiline.tag[0]
    assert [t for t in tags["scalars"] if re.search(loss, t)] == ["train_loss"]
    # no rule fired in 3 steps: no alert counter, so no flat zero chart
    assert not [t for t in tags["scalars"] if "/alerts/" in t]

    # HPARAMS compares runs by the loss and accuracy (Lightning's tags) and the alert counters
    content = acc.PluginTagToContent("hparams")["_hparams_/experiment"]
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content).experiment
    metrics = [info.name.tag for info in experiment.metric_infos]
    assert metrics[:3] == ["train_loss", "val_loss", "val_acc"] and "train_loss" in tags["scalars"]
    assert {"qkmonitor/alerts/kappa", "qkmonitor/alerts/malignant_collapse"} <= set(metrics)

    # one hparams record (TensorBoard shows a run's first) with the model's and the rules' values
    hparams = hparams_of(acc)
    assert hparams["qkmonitor/alert_kappa/threshold"] == KAPPA_RULE.threshold
    assert hparams["qkmonitor/alert_kappa/growth"] == KAPPA_RULE.growth
    assert hparams["qkmonitor/alert_rank_collapse/threshold"] == 1e-3
    assert hparams["config/d_model"] == 32 and hparams["lr"] == 3e-3  # the model's hyper-parameters


def hparams_of(acc) -> dict:
    """The run's hparams record as TensorBoard's HPARAMS tab reads it (the first one of the run)."""
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    return {key: getattr(value, value.WhichOneof("kind")) for key, value in info.hparams.items()}


def test_a_tensorboard_logger_with_a_prefix_keeps_it_on_the_monitors_scalars(tmp_path, make_task):
    """Without a prefix the scalars go straight to the logger's writer, one event a probe; with one,
    through ``log_metrics``, which prepends it (as for every other metric of the run)."""
    fit(tmp_path, make_task, TensorBoardLogger(tmp_path, "plain", 0))
    fit(tmp_path, make_task, TensorBoardLogger(tmp_path, "prefixed", 0, prefix="train"))
    tags = {}
    for run in ("plain", "prefixed"):
        acc = EventAccumulator(str(tmp_path / run / "version_0"), size_guidance={"scalars": 0})
        acc.Reload()
        tags[run] = set(acc.Tags()["scalars"])
    assert "qkmonitor/kappa/layer_00" in tags["plain"]
    assert (
        "train-qkmonitor/kappa/layer_00" in tags["prefixed"]
        and "qkmonitor/kappa/layer_00" not in tags["prefixed"]
    )
    assert {t.removeprefix("train-") for t in tags["prefixed"]} == tags["plain"]


def test_a_logger_prefix_applies_to_everything_and_every_chart_finds_its_scalars(
    tmp_path, make_task
):
    """Images, histograms, alert texts, the custom-scalars layout and the hparams metrics carry the
    logger's prefix as its scalars do, so that no dashboard is empty."""
    from qkmonitor.alerts import KAPPA_RULE

    always = KAPPA_RULE.replace(
        threshold=0.0,
        margin=0.0,
        growth=None,
        window=None,
        also=(),
        learning_drop=None,
        learning_window=None,
        solved_fraction=None,
    )  # an alert text to write
    task, data = make_task()
    monitors = all_monitors(visuals_every_n_probes=1)
    monitors[0] = QKSpectrumMonitor(every_n_steps=2, visuals_every_n_probes=1, alerts=[always])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(
            default_root_dir=tmp_path,
            max_steps=3,
            logger=TensorBoardLogger(tmp_path, "run", 0, prefix="train"),
            callbacks=monitors,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            limit_val_batches=0,
            log_every_n_steps=1,
        ).fit(task, datamodule=data)
    acc = EventAccumulator(
        str(tmp_path / "run" / "version_0"),
        size_guidance={"images": 0, "histograms": 0, "tensors": 0},
    )
    acc.Reload()
    tags = acc.Tags()
    scalars = set(tags["scalars"])
    ours = [t for kind in ("images", "histograms") for t in tags[kind]]
    texts = [t for t in tags["tensors"] if "alerts" in t]
    assert ours and texts and all(t.startswith("train-qkmonitor/") for t in ours + texts)
    layout = layout_pb2.Layout.FromString(
        acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0]
    )
    charts = [chart for category in layout.category for chart in category.chart]
    found = scalar_tags(tmp_path / "run" / "version_0")  # the layers' runs too
    for chart in charts:
        if chart.HasField("multiline"):
            assert all(any(re.search(p, t) for t in found) for p in chart.multiline.tag), (
                chart.title
            )
        else:
            assert all({x.value, x.lower, x.upper} <= scalars for x in chart.margin.series), (
                chart.title
            )
    assert "train-qkmonitor/alerts/kappa" in scalars


def test_non_tensorboard_logger_gets_scalars_and_one_message_about_images(tmp_path, make_task):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, make_task, CSVLogger(tmp_path, "csv", 0))
    skipped = [w for w in caught if "no images for CSVLogger" in str(w.message)]
    assert len(skipped) == 1  # one for the run, not one per monitor or probe
    header = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    assert "qkmonitor/kappa/layer_00" in header and "qkmonitor/entropy_norm_max/layer_01" in header


def test_heatmap_colours_follow_the_values_nan_is_grey_and_the_frame_has_labels_and_a_colour_bar():
    from qkmonitor.output.dashboards import _Canvas

    img = heatmap_image(
        torch.tensor([[0.0, 1.0], [float("nan"), 0.5]]), 0.0, 1.0, cell=40, annotate=False
    )
    assert img.dtype == np.uint8 and img.ndim == 3
    top, left = _Canvas.MARGIN_TOP, _Canvas.MARGIN_LEFT
    cell = lambda i, j: img[top + 40 * i + 20, left + 40 * j + 20]
    assert tuple(cell(1, 0)) == (128, 128, 128)
    assert cell(0, 0).sum() < cell(0, 1).sum()  # dark for 0, bright for 1
    bar = img[top + 5 : top + 75, left + 2 * 40 + 15]  # the colour bar: bright on top, dark below
    assert bar[0].sum() > bar[-1].sum()
    frame = img[:, :left]  # the left margin holds text (the layer label and indices): dark pixels
    assert (frame.sum(-1) < 200).any()
    annotated = heatmap_image(torch.tensor([[0.25]]), 0.0, 1.0, cell=40)
    assert not np.array_equal(
        annotated, heatmap_image(torch.tensor([[0.25]]), 0.0, 1.0, cell=40, annotate=False)
    )
    pattern = attention_image(torch.eye(4), size=40, title="layer 0, head 1, step 3")
    assert tuple(pattern[top + 5, left + 5]) != tuple(pattern[top + 5, left + 35])


def test_the_shared_frame_of_one_shape_carries_nothing_from_one_image_to_the_next():
    """Images of one shape share a cached frame: each keeps only its own title, numbers and
    cells."""
    grid = torch.tensor([[0.1, 0.9], [0.4, 0.6]])
    first = heatmap_image(grid, title="kappa at step 10")
    heatmap_image(grid.flip(0) * 5, title="kappa at step 20 with a much longer title")
    attention_image(torch.eye(2), title="another image, of another kind")
    assert np.array_equal(heatmap_image(grid, title="kappa at step 10"), first)
    other = heatmap_image(grid, title="kappa at step 11")
    assert other.shape == first.shape and not np.array_equal(other, first)  # the title differs
    assert np.array_equal(other[30:], first[30:])  # below the title, the same picture


def test_layout_lists_margin_charts_only_for_per_head_metrics():
    layout = custom_scalars_layout(
        [LayoutSection("p", ("kappa", "hidden_collapse"), 2, ("kappa",))]
    )
    margins = layout["p: kappa, per layer over heads"]
    assert list(margins) == [  # last first: TensorBoard shows them from the last
        "kappa layer 01 (heads: min, mean, max)",
        "kappa layer 00 (heads: min, mean, max)",
    ]
    assert "p: effective rank, per layer over heads" not in layout
    assert layout["p: alerts"]["alerts fired (count; a rule appears at its first alert)"] == [
        "Multiline",
        ["^p/alerts/"],
    ]


def test_the_overlays_chart_the_layers_runs_up_to_layer_runs_max_layers(tmp_path):
    """A metric's overlay charts ``{prefix}/{metric}`` in the layers' runs (TensorBoard colours
    by run), which the sink writes there, up to ``LAYER_RUNS_MAX`` layers; a deeper model's
    overlays chart the run's own tags, and no layer's run is written."""
    from torch.utils.tensorboard import SummaryWriter

    from qkmonitor.output.layer_runs import LAYER_RUNS_MAX
    from qkmonitor.output.sinks import SummaryWriterSink

    for layers in (2, LAYER_RUNS_MAX + 1):
        layout = custom_scalars_layout([LayoutSection("p", ("kappa", "hidden_erank"), layers)])
        log_dir = tmp_path / f"{layers}_layers"
        sink = SummaryWriterSink(SummaryWriter(log_dir))
        sink.log_layout(layout)
        for step in (0, 5):
            sink.log_scalars(
                {
                    **{f"p/kappa/layer_{n:02d}": 0.1 * n + step for n in range(layers)},
                    "p/kappa_max/layer_00": 1.0,  # a band: not an overlay
                    "p/hidden_erank/layer_00": 2.0,
                },
                step,
            )
        sink.writer.close()
        ((_, pattern),) = [layout["p: kappa"]["kappa (a line per layer)"]]
        runs = runs_below(log_dir)
        if layers > LAYER_RUNS_MAX:
            assert layout.overlays == set() and list(runs.Runs()) == ["."]
            assert [t for t in runs.Runs()["."]["scalars"] if re.search(pattern[0], t)] == [
                f"p/kappa/layer_{n:02d}" for n in range(layers)
            ]
            continue
        assert layout.overlays == {"p/kappa", "p/hidden_erank"}
        assert sorted(runs.Runs()) == [".", "layers/layer_00", "layers/layer_01"]
        assert sorted(runs.Runs()["layers/layer_00"]["scalars"]) == ["p/hidden_erank", "p/kappa"]
        for n in range(layers):
            found = [(e.step, e.value) for e in runs.Scalars(f"layers/layer_{n:02d}", "p/kappa")]
            assert found == [(0, pytest.approx(0.1 * n)), (5, pytest.approx(0.1 * n + 5))]
            assert re.search(pattern[0], "p/kappa") and not re.search(
                pattern[0], "p/kappa/layer_00"
            )


def test_the_last_probe_of_a_fit_is_drawn_in_tensorboard(tmp_path, make_task):
    """Probes at steps 0 and 2 of a 3-step fit, visuals every 3rd probe: the final state (step 2) is
    drawn when the fit ends, for every monitor, as TensorBoard reads it back."""
    task, data = make_task()
    pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=3,
        logger=TensorBoardLogger(tmp_path, "run", 0),
        callbacks=all_monitors(visuals_every_n_probes=3),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        log_every_n_steps=1,
    ).fit(task, datamodule=data)
    acc = EventAccumulator(
        str(tmp_path / "run" / "version_0"), size_guidance={"images": 0, "histograms": 0}
    )
    acc.Reload()
    for tag in (
        "qkmonitor/heatmap/kappa",
        "qkmonitor/heatmap/entropy_norm",
        "qkmonitor/attention/layer_01_head_01",
    ):
        assert [e.step for e in acc.Images(tag)] == [0, 2], tag
    assert [e.step for e in acc.Histograms("qkmonitor/qk_singular_values/layer_01")] == [0, 2]


def test_a_heatmap_scale_starts_at_the_first_grid_widens_and_never_narrows():
    from qkmonitor.output.dashboards import HeatmapScale

    scale = HeatmapScale((0.0, 1.0))
    nan = float("nan")
    assert scale.update(torch.tensor([[nan]])) == (0.0, 1.0)  # nothing seen yet: the bounds
    # nearly equal heads: a quarter of the bounds around them, on a step of 0.05
    # (0.33 +- 0.125 = 0.205..0.455, outward to 0.05)
    assert scale.update(torch.tensor([[0.32, 0.33], [0.34, nan]])) == (0.2, 0.5)
    assert scale.update(torch.tensor([[0.3, 0.31]])) == (0.2, 0.5)  # inside: unchanged
    assert scale.update(torch.tensor([[0.18, 0.4]])) == (0.15, 0.5)  # below: widened down
    assert scale.update(torch.tensor([[0.5, 0.97]])) == (0.15, 1.0)  # above, within the bounds
    assert scale.update(torch.tensor([[0.4]])) == (0.15, 1.0)  # never narrowed
    assert HeatmapScale((0.0, 1.0)).update(torch.tensor([[0.17, 0.39]])) == (0.15, 0.45)
    assert HeatmapScale((0.0, 1.0)).update(torch.tensor([[0.9, 1.0]])) == (0.75, 1.0)
    with pytest.raises(ValueError, match="`bounds`"):
        HeatmapScale((0.0, math.inf))


def test_the_layout_starts_with_the_loss_whatever_its_tag():
    layout = custom_scalars_layout([LayoutSection("p", ("kappa",), 1, ())], tag_prefix="train-")
    assert next(iter(layout)) == "training"
    kind, (pattern,) = layout["training"]["loss (training and validation)"]
    assert kind == "Multiline"
    for tag in ("train_loss", "train_loss_step", "train/loss", "loss", "val_loss", "eval/loss"):
        assert re.search(pattern, f"train-{tag}"), tag
    assert not re.search(pattern, "train-loss_scale") and not re.search(pattern, "train_loss")
    assert "training" not in custom_scalars_layout(
        [LayoutSection("p", ("kappa",), 1)], loss_tags=()
    )


class _NoLogits(torch.nn.Module):
    """Attention whose forward returns a scalar: no output logits to read."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x)[0].sum()


class _Logits(_NoLogits):
    def forward(self, x):
        return self.attn(x, x, x)[0]  # (B, N, 8): logits over 8 classes


def _layouts_of(tmp_path, model) -> list:
    """A plain loop with the three engines, 4 steps probed every 2; its layouts as TensorBoard's
    reader has them."""
    from torch.utils.tensorboard import SummaryWriter

    from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum

    log_dir = tmp_path / type(model).__name__
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    engines = [QKSpectrum(), AttentionEntropy(), EffectiveRank(max_probe_tokens=4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Monitoring(model, engines, writer=SummaryWriter(log_dir), every_n_steps=2) as m:
            for step in range(4):
                with m.step(step):
                    model(x)
    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return [
        layout_pb2.Layout.FromString(e.tensor_proto.string_val[0])
        for e in acc.Tensors("custom_scalars__config__")
    ], scalar_tags(log_dir)


def test_a_model_that_returns_no_logits_gets_no_output_logits_chart(tmp_path):
    """The output logits' chart is in the layout of a run that writes their tags, and only
    there: one layout a run either way, and every chart in it finds its scalars."""
    for model, charted in ((_NoLogits(), False), (_Logits(), True)):
        layouts, scalars = _layouts_of(tmp_path, model)
        assert len(layouts) == 1, type(model).__name__
        titles = [category.title for category in layouts[0].category]
        assert ("qkmonitor: output logits" in titles) is charted, titles
        assert any("/run/output_" in tag for tag in scalars) is charted
        # the loss (this loop logs none) and the alert counters (no rule fired) aside
        assert layouts[0].category[-1].title == "qkmonitor: alerts"
        for category in layouts[0].category[1:-1]:
            for chart in category.chart:
                tags = [*chart.multiline.tag, *(s.value for s in chart.margin.series)]
                assert all(
                    any(re.search(p, t) for t in scalars) if p.startswith("^") else p in scalars
                    for p in tags
                ), (category.title, chart.title)


def test_the_layout_puts_the_loss_then_entropy_norm_kappa_max_logit_first_and_layers_in_order(
    tmp_path,
):
    """The layout as TensorBoard reads it (TensorBoard shows categories and charts in this order):
    the loss, then the headline metrics, then the families; within a "per layer over heads"
    category the charts go by metric, then by layer 00, 01, 02 on the page (the layout lists them
    last first: TensorBoard shows such a category from its last chart, tests/browser)."""
    from torch.utils.tensorboard import SummaryWriter

    from qkmonitor.measures.catalogue import CATALOGUE
    from qkmonitor.output.sinks import SummaryWriterSink

    names = tuple(spec.name for spec in CATALOGUE)
    layout = custom_scalars_layout([LayoutSection("qkmonitor", names, 3, ("kappa",))])
    sink = SummaryWriterSink(SummaryWriter(tmp_path))
    sink.log_layout(layout)
    sink.log_scalars({"qkmonitor/run/output_lse_rms": 1.0}, 0)
    sink.write_pending_layout()
    sink.writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors("custom_scalars__config__")
    read = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])
    titles = [category.title for category in read.category]
    assert titles[:3] == [
        "training",
        "qkmonitor: entropy_norm, kappa, max_logit",
        "qkmonitor: entropy_norm, kappa, max_logit, per layer over heads",
    ]
    first = [chart.title for chart in read.category[1].chart]
    assert first == [f"{m} (a line per layer)" for m in ("entropy_norm", "kappa", "max_logit")]
    families = [t for t in titles[3:] if "per layer" not in t]
    assert families == [
        "qkmonitor: attention entropy",
        "qkmonitor: QK spectrum",
        "qkmonitor: effective rank",
        "qkmonitor: QK-Clip",
        "qkmonitor: optimizer's view",
        "qkmonitor: output logits",
        "qkmonitor: alerts",
    ]
    by_title = {category.title: category for category in read.category}
    for title, category in by_title.items():
        if not title.endswith(", per layer over heads"):
            continue
        # the metrics in the order of their category's "a line per layer" charts
        parent = by_title[title.removesuffix(", per layer over heads")]
        lines = [chart.title.removesuffix(" (a line per layer)") for chart in parent.chart]
        keys = []  # listed last first: TensorBoard shows margin categories from the last chart
        for chart in reversed(category.chart):
            metric, layer = re.fullmatch(r"(\w+) layer (\d\d) \(heads: .*\)", chart.title).groups()
            keys.append((lines.index(metric), int(layer)))
        assert keys == sorted(keys) and len(set(keys)) == len(keys), title
        assert {layer for _, layer in keys} == {0, 1, 2}
    assert [m for m in names if m in ("entropy_norm", "kappa", "max_logit")] != [
        "entropy_norm",
        "kappa",
        "max_logit",
    ]  # the headline's order is its own, not the catalogue's
    # each metric is charted once: the headline's are not repeated in their families
    multiline = [c.title for category in read.category for c in category.chart if c.multiline.tag]
    assert len(multiline) == len(set(multiline))

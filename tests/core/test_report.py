"""qkmonitor.output.report on real Lightning runs, checked against TensorBoard's own
EventAccumulator."""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import warnings

import lightning.pytorch as pl
import matplotlib.image
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.testing import assert_close
from torch.utils.tensorboard import SummaryWriter

from qkmonitor import QKMonitorWarning
from qkmonitor.alerts import DEFAULT_RULES, KAPPA_RULE
from qkmonitor.callbacks import AttentionEntropyMonitor, EffectiveRankMonitor, QKSpectrumMonitor
from qkmonitor.cli.report import add_report_parser, main_report, run_report
from qkmonitor.measures.catalogue import metric as catalogue_metric
from qkmonitor.models import TransformerConfig
from qkmonitor.models.tasks import AssociativeRecallDataModule, CausalLMTask
from qkmonitor.output.plots import _heads_figure, _loss_figure, _metric_figure, _run_labels
from qkmonitor.output.report import build_report
from qkmonitor.output.runs import read_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LAYER_TAG = re.compile(r"^qkmonitor/(?P<metric>[^/]+)/layer_(?P<layer>\d\d)$")
HEAD_TAG = re.compile(r"^qkmonitor/(?P<metric>[^/]+)/layer_(?P<layer>\d\d)_head_(?P<head>\d\d)$")


def tiny_task(lr: float):
    data = AssociativeRecallDataModule(
        num_pairs=3,
        num_queries=2,
        num_keys=8,
        num_values=8,
        batch_size=8,
        train_size=64,
        val_size=16,
        seed=0,
    )
    config = TransformerConfig(
        vocab_size=data.vocab_size, d_model=32, n_layers=2, n_heads=4, max_seq_len=data.seq_len
    )
    return CausalLMTask(config, lr=lr, warmup_steps=0), data


def train(root, name: str, callbacks, lr: float = 3e-3, rank_one: bool = False) -> list[str]:
    """A 4-step run logged to ``root/name/version_0``; returns the qkmonitor warnings' messages."""
    pl.seed_everything(0, verbose=False)
    task, data = tiny_task(lr)
    if rank_one:  # every head's W_QK of rank one: kappa = 1, so the kappa alert fires
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for block in task.model.blocks:
                w = block.attn.q_proj.weight
                w.copy_(
                    torch.randn(w.shape[0], 1, generator=gen)
                    @ torch.randn(1, w.shape[1], generator=gen)
                )
    trainer = pl.Trainer(
        default_root_dir=root,
        max_steps=4,
        logger=TensorBoardLogger(root, name=name, version=0),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
        limit_val_batches=0,
        accelerator="cpu",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(task, datamodule=data)
    return [str(w.message) for w in caught if issubclass(w.category, QKMonitorWarning)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    train(
        root,
        "plain",
        [
            QKSpectrumMonitor(every_n_steps=1, per_head=True, update_spectrum=True),
            AttentionEntropyMonitor(every_n_steps=1, per_head=True),
            EffectiveRankMonitor(every_n_steps=2),
        ],
    )
    level_kappa = KAPPA_RULE.replace(
        threshold=0.8, growth=None, window=None
    )  # kappa = 1 throughout: a level fires
    alerts = train(
        root,
        "alerting",
        [
            QKSpectrumMonitor(every_n_steps=1, per_head=True, alerts=[level_kappa]),
            AttentionEntropyMonitor(every_n_steps=1),
        ],
        lr=0.0,
        rank_one=True,
    )
    return {
        "plain": root / "plain" / "version_0",
        "alerting": root / "alerting" / "version_0",
        "alert_messages": alerts,
    }


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def layer_means(tags: dict[str, list]) -> dict[tuple[str, int], list[tuple[int, float]]]:
    """(metric, layer) -> events of the mean-over-heads tags; the `_min`/`_max` head bands left
    out."""
    found = {
        (m["metric"], int(m["layer"])): events
        for tag, events in tags.items()
        if (m := LAYER_TAG.match(tag))
    }
    metrics = {metric for metric, _ in found}
    return {
        key: events
        for key, events in found.items()
        if not (key[0].endswith(("_min", "_max")) and key[0][:-4] in metrics)
    }


def table_rows(text: str) -> dict[tuple[str, int], list[str]]:
    """(metric, layer) -> the cells of that row of the table (the lines from its dashes to a blank
    line)."""
    rows, inside = {}, False
    for line in text.splitlines():
        if line.startswith("-----"):
            inside = True
        elif not line.strip():
            inside = False
        elif inside:
            cells = line.split()
            rows[cells[0], int(cells[1])] = cells
    return rows


def close(cell: str, expected: float) -> bool:
    """A table cell (four significant digits) against the value read back independently."""
    if math.isnan(expected):
        return cell == "nan"
    return math.isclose(float(cell), expected, rel_tol=5e-4, abs_tol=1e-12)


def nan_min(values):
    finite = [v for v in values if not math.isnan(v)]
    return min(finite) if finite else math.nan


def nan_max(values):
    finite = [v for v in values if not math.isnan(v)]
    return max(finite) if finite else math.nan


def write_run(
    folder, values: dict[str, list[float]], text: dict[int, tuple[str, str]] | None = None
) -> None:
    """A run written by hand with torch's SummaryWriter: tag -> value at steps 0, 1, ...; alert
    texts as step -> (rule, message), under the rule's tag as the monitors write them."""
    writer = SummaryWriter(str(folder))
    for tag, series in values.items():
        for step, value in enumerate(series):
            writer.add_scalar(tag, value, step)
    for step, (rule, message) in (text or {}).items():
        writer.add_text(f"qkmonitor/alerts/{rule}", message, step)
    writer.close()


# -- the table -------------------------------------------------------------------------------


def test_table_final_min_max_match_event_accumulator(runs):
    report = build_report([runs["plain"]], plots=False)
    tags = scalars(runs["plain"])
    expected = layer_means(tags)
    rows = table_rows(report.text)
    assert set(rows) == set(expected)
    run = report.runs[0]
    for (metric, layer), events in expected.items():
        steps, values = [s for s, _ in events], [v for _, v in events]
        series = run.layers[metric][layer]
        assert series.steps == tuple(steps)
        assert_close(torch.tensor(series.values), torch.tensor(values), equal_nan=True)
        cells = rows[metric, layer]
        assert int(cells[2]) == steps[-1], (metric, layer)
        assert (
            close(cells[3], values[-1])
            and close(cells[4], nan_min(values))
            and close(cells[5], nan_max(values))
        ), cells
        if (
            f"qkmonitor/{metric}_max/layer_{layer:02d}" in tags
        ):  # the heads' range at the final step
            low = tags[f"qkmonitor/{metric}_min/layer_{layer:02d}"][-1][1]
            high = tags[f"qkmonitor/{metric}_max/layer_{layer:02d}"][-1][1]
            lo_cell, hi_cell = cells[6].split("..")
            assert close(lo_cell, low) and close(hi_cell, high), cells
    for tag, events in tags.items():
        if m := HEAD_TAG.match(tag):
            assert run.heads[m["metric"]][int(m["layer"])][int(m["head"])].final == events[-1][1]
    # discovered, known metrics first in the catalogue's order
    assert run.metrics[:6] == [
        "kappa",
        "kappa_eig",
        "eig_mean",
        "eig_var",
        "qk_erank",
        "qk_spectral_norm",
    ]
    assert run.metrics[6:10] == ["q_update_ratio", "k_update_ratio", "q_grad_norm", "k_grad_norm"]
    assert run.metrics[10:12] == ["qk_update_entropy", "qk_update_top_share"]
    assert run.metrics[12:16] == ["entropy", "entropy_norm", "max_prob", "max_logit"]
    assert {"hidden_erank", "hidden_collapse", "attn_erank"} <= set(run.metrics)
    assert run.final_step == max(events[-1][0] for events in expected.values())
    assert f"steps 0-{run.final_step}, 2 layer(s)" in report.text


def test_nan_and_unknown_metrics_are_shown(tmp_path):
    nan = float("nan")
    write_run(
        tmp_path / "v",
        {
            "qkmonitor/kappa/layer_00": [0.5, 0.7, nan],
            "qkmonitor/my_metric/layer_00": [2.0, 1.0, 3.0],
            "qkmonitor/kappa/layer_01": [nan, nan, nan],
            "qkmonitor/val/entropy/layer_00": [1.0, 1.5, 1.25],
        },
    )
    report = build_report([tmp_path / "v"], plots=False)
    rows = table_rows(report.text)
    assert rows["kappa", 0][3:6] == ["nan", "0.5", "0.7"]  # min and max leave NaN out
    assert rows["kappa", 1][3:6] == ["nan", "nan", "nan"]
    assert rows["my_metric", 0][3:6] == ["3", "1", "3"]
    assert rows["val/entropy", 0][3:6] == ["1.25", "1", "1.5"]
    assert report.runs[0].metrics == [
        "kappa",
        "my_metric",
        "val/entropy",
    ]  # known, unknown, validation
    # a rule's counter is written from its first alert on: none written, none fired
    assert "alerts: none fired (no alert counter written); 0 message(s)" in report.text


# -- the alerts ------------------------------------------------------------------------------


def test_alert_messages_and_counters(runs):
    report = build_report([runs["alerting"]], plots=False, max_alerts=None)
    run = report.runs[0]
    warned = runs["alert_messages"]
    assert len(warned) == 8  # kappa: every (layer, head) once
    from_warnings = sorted((int(re.search(r"at step (\d+)", m)[1]), m) for m in warned)
    assert sorted((a.step, a.message) for a in run.alerts) == from_warnings
    assert {a.rule for a in run.alerts} == {"kappa"}
    tags = scalars(runs["alerting"])
    counters = {
        tag.rsplit("/", 1)[1]: events[-1][1]
        for tag, events in tags.items()
        if tag.startswith("qkmonitor/alerts/")
    }
    assert {rule: s.final for rule, s in run.alert_counts.items()} == counters
    assert counters["kappa"] == 8.0
    assert "alerts: 8 fired: kappa 8" in report.text
    step, message = from_warnings[0]
    assert f"  step {step}  {message}" in report.text.splitlines()
    short = build_report([runs["alerting"]], plots=False, max_alerts=3).text
    assert short.count("[qkmonitor:kappa]") == 3 and "... and 5 more" in short


def test_text_alerts_are_read_whole_and_in_step_order(tmp_path):
    # the message text names no rule the report could parse: the rule comes from the tag
    messages = {3: ("logit_growth", "layer 1: late\nsecond line"), 1: ("kappa", "layer 0: early")}
    write_run(
        tmp_path / "v",
        {"qkmonitor/kappa/layer_00": [0.1] * 5, "qkmonitor/alerts/kappa": [0, 1, 1, 1, 1]},
        text=messages,
    )
    run = build_report([tmp_path / "v"], plots=False).runs[0]
    assert [(a.step, a.rule, a.message) for a in run.alerts] == [
        (1, *messages[1]),
        (3, *messages[3]),
    ]


# -- the plots -------------------------------------------------------------------------------


def check_png(path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC, path
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] >= 200 and image.shape[1] >= 400, (path, image.shape)
    assert image[..., :3].std() > 0.05, f"{path} looks blank"


def test_plots_one_per_metric_and_heatmaps_in_the_default_folder(runs):
    report = build_report([runs["alerting"]])
    out = runs["alerting"] / "report"
    assert (
        report.out_dir == out and f"plots: {len(report.plots)} PNG file(s) in {out}" in report.text
    )
    run = report.runs[0]
    expected = {f"{m}.png" for m in run.metrics} | {f"{m}_heads.png" for m in run.heads}
    expected.add("training_loss.png")  # the task logs `train_loss`
    assert {p.name for p in report.plots} == expected == {p.name for p in out.iterdir()}
    assert {"kappa.png", "kappa_heads.png", "entropy.png"} <= expected
    assert "entropy_heads.png" not in expected  # the entropy monitor ran without per_head
    for path in report.plots:
        check_png(path)


def test_two_runs_side_by_side(runs, tmp_path):
    report = build_report([runs["plain"], runs["alerting"]], out_dir=tmp_path / "cmp", max_alerts=1)
    text = report.text
    assert f"  A: {runs['plain']} (" in text and f"  B: {runs['alerting']} (" in text
    a_means, b_means = layer_means(scalars(runs["plain"])), layer_means(scalars(runs["alerting"]))
    rows = table_rows(text)
    assert set(rows) == set(a_means) | set(b_means)
    for key, cells in rows.items():
        a = a_means[key][-1][1] if key in a_means else None
        b = b_means[key][-1][1] if key in b_means else None
        assert cells[2] == "-" if a is None else close(cells[2], a), cells
        assert cells[3] == "-" if b is None else close(cells[3], b), cells
        if a is None or b is None:
            assert cells[4] == "-"
        else:
            assert close(cells[4], b - a) and cells[4][0] in "+-n", cells
    assert rows["kappa", 0][3] == "1"  # the rank-one run
    assert "A: alerts: none fired" in text and "B: alerts: 8 fired: kappa 8" in text
    assert {"kappa.png", "kappa_heads.png", "hidden_erank.png"} <= {p.name for p in report.plots}
    check_png(tmp_path / "cmp" / "kappa_heads.png")


# -- the loss, units, alert thresholds, colour scales and labels -----------------------------


def test_training_loss_is_read_plotted_and_told(runs, tmp_path):
    expected = scalars(runs["plain"])["train_loss"]  # what CausalLMTask (the CLI's task) logs
    report = build_report([runs["plain"]], out_dir=tmp_path / "report")
    run = report.runs[0]
    assert run.loss_tag == "train_loss"
    assert list(zip(run.loss.steps, run.loss.values)) == expected
    assert tmp_path / "report" / "training_loss.png" in report.plots
    check_png(tmp_path / "report" / "training_loss.png")
    (line,) = _loss_figure([run], ["A"]).axes[0].get_lines()
    assert list(line.get_xdata()) == [step for step, _ in expected]
    assert list(line.get_ydata()) == pytest.approx([loss for _, loss in expected])
    told = next(line for line in report.text.splitlines() if "training loss (`train_loss`)" in line)
    first, final = re.findall(r"([-\d.e+]+) at step (\d+)", told)
    assert close(first[0], expected[0][1]) and int(first[1]) == expected[0][0], told
    assert close(final[0], expected[-1][1]) and int(final[1]) == expected[-1][0], told


@pytest.mark.parametrize(
    ("tags", "found"),
    [
        (["train/loss"], "train/loss"),  # a plain loop's SummaryWriter, the Hugging Face Trainer
        (["train_loss_step", "train_loss_epoch"], "train_loss_step"),  # Lightning, on_epoch=True
        (["loss", "train_loss"], "train_loss"),
        (["loss"], "loss"),
        (["my_loss"], None),
    ],
)
def test_the_loss_tags_lightning_and_plain_loops_write(tmp_path, tags, found):
    write_run(tmp_path, {"qkmonitor/kappa/layer_00": [0.1, 0.2], **{t: [2.0, 1.0] for t in tags}})
    run = read_run(tmp_path)
    assert run.loss_tag == found
    if found is None:
        assert run.loss is None
        report = build_report([tmp_path], out_dir=tmp_path / "report")
        assert "training loss: none found (give its tag with `--loss-tag`)" in report.text
        assert "training_loss.png" not in {p.name for p in report.plots}
    else:
        assert run.loss.values == (2.0, 1.0)


def test_the_command_line_reads_a_loss_tag_it_is_given(tmp_path):
    write_run(tmp_path / "v", {"qkmonitor/kappa/layer_00": [0.1, 0.2], "my_loss": [2.0, 0.5]})
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "qkmonitor.cli",
            "report",
            str(tmp_path / "v"),
            "--loss-tag",
            "my_loss",
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "training loss (`my_loss`): 2 at step 0, 0.5 at step 1 (lowest 0.5)" in result.stdout
    assert (tmp_path / "out" / "training_loss.png").is_file()


def threshold_marks(ax) -> tuple[dict[str, list[float]], dict[str, str]]:
    """The alert thresholds a metric plot shows: rule -> the heights of its lines, and the notes of
    thresholds off the plot by side (``above``/``below``)."""
    lines: dict[str, list[float]] = {}
    for line in ax.get_lines():
        if (gid := line.get_gid() or "").startswith("alert "):
            lines.setdefault(gid[6:], []).append(line.get_ydata()[0])
    notes = {
        text.get_gid()[7:]: text.get_text()
        for text in ax.texts
        if (text.get_gid() or "").startswith("alerts ")
    }
    return lines, notes


def test_metric_plots_have_units_and_the_default_rules_thresholds(tmp_path):
    values = {
        "kappa": [0.1, 0.3, 0.4],  # its rule's 0.2 within the values: a line
        "qk_spectral_norm": [0.5, 1.5, 2.0],  # the kappa rule's condition, >= 1: a line
        "max_logit": [2.0, 3.0, 4.0],  # 20, 30, 50: far above, named in a note
        "hidden_collapse": [0.5, 0.6, 0.55],  # 1e-3: far below, named in a note
        "entropy": [1.0, 1.2, 1.1],  # no default rule
        "val/kappa": [0.1, 0.3, 0.4],  # the rules watch training only
        "my_metric": [1.0, 2.0, 3.0],
    }
    write_run(tmp_path / "v", {f"qkmonitor/{m}/layer_00": v for m, v in values.items()})
    run = read_run(tmp_path / "v")
    for name, series in values.items():
        ax = _metric_figure([run], name, ["A"]).axes[0]
        known = name.removeprefix("val/") if name != "my_metric" else None
        assert ax.get_ylabel() == (f"{name} ({catalogue_metric(known).unit})" if known else name), (
            name
        )
        expected = sorted(
            (rule.name, test.threshold)
            for rule in DEFAULT_RULES
            for test in rule.tests
            if test.metric == name
        )
        lines, notes = threshold_marks(ax)
        drawn = sorted((rule, y) for rule, ys in lines.items() for y in ys)
        noted = sorted(
            (rule, threshold)
            for rule, threshold in expected
            if any(f"{threshold:g} ({rule})" in note for note in notes.values())
        )
        assert sorted(drawn + noted) == expected, name
        low, high = ax.get_ylim()
        assert all(low <= y <= high for _, y in drawn), name
        assert min(series) >= low and max(series) <= high, name
    kappa_lines, _ = threshold_marks(_metric_figure([run], "kappa", ["A"]).axes[0])
    assert kappa_lines == {"kappa": [KAPPA_RULE.threshold]}
    assert set(threshold_marks(_metric_figure([run], "max_logit", ["A"]).axes[0])[1]) == {"above"}
    assert set(threshold_marks(_metric_figure([run], "hidden_collapse", ["A"]).axes[0])[1]) == {
        "below"
    }
    for path in build_report([run.path], out_dir=tmp_path / "report").plots:
        check_png(path)


def write_heads(folder, per_metric: dict[str, list[list[list[float]]]]) -> None:
    """Per metric, a (layers x heads) grid at steps 0, 1, ..., with the layer means the report
    needs."""
    values: dict[str, list[float]] = {}
    for name, grids in per_metric.items():
        for grid in grids:
            for layer, heads in enumerate(grid):
                tag = f"qkmonitor/{name}/layer_{layer:02d}"
                values.setdefault(tag, []).append(sum(heads) / len(heads))
                for head, value in enumerate(heads):
                    values.setdefault(f"{tag}_head_{head:02d}", []).append(value)
    write_run(folder, values)


def test_heatmaps_share_one_scale_per_metric_across_heads_and_runs(tmp_path):
    import numpy as np

    from qkmonitor.output.dashboards import HeatmapScale

    # two steps each: kappa's history reaches the colour range, as in TensorBoard's images
    a = {
        "kappa": [[[0.12, 0.15]], [[0.2, 0.3]]],
        "eig_mean": [[[0.0, 0.0]], [[-0.02, 0.01]]],
        "entropy": [[[9.0, 9.0]], [[1.0, 2.0]]],
    }
    b = {
        "kappa": [[[0.1, 0.1]], [[0.25, 0.62]]],
        "eig_mean": [[[0.0, 0.0]], [[0.005, 0.03]]],
        "entropy": [[[9.0, 9.0]], [[1.5, 3.0]]],
    }
    write_heads(tmp_path / "a" / "recall" / "version_0", a)
    write_heads(tmp_path / "b" / "recall" / "version_0", b)
    runs = [read_run(tmp_path / "a" / "recall"), read_run(tmp_path / "b" / "recall")]
    labels = _run_labels(runs)
    assert labels == ["A: a/recall/version_0", "B: b/recall/version_0"]

    def panels(name):
        figure = _heads_figure(runs, name, labels)
        images = [ax.images[0] for ax in figure.axes if ax.images]
        assert len(images) == 2
        return figure, images

    # kappa: the range TensorBoard's heatmap images take, fed the runs' steps in turn
    tensorboard = HeatmapScale(catalogue_metric("kappa").heatmap)
    for grids in (a["kappa"], b["kappa"]):
        for grid in grids:
            tensorboard.update(torch.tensor(grid))
    figure, images = panels("kappa")
    clims = [image.get_clim() for image in images]
    assert clims[0] == clims[1] == pytest.approx(tensorboard.range)
    assert clims[0][0] <= 0.1 and clims[0][1] >= 0.62  # every value of both runs on the scale
    titles = [ax.get_title() for ax in figure.axes if ax.images]
    assert [t.splitlines()[0] for t in titles] == labels
    bar = next(ax for ax in figure.axes if not ax.images)  # the colour bar: the rule's level
    assert [line.get_ydata()[0] for line in bar.get_lines()] == [KAPPA_RULE.threshold]
    # eig_mean, signed: centred at 0 on a diverging map, both runs' largest |value| at the ends
    _, images = panels("eig_mean")
    reach = max(abs(v) for run in (a, b) for v in run["eig_mean"][-1][0])  # the final values
    clims = [image.get_clim() for image in images]  # TensorBoard stores float32
    assert clims[0] == clims[1] == pytest.approx((-reach, reach), rel=1e-6)
    cmap = images[0].get_cmap()
    assert cmap.name.startswith("RdBu")
    low_end, middle, high_end = (np.asarray(cmap(x)[:3]) for x in (0.0, 0.5, 1.0))
    assert middle.min() > 0.9 and low_end[2] > low_end[0] and high_end[0] > high_end[2]
    # entropy: no TensorBoard heatmap; the final values of both runs
    _, images = panels("entropy")
    assert [image.get_clim() for image in images] == [(1.0, 3.0)] * 2
    # the runs' labels in the overlaid metric plots too
    legend = _metric_figure(runs, "kappa", labels).axes[0].get_legend()
    assert {text.get_text() for text in legend.get_texts()} >= set(labels)


def test_run_labels_are_the_shortest_distinguishing_tail(tmp_path):
    def run_at(*parts):
        return type("Run", (), {"path": tmp_path.joinpath(*parts)})()

    assert _run_labels([run_at("recall", "version_0"), run_at("recall", "version_1")]) == [
        "A: recall/version_0",
        "B: recall/version_1",
    ]
    assert _run_labels(
        [run_at("x", "lr1", "recall", "version_0"), run_at("x", "lr2", "recall", "version_0")]
    ) == [
        "A: lr1/recall/version_0",
        "B: lr2/recall/version_0",
    ]
    assert _run_labels([run_at("recall", "version_0")]) == ["A: recall/version_0"]


# -- finding runs, errors and the command line -----------------------------------------------


def test_a_parent_folder_with_one_run_is_read(runs):
    report = build_report([runs["alerting"].parent], plots=False)
    assert report.runs[0].path == runs["alerting"] and "note:" not in report.text


def test_a_parent_folder_with_several_runs_takes_the_newest_and_says_so(tmp_path):
    for version, kappa in enumerate([0.1, 0.2, 0.3]):
        write_run(tmp_path / "recall" / f"version_{version}", {"qkmonitor/kappa/layer_00": [kappa]})
    for version, age in [(0, 300), (1, 100), (2, 200)]:  # version_1 written last
        for event in (tmp_path / "recall" / f"version_{version}").iterdir():
            os.utime(event, (event.stat().st_atime, event.stat().st_mtime - age))
    report = build_report([tmp_path / "recall"], plots=False)
    assert report.runs[0].path == tmp_path / "recall" / "version_1"
    assert report.runs[0].layers["kappa"][0].final == pytest.approx(0.2)
    assert (
        "holds 3 runs (version_0, version_1, version_2); reporting the newest, `version_1`"
        in report.text
    )


def test_the_layers_runs_inside_a_run_are_read_as_that_run(tmp_path):
    """A run's layers' runs (``layers/layer_LL``: its overlays, one TensorBoard run a layer, here
    the newest event files below the folder given) are part of the run: neither taken for a run
    of their own nor counted among the runs, and one given is read as its run."""
    run = tmp_path / "recall" / "version_0"
    write_run(run, {"qkmonitor/kappa/layer_00": [0.1, 0.2], "qkmonitor/kappa/layer_01": [0.3]})
    for event in run.iterdir():
        os.utime(event, (event.stat().st_atime, event.stat().st_mtime - 100))
    for layer in (0, 1):
        write_run(run / "layers" / f"layer_{layer:02d}", {"qkmonitor/kappa": [0.1, 0.2]})
    report = build_report([tmp_path / "recall"], plots=False)
    assert report.runs[0].path == run and "note:" not in report.text
    assert report.runs[0].layers["kappa"][1].final == pytest.approx(0.3)
    report = build_report([run / "layers" / "layer_01"], plots=False)
    assert report.runs[0].path == run and "is one layer's run of" in report.text


def test_errors_name_the_path_and_what_was_expected(tmp_path):
    with pytest.raises(
        ValueError, match=r"`.*nowhere` does not exist; expected a TensorBoard run folder"
    ):
        build_report([tmp_path / "nowhere"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"`.*empty` holds no TensorBoard event files"):
        build_report([tmp_path / "empty"])
    write_run(tmp_path / "other", {"train_loss": [1.0, 0.5]})
    with pytest.raises(
        ValueError,
        match=(
            r"`.*other` holds no qkmonitor scalars: expected tags like "
            r"`qkmonitor/kappa/layer_00`.*`train_loss`"
        ),
    ):
        build_report([tmp_path / "other"])
    write_run(tmp_path / "mine", {"watch/kappa/layer_00": [0.5]})
    with pytest.raises(ValueError, match=r"under the prefix `watch` \(try `--prefix`\)"):
        build_report([tmp_path / "mine"])
    assert (
        build_report([tmp_path / "mine"], prefix="watch", plots=False)
        .runs[0]
        .layers["kappa"][0]
        .final
        == 0.5
    )
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="not a TensorBoard event file"):
        build_report([tmp_path / "notes.txt"])
    with pytest.raises(ValueError, match="non-empty list of run folders"):
        build_report([])


def test_command_line_prints_the_report_or_the_error(runs, tmp_path, capsys):
    assert main_report([str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkmonitor report: Run directory `") and "nowhere` does not exist" in err

    parser = argparse.ArgumentParser(prog="qkmonitor")  # how the main CLI wires the command
    add_report_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["report", str(runs["alerting"]), "--no-plots", "--max-alerts", "0"])
    assert args.command == "report" and run_report(args) == 0
    out = capsys.readouterr().out
    assert (
        out.startswith(f"qkmonitor report: {runs['alerting']}\n") and "[qkmonitor:kappa]" not in out
    )
    assert "alerts: 8 fired: kappa 8" in out and "plots:" not in out


def test_rules_at_one_threshold_share_one_label_that_names_them_all(tmp_path):
    """`max_logit.png` with values up to 40: the thresholds at 22, 30 and 55 are drawn, and the
    two rules at 30 (logit_growth, fast_updates) are named in one label, not in two printed over
    each other."""
    at_30 = [
        r.name
        for r in DEFAULT_RULES
        for t in r.tests
        if (t.metric, t.threshold) == ("max_logit", 30.0)
    ]
    assert at_30 == ["logit_growth", "fast_updates"]  # the default rules this checks
    write_run(tmp_path / "v", {"qkmonitor/max_logit/layer_00": [5.0, 25.0, 40.0]})
    ax = _metric_figure([read_run(tmp_path / "v")], "max_logit", ["A"]).axes[0]
    at = {}  # label height -> the labels there, from the figure's text artists
    for text in ax.texts:
        if text.get_text().startswith("alert ") and not (text.get_gid() or "").startswith("alerts"):
            at.setdefault(text.get_position()[1], []).append(text.get_text())
    assert {22.0, 30.0} <= set(at) and all(len(labels) == 1 for labels in at.values()), at
    assert at[30.0][0].startswith("alert logit_growth, fast_updates: ≥ 30"), at
    assert at[22.0][0].startswith("alert logit_jump: ≥ 22"), at


def test_reading_and_writing_the_text_load_neither_matplotlib_nor_tensorboard_nor_lightning():
    """Importing the report's modules is cheap: matplotlib and TensorBoard are imported when a
    figure is drawn or a run read, Lightning never."""
    code = (
        "import sys\n"
        "import qkmonitor.output.plots, qkmonitor.output.report, qkmonitor.output.report_text\n"
        "import qkmonitor.output.runs\n"
        "heavy = [m for m in ('matplotlib', 'tensorboard', 'lightning') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)

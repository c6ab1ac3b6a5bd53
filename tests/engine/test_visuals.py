"""The visuals' cadence, and what the TensorBoard sink writes, read back with TensorBoard's
reader."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from qkmonitor import OverLocalizationWarning
from qkmonitor.alerts import KAPPA_RULE
from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum
from qkmonitor.output.sinks import MemorySink, SummaryWriterSink


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x, x, x, need_weights=False)[0]


def run(engines, steps: int, writer) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    with Monitoring(model, engines, writer=writer, every_n_steps=1) as monitoring:
        for step in range(steps):
            with monitoring.step(step):
                model(torch.randn(2, 5, 8))


def engines(visuals: int) -> list:
    return [
        QKSpectrum(visuals_every_n_probes=visuals),
        AttentionEntropy(visuals_every_n_probes=visuals),
        EffectiveRank(visuals_every_n_probes=visuals, pattern_heads=1),
    ]


@pytest.mark.parametrize("visuals", [1, 3, 0])
def test_visuals_come_with_every_nth_probe_and_scalars_with_every_probe(visuals):
    sink = MemorySink()
    run(engines(visuals), 7, sink)
    expected = [s for s in range(7) if visuals and s % visuals == 0]
    image_steps = {
        tag: sorted({s for t, _, s in sink.images if t == tag}) for tag, _, _ in sink.images
    }
    assert set(image_steps) == (
        {
            "qkmonitor/heatmap/kappa",
            "qkmonitor/heatmap/entropy_norm",
            "qkmonitor/heatmap/max_prob",
            "qkmonitor/attention/layer_00_head_00",
            "qkmonitor/attention/layer_01_head_00",
        }
        if visuals
        else set()
    )
    assert all(steps == expected for steps in image_steps.values())
    assert sorted({s for _, _, s in sink.histograms}) == expected
    assert sorted({s for t, _, s in sink.scalars if t == "qkmonitor/kappa/layer_00"}) == list(
        range(7)
    )
    assert sorted(
        {s for t, _, s in sink.scalars if t == "qkmonitor/entropy_norm/layer_01"}
    ) == list(range(7))


@pytest.mark.parametrize("value", [-1, True, 1.5, "10"])
def test_visuals_every_n_probes_is_checked(value):
    with pytest.raises(ValueError, match="`visuals_every_n_probes`"):
        QKSpectrum(visuals_every_n_probes=value)


def test_summary_writer_sink_writes_what_tensorboard_reads_back(tmp_path):
    """One event for a probe's scalars, PNG images: TensorBoard reads the same tags, values,
    steps and pixels as ``add_scalar`` / ``add_image`` would give."""
    writer = SummaryWriter(str(tmp_path))
    sink = SummaryWriterSink(writer)
    sink.log_scalars({"a/x": 0.25, "a/y": float("nan"), "b/z": -3.0}, step=4)
    sink.log_scalars({"a/x": 0.5}, step=5)
    image = np.random.default_rng(0).integers(0, 256, size=(7, 11, 3), dtype=np.uint8)
    sink.log_image("pic", image, step=4)
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("a/x")] == [(4, 0.25), (5, 0.5)]
    assert np.isnan(acc.Scalars("a/y")[0].value) and acc.Scalars("b/z")[0].value == -3.0
    (shown,) = acc.Images("pic")
    from io import BytesIO

    from PIL import Image

    assert shown.step == 4 and (shown.width, shown.height) == (11, 7)
    assert np.array_equal(np.asarray(Image.open(BytesIO(shown.encoded_image_string))), image)
    with pytest.raises(ValueError, match="`image`"):
        sink.log_image("bad", image.astype(np.float32), step=6)


def test_monitors_in_a_real_run_write_images_only_at_visual_probes(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    run(engines(2), 5, writer)
    writer.close()
    acc = EventAccumulator(
        str(tmp_path), size_guidance={"images": 0, "scalars": 0, "histograms": 0}
    )
    acc.Reload()
    assert [e.step for e in acc.Images("qkmonitor/heatmap/kappa")] == [0, 2, 4]
    assert [e.step for e in acc.Histograms("qkmonitor/qk_singular_values/layer_00")] == [0, 2, 4]
    assert [e.step for e in acc.Scalars("qkmonitor/kappa/layer_00")] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("steps", [8, 7])
def test_the_last_probe_of_a_run_is_always_drawn(steps):
    """Every 3rd probe draws; a run of 8 steps ends on probe 7, which is drawn when the run ends (7
    steps end on a drawing probe: nothing more)."""
    sink = MemorySink()
    run(engines(3), steps, sink)
    expected = sorted({s for s in range(steps) if s % 3 == 0} | {steps - 1})
    image_steps = {
        tag: sorted({s for t, _, s in sink.images if t == tag}) for tag, _, _ in sink.images
    }
    assert len(image_steps) == 5 and all(found == expected for found in image_steps.values()), (
        image_steps
    )
    assert sorted({s for _, _, s in sink.histograms}) == expected
    final = [
        image
        for tag, image, s in sink.images
        if tag == "qkmonitor/heatmap/kappa" and s == steps - 1
    ]
    assert len(final) == 1 and final[0].ndim == 3


def test_a_runs_heatmaps_share_one_colour_scale_that_spreads_its_values(tmp_path):
    """κ of these heads lies in a narrow band of 0..1: the colours still tell the heads apart (the
    highest head bright, the lowest dark), and a run whose weights do not change draws the same
    picture at every step (one scale for the run), as TensorBoard reads the images back."""
    from io import BytesIO

    from PIL import Image

    from qkmonitor.output.dashboards import _Canvas

    writer = SummaryWriter(str(tmp_path))
    run([QKSpectrum(per_head=True, visuals_every_n_probes=2)], 3, writer)
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    images = acc.Images("qkmonitor/heatmap/kappa")
    assert [e.step for e in images] == [0, 2]
    pictures = [np.asarray(Image.open(BytesIO(e.encoded_image_string))) for e in images]
    assert np.array_equal(pictures[0][30:], pictures[1][30:])  # below the title: the same colours
    kappa = {
        (layer, head): acc.Scalars(f"qkmonitor/kappa/layer_{layer:02d}_head_{head:02d}")[0].value
        for layer in range(2)
        for head in range(2)
    }
    cell = 48  # a 2 x 2 grid's cells, annotated (the value written in the middle)
    top, left = _Canvas.MARGIN_TOP, _Canvas.MARGIN_LEFT
    luminance = {
        (i, j): pictures[0][top + i * cell + 3, left + j * cell + 3]
        @ np.array([0.299, 0.587, 0.114])
        for i, j in kappa
    }
    order = sorted(kappa, key=kappa.get)
    assert max(kappa.values()) - min(kappa.values()) < 0.35  # a narrow band of the 0..1 range
    assert [luminance[k] for k in order] == sorted(luminance.values())  # brighter = higher
    assert luminance[order[-1]] - luminance[order[0]] > 100  # far apart on the ramp


def test_a_loop_without_a_writer_makes_no_scalars_or_visuals_and_still_alerts(monkeypatch):
    """With nothing to write to (``writer=None``, as on a rank that does not log) a probe still
    measures and fires its rules, but makes no tags and draws nothing."""
    made = []
    monkeypatch.setattr(
        "qkmonitor.engine.publishing.ValuePublisher.scalars", lambda *a, **k: made.append(a) or {}
    )
    monkeypatch.setattr(
        "qkmonitor.engine.publishing.ValuePublisher._draw", lambda *a, **k: made.append(a)
    )
    every_head = KAPPA_RULE.replace(  # fires on every finite kappa, from the first probe
        name="any_kappa", threshold=0.0, also=(), growth=None, window=None, learning_drop=None,
        solved_fraction=None, skip_qk_norm=False,
    )  # fmt: skip
    spectrum = QKSpectrum(alerts=[every_head], visuals_every_n_probes=1)
    with pytest.warns(OverLocalizationWarning, match="any_kappa"):
        run([spectrum], 2, None)
    assert spectrum.latest["kappa"][0].isfinite().all() and not made
    sink = MemorySink()  # the same with a writer makes both
    with pytest.warns(OverLocalizationWarning, match="any_kappa"):
        run([QKSpectrum(alerts=[every_head], visuals_every_n_probes=1)], 2, sink)
    assert made and any(tag.endswith("alerts/any_kappa") for tag, _, _ in sink.texts)

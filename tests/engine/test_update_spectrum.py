"""The spectrum of the update before each read (``qk_update_entropy``, ``qk_update_top_share``) as
the spectrum engine logs it: in a plain loop, on the training thread and on the weights' worker,
for multi-head, grouped-query and latent attention, against float64 math on the test's own copies
of the weights before and after the update; undefined (NaN, no warning) on a step that moved
nothing; in the dashboards' layout with the optimizer's view."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.testing import assert_close

from qkmonitor.engine import Monitoring, QKSpectrum
from qkmonitor.measures.layer_spectra import QKWeights
from qkmonitor.output.dashboards import LayoutSection, custom_scalars_layout
from qkmonitor.output.sinks import MemorySink
from tests.core.test_latent import MLA, NOPE, RANK, ROPE, VALUE, H, Model, sharpened
from tests.core.test_update_spectra import metrics_reference, reference

from .test_updates import projections
from .tiny import TOKENS, decoder

NAMES = ("qk_update_entropy", "qk_update_top_share")


def run(model, weights_of, *, lr=0.05, background=False, steps=3, every=2):
    """A plain loop under AdamW; returns the engine, its sink and the expected metrics of the
    read after the last probed update, from ``weights_of(model)`` (per layer (w_q, w_k, H, H_kv))
    copied before and after it."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    engine = QKSpectrum(per_head=True, background_weights=background, update_spectrum=True)
    sink = MemorySink()
    truth = {}
    with Monitoring(model, [engine], writer=sink, every_n_steps=every, optimizer=optimizer) as m:
        for step in range(steps):
            with m.step(step):
                model(TOKENS).logsumexp(-1).mean().backward()
                before = weights_of(model)
                optimizer.step()
                optimizer.zero_grad()
                truth[step + 1] = [
                    metrics_reference(*reference(QKWeights(*b, 1.0), QKWeights(*a, 1.0)))
                    for b, a in zip(before, weights_of(model))
                ]
    return engine, sink, truth


def bundled(model):
    config = model.config
    kv = config.n_kv_heads or config.n_heads
    return [
        (q.detach().clone(), k.detach().clone(), config.n_heads, kv) for q, k in projections(model)
    ]


@pytest.mark.parametrize("background", [False, True], ids=["training thread", "worker"])
@pytest.mark.parametrize("n_kv_heads", [None, 2], ids=["mha", "gqa"])
def test_a_plain_loop_logs_each_heads_update_spectrum_at_its_probes(background, n_kv_heads):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing broken, nothing left out
        engine, sink, truth = run(decoder(n_kv_heads), bundled, background=background)
    assert engine.schedule.latest_step == 2  # read after the update of step 1 (the 2nd)
    for name in NAMES:
        for got, want in zip(engine.latest[name], truth[2], strict=True):
            assert_close(got.double(), want[name], rtol=2e-6, atol=2e-6)
    logged = {(tag, step) for tag, _, step in sink.scalars}
    for name in NAMES:
        for band in ("", "_min", "_max"):
            assert (f"qkmonitor/{name}{band}/layer_01", 2) in logged
        assert (f"qkmonitor/{name}/layer_00_head_03", 2) in logged
    at_zero = [v for tag, v, step in sink.scalars if step == 0 and "qk_update" in tag]
    assert at_zero and all(math.isnan(v) for v in at_zero)  # no update before the initialization


def test_a_step_that_moves_nothing_is_undefined_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # undefined, not broken: no warning at all
        engine, _, _ = run(decoder(2), bundled, lr=0.0)
    assert engine.schedule.latest_step == 2
    for name in NAMES:
        assert all(v.isnan().all() for v in engine.latest[name])
    assert all(v.isfinite().all() for v in engine.latest["kappa"])  # the spectrum is read


def latent_weights(model):
    """Each MLA block's W_Q (H·(d_n + d_r), D) and per-head W_K, from its weights in float64."""
    out = []
    for block in model.blocks:
        g_q = torch.diag(block.part("q_norm").weight.double())
        w_q = block.part("wq_b").weight.double() @ g_q @ block.part("wq_a").weight.double()
        kv_a = block.part("wkv_a").weight.double()
        kv_b = block.part("wkv_b").weight.double().view(H, NOPE + VALUE, RANK)[:, :NOPE]
        k_nope = kv_b @ torch.diag(block.part("kv_norm").weight.double()) @ kv_a[:RANK]
        w_k = torch.cat([k_nope, kv_a[RANK:].expand(H, ROPE, kv_a.shape[1])], 1).flatten(0, 1)
        out.append((w_q.detach(), w_k.detach(), H, H))
    return out


def test_latent_attention_updates_its_products():
    """MLA: W_Q and W_K are products of the projections and the norms' weights; the update is
    theirs (every factor moved by the step)."""
    torch.manual_seed(0)
    model = sharpened(Model(MLA(), MLA()))
    engine, _, truth = run(model, latent_weights, lr=0.01)
    for name in NAMES:
        for got, want in zip(engine.latest[name], truth[2], strict=True):
            assert_close(got.double(), want[name], rtol=1e-5, atol=1e-5)
            assert got.isfinite().all()


def test_the_dashboards_chart_them_with_the_optimizers_view():
    names = QKSpectrum(update_spectrum=True).metric_names  # what a layout is made of
    layout = custom_scalars_layout([LayoutSection("qkmonitor", names, 2)])
    charts = layout["qkmonitor: optimizer's view"]
    assert [c for c in charts if "qk_update" in c] == [
        "qk_update_entropy (a line per layer)",
        "qk_update_top_share (a line per layer)",
    ]


def test_off_by_default_it_logs_nothing_of_it_and_copies_no_weights():
    model = decoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    engine, sink = QKSpectrum(per_head=True), MemorySink()
    copies = []
    with Monitoring(model, [engine], writer=sink, every_n_steps=2, optimizer=optimizer) as m:
        for step in range(3):
            with m.step(step):
                model(TOKENS).logsumexp(-1).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                copies.append(list(engine._weights_before))  # taken before the update, if at all
    assert not engine.update_spectrum and not any(copies)
    assert not set(NAMES) & set(engine.metric_names) and not set(NAMES) & set(engine.latest)
    assert not [tag for tag, _, _ in sink.scalars if "qk_update" in tag]
    assert [tag for tag, _, _ in sink.scalars if "q_update_ratio" in tag]  # the rest is there
    with pytest.raises(ValueError, match="Expected `update_spectrum` to be a bool"):
        QKSpectrum(update_spectrum="yes")

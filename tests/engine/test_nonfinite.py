"""Honest NaNs: undefined-by-definition values are documented, broken ones warned layer by layer."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from qkmonitor.engine import Monitoring, QKSpectrum
from qkmonitor.output.sinks import MemorySink


class TwoLayers(nn.Module):
    def __init__(self, kdim: int | None = None) -> None:
        super().__init__()
        self.first = nn.MultiheadAttention(8, 2, kdim=kdim, vdim=kdim, batch_first=True)
        self.second = nn.MultiheadAttention(8, 2, batch_first=True)


def spectrum_warnings(model, steps_and_edits) -> list[str]:
    monitoring = Monitoring(model, [QKSpectrum(every_n_steps=1, alerts=[])], writer=MemorySink())
    caught_all = []
    for step, edit in steps_and_edits:
        edit(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with monitoring.step(step):
                pass
        caught_all += [str(w.message) for w in caught if "non-finite" in str(w.message)]
    return caught_all


def nothing(model):
    pass


def test_undefined_by_definition_is_nan_without_a_warning_and_a_real_nan_still_warns():
    torch.manual_seed(0)
    model = TwoLayers(kdim=6)  # W_QK of the first layer is 8 x 6: no eigenvalues

    def zero_query(model):  # a zero-initialised W_Q (muP): kappa is 0/0
        with torch.no_grad():
            model.second.in_proj_weight[:8] = 0

    def poison(model):
        with torch.no_grad():
            model.second.in_proj_weight[8, 0] = float("nan")

    got = spectrum_warnings(model, [(0, nothing), (1, zero_query), (2, poison)])
    assert len(got) == 1, got  # only the broken weight
    assert "at step 2 in layer 1 (second)" in got[0]


def test_each_newly_broken_layer_warns_once_more():
    torch.manual_seed(0)
    model = TwoLayers()

    def poison(name):
        def edit(model):
            with torch.no_grad():
                getattr(model, name).in_proj_weight[0, 0] = float("nan")

        return edit

    got = spectrum_warnings(
        model, [(0, poison("first")), (1, nothing), (2, poison("second")), (3, nothing)]
    )
    assert len(got) == 2
    assert "at step 0 in layer 0 (first): kappa heads [0]" in got[0] and "layer 1" not in got[0]
    assert "at step 2 in layer 1 (second)" in got[1]


def test_nan_never_fires_an_alert():
    from qkmonitor.alerts import KAPPA_RULE

    model = TwoLayers()
    with torch.no_grad():
        model.first.in_proj_weight.fill_(float("nan"))
    level = KAPPA_RULE.replace(
        threshold=0.0, patience=1, growth=None, window=None, grace_steps=0, also=()
    )  # kappa >= 0
    monitoring = Monitoring(model, [QKSpectrum(every_n_steps=1, alerts=[level])])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with monitoring.step(0):
            pass
    (engine,) = monitoring.engines
    assert math.isnan(engine.latest["kappa"][0][0].item())
    assert (
        engine.alerting.tracker.counts["kappa"] == 2
    )  # the second layer's two heads (kappa >= 0), not the NaN ones


def test_scalars_of_infinite_and_nan_heads_are_what_torch_gives():
    """The layer mean and band are computed from one read of each tensor; with ±inf and NaN heads
    they agree with torch's mean, min and max (a NaN head makes all three NaN)."""
    engine = QKSpectrum(per_head=True)
    layers = [
        torch.tensor([1.0, float("inf"), 2.0]),
        torch.tensor([float("inf"), float("-inf"), 0.0]),
        torch.tensor([float("nan"), 1.0, 3.0]),
        torch.tensor([0.25, 0.5, 1.0]),
    ]
    out = engine.publishing.scalars({"kappa": layers}, "p")
    for i, heads in enumerate(layers):
        nan = bool(heads.isnan().any())
        for kind, expected in (("", heads.mean()), ("_min", heads.min()), ("_max", heads.max())):
            got = out[f"p/kappa{kind}/layer_{i:02d}"]
            want = math.nan if nan else expected.item()
            assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want), (
                i,
                kind,
                got,
                want,
            )
        assert [out[f"p/kappa/layer_{i:02d}_head_{h:02d}"] for h in range(3)] == pytest.approx(
            heads.tolist(), nan_ok=True
        )

"""MonitorOptions: the engine arguments, checked once, shared by the engines and the callbacks."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
import torch
from torch import nn

from qkmonitor.alerts import KAPPA_RULE
from qkmonitor.callbacks import AttentionEntropyMonitor, EffectiveRankMonitor, QKSpectrumMonitor
from qkmonitor.engine import AttentionEntropy, MonitorOptions, QKSpectrum
from qkmonitor.engine.publishing import AttentionPattern
from qkmonitor.output.dashboards import attention_image


@pytest.mark.parametrize("cls", [QKSpectrumMonitor, AttentionEntropyMonitor, EffectiveRankMonitor])
def test_the_callbacks_spell_out_the_options_with_their_defaults(cls):
    params = list(inspect.signature(cls).parameters.values())
    fields = dataclasses.fields(MonitorOptions)
    assert [(p.name, p.default) for p in params[: len(fields)]] == [
        (f.name, f.default) for f in fields
    ]


def test_an_engine_takes_the_options_or_their_fields_not_both():
    options = MonitorOptions(every_n_steps=3, per_head=True, log_key_prefix="enc")
    assert QKSpectrum(options=options).options is options
    assert AttentionEntropy(every_n_steps=3, per_head=True, log_key_prefix="enc").options == options
    with pytest.raises(ValueError, match="Expected `options` to be a MonitorOptions"):
        QKSpectrum(options=options, per_head=False)
    with pytest.raises(ValueError, match="Expected `options` to be a MonitorOptions"):
        QKSpectrum(options={"per_head": True})


def test_the_callbacks_hand_their_arguments_to_the_engine():
    monitor = EffectiveRankMonitor(every_n_steps=7, alert_action="stop", visuals_every_n_probes=0)
    assert monitor.engine.options == MonitorOptions(
        every_n_steps=7, alert_action="stop", visuals_every_n_probes=0
    )
    assert monitor.engine.max_probe_tokens == 128


def test_options_are_frozen_and_keep_rules_and_layer_lists_as_tuples():
    layers = [nn.Linear(2, 2), nn.Linear(2, 2)]
    options = MonitorOptions(alerts=KAPPA_RULE, layers=iter(layers))
    assert options.alerts == (KAPPA_RULE,)
    assert options.layers == tuple(layers)
    assert options.selection() == "Linear,Linear"
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.per_head = True  # type: ignore[misc]


def test_an_attention_pattern_is_drawn_as_the_attention_image():
    probs = torch.softmax(torch.randn(4, 6, generator=torch.Generator().manual_seed(0)), -1)
    drawn = AttentionPattern(probs, title="layer 0, head 1, step 3")()
    assert np.array_equal(drawn, attention_image(probs, title="layer 0, head 1, step 3"))

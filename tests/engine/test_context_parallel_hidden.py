"""EffectiveRank under context parallelism (issue 59, 3): a rank's block output holds its part of
each sequence, whose effective rank and collapse are not the sequence's, so hidden_erank and
hidden_collapse are NaN with one warning a run naming the layers and why, whichever way the split
shows: the layer's attention calls refused for it (their q/k DTensors sharded along the sequence)
or the block output seen split (a DTensor sharded along it, or torch's ``context_parallel`` in
place). One process plays both here, the detections patched in; two gloo ranks under torch's
``context_parallel`` are tests/distributed/test_context_parallel.py's."""

from __future__ import annotations

import warnings

import pytest
import torch

import qkmonitor.engine.rank as rank_engine
from qkmonitor.attention import probes
from qkmonitor.engine import EffectiveRank, Monitoring

from .tiny import TOKENS, decoder

SPLIT = "split across 2 ranks (context parallelism: a DTensor sharded along the sequence dim)"
LAYERS = ["blocks.0.attn", "blocks.1.attn"]


def _probe(monkeypatch, how: str | None) -> tuple[dict, list[str]]:
    """One probed step of the tiny decoder with EffectiveRank; ``how`` the split is seen: by the
    attention calls, by the block outputs, or not at all (None)."""
    if how == "calls":
        reason = f"its keys are {SPLIT}, so a row's softmax is over keys other ranks hold"
        monkeypatch.setattr(probes, "context_parallel_reason", lambda q, k: reason)
    elif how == "blocks":
        monkeypatch.setattr(rank_engine, "sequence_split_reason", lambda x: SPLIT)
    engine, model = EffectiveRank(per_head=True), decoder()
    monitoring = Monitoring(model, [engine], every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            with monitoring.step(step), torch.no_grad():
                model(TOKENS)
        monitoring.close()
    return engine.latest, [str(w.message) for w in caught]


@pytest.mark.parametrize("how", ["calls", "blocks"])
def test_hidden_states_of_part_of_the_sequence_are_refused_by_name(monkeypatch, how):
    whole, _ = _probe(monkeypatch, None)
    for name in ("hidden_erank", "hidden_collapse"):
        assert all(torch.isfinite(t).all() for t in whole[name]), (name, whole[name])
    latest, said = _probe(monkeypatch, how)
    for name in ("hidden_erank", "hidden_collapse"):
        assert all(t.shape == (1,) and torch.isnan(t).all() for t in latest[name]), latest[name]
    hidden = [w for w in said if "hidden_erank" in w]
    assert len(hidden) == 1, hidden  # one warning a run, over both steps
    assert hidden[0].startswith(f"EffectiveRank: layer(s) {LAYERS}: "), hidden[0]
    assert "(context parallelism" in hidden[0] and "hidden_collapse" in hidden[0], hidden[0]
    assert not [w for w in said if "non-finite" in w], said

"""nn.MultiheadAttention's less common shapes, measured against its own attention weights.

``add_bias_kv`` appends a learned key, ``add_zero_attn`` a zero key, and both widen the masks by a
column; unbatched ``(L, E)`` inputs have no batch dimension. The reference is what MHA itself
returns with ``need_weights=True, average_attn_weights=False``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qkmonitor.attention.adapters import find_attention_layers
from qkmonitor.attention.probes import ProbeRequest
from qkmonitor.engine import EffectiveRank, Monitoring

L, E, H = 5, 8, 2


def reference(mha, query, **masks):
    with torch.no_grad():
        _, p = mha(query, query, query, need_weights=True, average_attn_weights=False, **masks)
    p = torch.nan_to_num(
        p.double()
    )  # torch gives NaN for a fully masked row; qkmonitor gives zeros
    if p.dim() == 3:  # unbatched: (H, L, S)
        p = p[None]
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    return entropy, p.amax(-1), p


def measured(mha, query, **masks):
    layer = find_attention_layers(mha)[0]
    probe = layer.open_probe(ProbeRequest(sink_tokens=1, probs_slice=(4, L)))
    with torch.no_grad():
        mha(query, query, query, need_weights=False, **masks)
    result = probe.close()
    assert result.failures == [] and result.calls == 1
    return result.stats[0], result.probs[0]


def causal_mask(kind: str):
    blocked = torch.ones(L, L, dtype=torch.bool).triu(1)
    return blocked if kind == "bool" else torch.zeros(L, L).masked_fill(blocked, float("-inf"))


@pytest.mark.parametrize("bias_kv, zero_attn", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize(
    "masks", ["none", "padding", "causal-bool", "causal-float", "causal+padding"]
)
def test_extra_keys_with_masks_match_mha(bias_kv, zero_attn, masks):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(
        E, H, add_bias_kv=bias_kv, add_zero_attn=zero_attn, batch_first=True
    ).eval()
    x = torch.randn(3, L, E)
    padding = torch.zeros(3, L, dtype=torch.bool)
    padding[1, 3:] = True  # True = ignore
    kwargs = {}
    if "padding" in masks:
        kwargs["key_padding_mask"] = padding
    if "causal" in masks:
        kwargs["attn_mask"] = causal_mask("float" if masks == "causal-float" else "bool")
        if "padding" in masks:
            kwargs["attn_mask"] = causal_mask("bool")
    entropy, max_prob, p = reference(mha, x, **kwargs)
    stats, probs = measured(mha, x, **kwargs)
    keys = L + bias_kv + zero_attn
    assert p.shape[-1] == keys and stats.attended.shape == (3, H, L)
    torch.testing.assert_close(stats.entropy.double(), entropy, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stats.max_prob.double(), max_prob, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stats.sink_mass.double(), p[..., 0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(probs.double(), p, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("masks", ["none", "padding", "causal"])
def test_unbatched_inputs_match_mha(masks):
    torch.manual_seed(1)
    mha = nn.MultiheadAttention(E, H).eval()
    x = torch.randn(L, E)  # (L, E): no batch dimension
    kwargs = {}
    if masks == "padding":
        kwargs["key_padding_mask"] = torch.tensor([False, False, False, True, True])
    if masks == "causal":
        kwargs["attn_mask"] = causal_mask("bool")
    entropy, max_prob, p = reference(mha, x, **kwargs)
    stats, probs = measured(mha, x, **kwargs)
    torch.testing.assert_close(stats.entropy.double(), entropy, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stats.max_prob.double(), max_prob, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(probs.double(), p, rtol=1e-4, atol=1e-5)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(E, H)

    def forward(self, x):
        return x + self.attn(x, x, x, need_weights=False)[0]


def test_unbatched_hidden_ranks_are_measured():
    torch.manual_seed(2)
    model = Block()
    monitoring = Monitoring(model, [EffectiveRank(every_n_steps=1, alerts=[])])
    x = torch.randn(L, E)
    with monitoring.step(0):
        model(x)
    (engine,) = monitoring.engines
    with torch.no_grad():  # the attention module is a child of the model itself: its output is read
        y = model.attn(x, x, x, need_weights=False)[0].double()
    s = torch.linalg.svdvals(y)
    p = s / s.sum()
    erank = torch.exp(-(p * p.log()).sum())
    collapse = torch.linalg.norm(y - y.mean(0)) / torch.linalg.norm(y)
    assert engine.latest["hidden_erank"][0].item() == pytest.approx(erank.item(), rel=1e-4)
    assert engine.latest["hidden_collapse"][0].item() == pytest.approx(collapse.item(), rel=1e-4)

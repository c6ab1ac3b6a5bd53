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
from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring

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


def _encoder() -> nn.TransformerEncoder:
    """A torch encoder whose eval, no-grad forward takes the fused fast path where torch allows."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 16, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


@pytest.mark.parametrize("fails", [False, True], ids=["step", "failing step"])
def test_an_encoder_layers_fast_path_is_held_off_for_a_probe_and_put_back(monkeypatch, fails):
    """Where torch's ``TransformerEncoderLayer`` fast path skips its attention's hooks (before
    torch 2.5), a probe holds ``torch.backends.mha``'s fast path off, so that each layer's
    attention runs and is measured: values equal to a float64 softmax of the layer's own scores.
    Two monitors nest; after the probe, failing or not, the flag is what the user had set."""
    from qkmonitor.attention import multihead

    monkeypatch.setattr(multihead, "_FAST_PATH_SKIPS_HOOKS", True)
    model = _encoder()
    x = torch.randn(2, L, E, generator=torch.Generator().manual_seed(1))
    seen = []  # each layer's input, for the reference
    hooks = [
        m.self_attn.register_forward_pre_hook(lambda m, args: seen.append(args[0].double()))
        for m in model.layers
    ]
    monitors = [Monitoring(model, [AttentionEntropy(every_n_steps=1, alerts=[])]) for _ in range(2)]
    for user_setting in (True, False):
        torch.backends.mha.set_fastpath_enabled(user_setting)
        seen.clear()
        try:
            with monitors[0].step(0), monitors[1].step(0), torch.no_grad():
                assert not torch.backends.mha.get_fastpath_enabled()
                model(x)
                if fails:
                    raise RuntimeError("the user's step failed")
        except RuntimeError:
            assert fails
        assert torch.backends.mha.get_fastpath_enabled() is user_setting
    torch.backends.mha.set_fastpath_enabled(True)
    for hook in hooks:
        hook.remove()
    if fails:
        return
    for monitor in monitors:
        entropies = monitor.engines[0].latest["entropy"]
        assert len(entropies) == len(model.layers)
        for x_layer, layer, got in zip(seen, model.layers, entropies):
            w, b = layer.self_attn.in_proj_weight.double(), layer.self_attn.in_proj_bias.double()
            q = (x_layer @ w[:E].T + b[:E]).unflatten(-1, (H, -1)).transpose(1, 2)
            k = (x_layer @ w[E : 2 * E].T + b[E : 2 * E]).unflatten(-1, (H, -1)).transpose(1, 2)
            p = torch.softmax(q @ k.transpose(-1, -2) / (E // H) ** 0.5, dim=-1)
            want = (-(p * p.log()).sum(-1)).mean(dim=(0, 2))  # each head's mean row entropy
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)

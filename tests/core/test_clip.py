"""QK-Clip's math (qkmonitor.attention.clip): the factors against their definition, and the rescaled
layers' logits measured again on the same batch, biases and RoPE included."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from qkmonitor.attention.adapters import find_attention_layers
from qkmonitor.attention.clip import clip_factors, head_max_logits
from qkmonitor.attention.probes import ProbeRequest
from qkmonitor.models import DecoderLM, TransformerConfig


def test_factors_are_min_one_tau_over_s_and_one_where_s_is_not_finite():
    s = [250.0, 100.0, 99.0, 100.5, -3.0, 0.0, math.nan, math.inf, -math.inf, 1e6]
    tau = 100.0
    expected = [min(1.0, tau / x) if math.isfinite(x) and x > tau else 1.0 for x in s]
    gamma = clip_factors(torch.tensor(s, dtype=torch.float32), tau)
    assert gamma.dtype == torch.float64
    assert gamma.tolist() == pytest.approx(expected, rel=1e-12)
    assert gamma[1].item() == 1.0 and gamma[2].item() == 1.0  # at or below τ: untouched


@pytest.mark.parametrize("tau", [0, -1.0, math.nan, math.inf, True, "100", None])
def test_a_bad_tau_is_named(tau):
    with pytest.raises(ValueError, match="`tau`"):
        clip_factors(torch.ones(2), tau)


def test_head_max_logits_is_the_largest_over_calls_and_batch():
    a = torch.tensor([[1.0, 5.0], [2.0, -math.inf]])  # (B=2, H=2): one call
    b = torch.tensor([[7.0, -math.inf]])  # another call, one sequence
    assert head_max_logits([a, b], 2).tolist() == [7.0, 5.0]
    assert head_max_logits([], 3).tolist() == [-math.inf] * 3
    assert head_max_logits([torch.empty(0, 2)], 2).tolist() == [-math.inf] * 2  # an empty batch
    assert math.isnan(head_max_logits([torch.tensor([[math.nan, 1.0]]), a], 2)[0])


def measured(layer, run) -> torch.Tensor:
    probe = layer.open_probe(ProbeRequest())
    try:
        with torch.no_grad():
            run()
    finally:
        result = probe.close()
    # from the statistics' path, independent of the max-only one the clip reads
    per_call = [stats.max_logit.amax(dim=-1) for stats in result.stats]
    return head_max_logits(per_call, layer.qk_rows().num_heads)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, bias=True, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


def _bundled(**config):
    torch.manual_seed(0)
    model = DecoderLM(
        TransformerConfig(
            vocab_size=20, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, **config
        )
    )
    with torch.no_grad():  # biases and weights large enough for the heads to differ
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(4.0)
                if name.endswith("bias"):
                    p.add_(torch.randn_like(p))
    tokens = torch.randint(0, 20, (3, 12), generator=torch.Generator().manual_seed(1))
    return model, lambda: model(tokens)


def _mha():
    torch.manual_seed(0)
    model = Encoder()
    with torch.no_grad():
        model.attn.in_proj_weight[:32].mul_(5.0)
        model.attn.in_proj_bias.normal_()
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(1))
    return model, lambda: model(x)


def _latent(q_lora_rank):
    """Multi-head latent attention (DeepSeek-V3, the architecture Kimi K2 clips): each head's
    rotary query meets a rotary key shared by every head."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV3Config"):
        pytest.skip(f"DeepSeek-V3: transformers 4.50+ (installed: {transformers.__version__})")
    config = transformers.DeepseekV3Config(
        vocab_size=20,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=12,
        qk_nope_head_dim=6,
        qk_rope_head_dim=4,
        v_head_dim=5,
        max_position_embeddings=16,
        attention_bias=True,
    )
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM._from_config(config, attn_implementation="sdpa")
    attn = model.model.layers[0].self_attn
    with torch.no_grad():  # logits large enough for the heads to differ
        (attn.q_proj if q_lora_rank is None else attn.q_b_proj).weight.mul_(6.0)
        attn.kv_b_proj.weight.mul_(6.0)
        attn.kv_a_proj_with_mqa.weight.mul_(3.0)
    tokens = torch.randint(0, 20, (3, 12), generator=torch.Generator().manual_seed(1))
    return model.eval(), lambda: model(tokens)


CASES = {
    "latent-q-proj": lambda: _latent(None),
    "latent-q-factored": lambda: _latent(8),
    "bundled-mha-bias-rope": lambda: _bundled(bias=True),
    "bundled-gqa-bias-rope": lambda: _bundled(bias=True, n_kv_heads=2),
    "bundled-mqa": lambda: _bundled(n_kv_heads=1, positional="learned"),
    "torch-mha-bias": _mha,
}


@pytest.mark.parametrize("case", list(CASES))
def test_after_the_clip_each_heads_max_logit_is_tau_and_healthy_heads_are_unchanged(case):
    model, run = CASES[case]()
    for layer in find_attention_layers(model):
        s = measured(layer, run)
        tau = float(s.median())  # about half the heads clipped
        gamma = clip_factors(s, tau)
        assert (gamma < 1).any() and (gamma == 1).any()
        layer.qk_rows().scale_logits(gamma)
        s_after = measured(layer, run)
        clipped = gamma < 1
        # a logit is bilinear in the head's (q, k) projections with their biases: scaled by γ
        assert_close(s_after[clipped], torch.full_like(s_after[clipped], tau), rtol=2e-5, atol=0)
        assert torch.equal(
            s_after[~clipped], s[~clipped]
        )  # healthy heads: same logits, bit for bit


def test_latent_attention_clips_its_own_rows_and_never_the_shared_rotary_key():
    """Kimi K2's split: q_C and k_C by √γ, the head's rotary query by γ, the shared rotary key
    (kv_a_proj_with_mqa's last rows) and the latent untouched."""
    model, run = _latent(None)
    attn = model.model.layers[0].self_attn
    (layer,) = find_attention_layers(model)
    before = {name: p.detach().clone() for name, p in attn.named_parameters()}
    s = measured(layer, run)
    gamma = clip_factors(s, float(s.median()))
    layer.qk_rows().scale_logits(gamma)
    after = dict(attn.named_parameters())
    for name in ("kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias", "o_proj.weight"):
        assert torch.equal(after[name], before[name]), name
    nope, rope, value = 6, 4, 5
    q = after["q_proj.weight"].view(4, nope + rope, -1)
    q0 = before["q_proj.weight"].view(4, nope + rope, -1)
    kv = after["kv_b_proj.weight"].view(4, nope + value, -1)
    kv0 = before["kv_b_proj.weight"].view(4, nope + value, -1)
    g = gamma.float()[:, None, None]
    assert_close(q[:, :nope], q0[:, :nope] * g.sqrt())
    assert_close(q[:, nope:], q0[:, nope:] * g)
    assert_close(kv[:, :nope], kv0[:, :nope] * g.sqrt())
    assert torch.equal(kv[:, nope:], kv0[:, nope:])  # the values

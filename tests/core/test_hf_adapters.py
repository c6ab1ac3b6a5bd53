"""Hugging Face attention (LLaMA-family, GPT-2, BERT) through qkmonitor.attention.hf, on tiny random
models.

The reference for the probed statistics is the model's own ``output_attentions=True`` attention
weights under ``attn_implementation="eager"``; the reference for the weights is the dense float64
W_QK built from the modules' own parameters (the Conv1D read as it is stored, for GPT-2).
"""

from __future__ import annotations

import copy
import math
import subprocess
import sys
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger
from packaging.version import Version
from torch import nn
from torch.testing import assert_close

from qkmonitor.attention import calls, hf, hf_layers
from qkmonitor.attention.adapters import find_attention_layers
from qkmonitor.attention.probes import ProbeRequest
from qkmonitor.callbacks import AttentionEntropyMonitor, QKSpectrumMonitor
from qkmonitor.engine import Monitoring, QKSpectrum
from qkmonitor.measures.spectra import qk_singular_values, spectral_concentration
from qkmonitor.output.sinks import MemorySink

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 40, 7
TRANSFORMERS = Version(transformers.__version__)
# BertSelfAttention calls its attention through ALL_ATTENTION_FUNCTIONS from 5.0; before, nothing to
# route
BERT_DISPATCHES = TRANSFORMERS >= Version("5.0")
NEEDS_BERT_DISPATCH = pytest.mark.skipif(
    not BERT_DISPATCHES,
    reason=f"BERT attention dispatches from transformers 5.0, this is {TRANSFORMERS}",
)


def llama_config(**kw):
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **kw,
    )


def gpt2_config(**kw):
    return transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_head=4,
        n_layer=2,
        n_positions=64,
        bos_token_id=1,
        eos_token_id=2,
        **kw,
    )


def bert_config(**kw):
    return transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=0,
        **kw,
    )


FAMILIES = {  # config, model class, layer names, the class the layers are labelled with
    "llama": (llama_config, "LlamaForCausalLM", "model.layers.{}.self_attn", "LlamaAttention"),
    "gpt2": (gpt2_config, "GPT2LMHeadModel", "transformer.h.{}.attn", "GPT2Attention"),
    "bert": (bert_config, "BertModel", "encoder.layer.{}.attention.self", "BertSelfAttention"),
}
# the families whose attention statistics this transformers gives
WITH_STATS = ["llama", "gpt2", pytest.param("bert", marks=NEEDS_BERT_DISPATCH)]


def build(family: str, attn: str = "sdpa", seed: int = 0, **config_kw) -> nn.Module:
    make_config, cls, _, _ = FAMILIES[family]
    torch.manual_seed(seed)
    return (
        getattr(transformers, cls)
        ._from_config(make_config(**config_kw), attn_implementation=attn)
        .eval()
    )


def eager_twin(model: nn.Module) -> nn.Module:
    """The same weights under eager attention: the independent reference."""
    twin = type(model)._from_config(copy.deepcopy(model.config), attn_implementation="eager").eval()
    twin.load_state_dict(model.state_dict())
    return twin


def batch(padded: bool, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, SEQ), generator=g)
    if not padded:
        return ids, None
    mask = torch.ones(3, SEQ, dtype=torch.long)
    mask[1, 5:], mask[2, 3:] = 0, 0  # right padding
    return ids, mask


def logits_of(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def probed(layers, fn, probs_slice=None):
    probes = [layer.open_probe(ProbeRequest(probs_slice=probs_slice)) for layer in layers]
    try:
        result = fn()
    finally:
        results = [probe.close() for probe in probes]
    last = lambda items: items[-1] if items else None
    return result, [last(r.stats) for r in results], [last(r.probs) for r in results]


def dense_kappa(
    w_q_heads: list[torch.Tensor], w_k_heads: list[torch.Tensor], num_kv_heads: int
) -> torch.Tensor:
    """kappa per head from the d x d W_QK^h = W_Q^h (W_K^g)^T, float64 SVD; inputs are (d, d_k)."""
    group = len(w_q_heads) // num_kv_heads
    out = []
    for h, w_q in enumerate(w_q_heads):
        s = torch.linalg.svdvals(w_q.double() @ w_k_heads[h // group].double().T)
        out.append(s[0] / s.sum())
    return torch.stack(out)


# --- discovery and weights ---------------------------------------------------------------------


@pytest.mark.parametrize("family", WITH_STATS)
def test_layers_are_found_in_order_with_their_kind(family):
    model = build(family)
    found = find_attention_layers(model)
    _, _, pattern, kind = FAMILIES[family]
    assert [f.name for f in found] == [pattern.format(i) for i in range(2)]
    assert [f.index for f in found] == [0, 1]
    assert all(f.kind == f"transformers.{kind}" and f.supports_stats for f in found)


@pytest.mark.parametrize(
    ("config", "cls"),
    [("MistralConfig", "MistralForCausalLM"), ("Qwen2Config", "Qwen2ForCausalLM")],
)
def test_llama_family_is_recognised_by_structure(config, cls):
    cfg = getattr(transformers, config)(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
    )
    model = getattr(transformers, cls)(cfg)
    found = find_attention_layers(model)
    # labelled by their own class, read as the LLaMA family
    assert [f.kind for f in found] == [
        f"transformers.{cls.replace('ForCausalLM', 'Attention')}"
    ] * 2
    assert all(isinstance(f, hf_layers.LlamaAttentionLayer) for f in found)
    w = found[1].qk_weights()
    assert (w.num_heads, w.num_kv_heads, tuple(w.w_k.shape)) == (4, 1, (8, 32))


def test_llama_gqa_weights_are_the_projections_and_kappa_matches_dense_svd():
    model = build("llama")
    for layer, block in zip(find_attention_layers(model), model.model.layers):
        w = layer.qk_weights()
        attn = block.self_attn
        assert w.w_q is attn.q_proj.weight and w.w_k is attn.k_proj.weight
        assert (w.num_heads, w.num_kv_heads) == (4, 2)
        assert w.scale == pytest.approx(1 / math.sqrt(8)) and w.scale == pytest.approx(attn.scaling)
        heads = [attn.q_proj.weight[h * 8 : (h + 1) * 8].T for h in range(4)]
        kv = [attn.k_proj.weight[g * 8 : (g + 1) * 8].T for g in range(2)]
        kappa = spectral_concentration(
            qk_singular_values(w.w_q, w.w_k, w.num_heads, w.num_kv_heads)
        )
        assert_close(kappa.double(), dense_kappa(heads, kv, 2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("inverse_layer_idx", [False, True])
def test_gpt2_conv1d_is_read_transposed_and_the_scale_follows_the_config(inverse_layer_idx):
    model = build("gpt2", scale_attn_by_inverse_layer_idx=inverse_layer_idx)
    for i, (layer, block) in enumerate(zip(find_attention_layers(model), model.transformer.h)):
        w = layer.qk_weights()
        conv = block.attn.c_attn.weight  # (in, 3 * embed): input features along dim 0
        assert_close(w.w_q, conv[:, :32].T, rtol=0, atol=0)
        assert_close(w.w_k, conv[:, 32:64].T, rtol=0, atol=0)
        assert (w.num_heads, w.num_kv_heads) == (4, 4)
        expected = 1 / math.sqrt(8) / (i + 1 if inverse_layer_idx else 1)
        assert w.scale == pytest.approx(expected)
        # W_Q^h is the Conv1D's own column block, no transposition involved
        heads = [conv[:, h * 8 : (h + 1) * 8] for h in range(4)]
        keys = [conv[:, 32 + h * 8 : 32 + (h + 1) * 8] for h in range(4)]
        kappa = spectral_concentration(qk_singular_values(w.w_q, w.w_k, 4, 4))
        assert_close(kappa.double(), dense_kappa(heads, keys, 4), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(
    TRANSFORMERS < Version("5.4"),
    reason=f"GPT2Attention.scaling exists from transformers 5.4, this is {TRANSFORMERS}",
)
@pytest.mark.parametrize("inverse_layer_idx", [False, True])
def test_gpt2_scale_is_the_modules_own_scaling(inverse_layer_idx):
    model = build("gpt2", scale_attn_by_inverse_layer_idx=inverse_layer_idx)
    for layer, block in zip(find_attention_layers(model), model.transformer.h):
        assert layer.qk_weights().scale == pytest.approx(block.attn.scaling)


@NEEDS_BERT_DISPATCH  # before, its layout is checked at the first probe (the test below)
def test_bert_weights_are_query_and_key():
    model = build("bert")
    for layer, block in zip(find_attention_layers(model), model.encoder.layer):
        w = layer.qk_weights()
        attn = block.attention.self
        assert w.w_q is attn.query.weight and w.w_k is attn.key.weight
        assert (w.num_heads, w.num_kv_heads, w.scale) == (4, 4, pytest.approx(1 / math.sqrt(8)))
        heads = [attn.query.weight[h * 8 : (h + 1) * 8].T for h in range(4)]
        keys = [attn.key.weight[h * 8 : (h + 1) * 8].T for h in range(4)]
        kappa = spectral_concentration(qk_singular_values(w.w_q, w.w_k, 4, 4))
        assert_close(kappa.double(), dense_kappa(heads, keys, 4), rtol=1e-5, atol=1e-6)


# --- activation statistics ---------------------------------------------------------------------


def assert_stats_match_eager_weights(stats, probs, attentions, probs_slice, dead_rows: int = 0):
    """Compare with eager's weights on the rows that may attend some key.

    A row with no key left (``dead_rows`` of them) is uniform in eager's weights but, by
    qkmonitor's convention, has zero statistics and ``attended = 0`` and is left out of aggregates.
    """
    s, r = probs_slice
    for st, pr, a in zip(stats, probs, attentions, strict=True):
        a = a.double()
        live = st.attended > 0
        assert int((~live).sum()) == dead_rows
        assert not st.entropy[~live].any() and not st.max_prob[~live].any()
        entropy = -(a * a.clamp_min(1e-300).log()).sum(-1)
        assert_close(st.entropy.double()[live], entropy[live], rtol=1e-5, atol=2e-6)
        assert_close(st.max_prob.double()[live], a.amax(-1)[live], rtol=1e-5, atol=1e-6)
        assert_close(st.attended.double()[live], (a > 0).sum(-1).double()[live], rtol=0, atol=0)
        assert st.entropy.dtype == torch.float32 and not st.entropy.requires_grad
        rows = live[:s, :, :r]
        assert_close(pr.double()[rows], a[:s, :, :r][rows], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("padded", [True, False], ids=["padding", "no_mask"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", WITH_STATS)
def test_probed_statistics_equal_the_eager_attention_weights(family, attn, padded):
    model = build(family, attn)
    ids, mask = batch(padded)
    layers = find_attention_layers(model)
    config = model.config
    before = logits_of(model, ids, mask)
    after, stats, probs = probed(layers, lambda: logits_of(model, ids, mask), probs_slice=(2, 4))
    assert torch.equal(before, after)  # bit-identical
    assert model.config is config and config._attn_implementation == attn
    assert all(layer.module.config is config for layer in layers)
    attentions = eager_twin(model)(
        input_ids=ids, attention_mask=mask, output_attentions=True
    ).attentions
    assert_stats_match_eager_weights(stats, probs, attentions, (2, 4))
    if family != "bert":  # causal: row i attends i + 1 keys (fewer where padded)
        n_allowed = torch.arange(1, SEQ + 1).double()
        if mask is not None:
            n_allowed = torch.minimum(n_allowed, mask.sum(-1, keepdim=True).double())
        assert_close(stats[0].attended[:, 0].double(), n_allowed.expand(3, SEQ), rtol=0, atol=0)


def test_a_custom_4d_mask_with_a_bias_goes_through_explicit_scores():
    model = build("llama", "sdpa")
    ids, _ = batch(False)
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(3, 1, SEQ, SEQ, generator=g)
    mask = bias.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
    mask[1, :, :, 0] = float("-inf")  # one sequence never attends its first key
    mask[1, :, 0, 0] = 0.0
    layers = find_attention_layers(model)
    before = logits_of(model, ids, mask)
    after, stats, probs = probed(layers, lambda: logits_of(model, ids, mask), probs_slice=(3, SEQ))
    assert torch.equal(before, after)
    attentions = eager_twin(model)(
        input_ids=ids, attention_mask=mask, output_attentions=True
    ).attentions
    assert_stats_match_eager_weights(stats, probs, attentions, (3, SEQ))


def test_gemma2_softcap_and_sliding_window_go_through_explicit_scores():
    config = transformers.Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=3,
        attn_logit_softcapping=2.0,
        query_pre_attn_scalar=16,
        pad_token_id=0,
        use_cache=False,
    )  # 4.48: a HybridCache shorter than the input fails
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM._from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for block in model.model.layers:
            block.self_attn.q_proj.weight.mul_(300.0)  # logits well past the softcap
    ids, mask = batch(True)
    layers = find_attention_layers(model)
    assert [f.kind for f in layers] == ["transformers.Gemma2Attention"] * 2
    before = logits_of(model, ids, mask)
    after, stats, probs = probed(layers, lambda: logits_of(model, ids, mask), probs_slice=(3, SEQ))
    assert torch.equal(before, after)
    assert stats[0].max_logit.max() > 1.5  # the cap bites (max 2)
    attentions = eager_twin(model)(
        input_ids=ids, attention_mask=mask, output_attentions=True
    ).attentions
    # layer 0 slides (window 3): in the third sequence, query rows 5 and 6 see only padding
    assert_stats_match_eager_weights(
        stats[:1], probs[:1], attentions[:1], (3, SEQ), dead_rows=2 * 4
    )
    assert_stats_match_eager_weights(stats[1:], probs[1:], attentions[1:], (3, SEQ))


def test_dropout_draws_are_unchanged_by_probing():
    model = build("gpt2", "eager", attn_pdrop=0.3, resid_pdrop=0.3, embd_pdrop=0.3).train()
    ids, mask = batch(True)
    layers = find_attention_layers(model)
    torch.manual_seed(5)
    before = logits_of(model, ids, mask)
    torch.manual_seed(5)
    after, stats, _ = probed(layers, lambda: logits_of(model, ids, mask))
    assert torch.equal(before, after)
    assert all(s is not None for s in stats)


def test_gpt2_reordered_upcast_attention_is_probed_where_it_skips_the_dispatch():
    model = build("gpt2", "eager", reorder_and_upcast_attn=True)
    ids, mask = batch(True)
    layers = find_attention_layers(model)
    before = logits_of(model, ids, mask)
    after, stats, probs = probed(layers, lambda: logits_of(model, ids, mask), probs_slice=(1, 3))
    assert torch.equal(before, after)
    assert all("_upcast_and_reordered_attn" not in layer.module.__dict__ for layer in layers)
    attentions = eager_twin(model)(
        input_ids=ids, attention_mask=mask, output_attentions=True
    ).attentions
    assert_stats_match_eager_weights(stats, probs, attentions, (1, 3))


def test_two_monitors_probing_one_module_both_get_statistics_and_the_config_comes_back():
    model = build("llama")
    ids, mask = batch(True)
    first, second = find_attention_layers(model), find_attention_layers(model)
    config = model.config
    first_probes = [layer.open_probe() for layer in first]
    second_probes = [layer.open_probe() for layer in second]
    logits_of(model, ids, mask)
    first_results = [probe.close() for probe in first_probes]  # the other monitor keeps probing
    assert second[0].module.config is not config
    logits_of(model, ids, mask)
    second_results = [probe.close() for probe in second_probes]
    assert [r.calls for r in first_results] == [1] * len(first)
    assert [r.calls for r in second_results] == [2] * len(second)
    assert all(len(r.stats) == 2 for r in second_results)
    assert all(layer.module.config is config for layer in first)
    assert all("_qkmonitor_route" not in layer.module.__dict__ for layer in first)
    assert config._attn_implementation == "sdpa"


def test_a_metric_failure_is_recorded_and_leaves_the_forward_alone(monkeypatch):
    model = build("llama")
    ids, mask = batch(True)
    layers = find_attention_layers(model)
    before = logits_of(model, ids, mask)

    def broken(self, sink_tokens=0):
        raise RuntimeError("boom")

    monkeypatch.setattr(calls.MaskedCall, "stats", broken)
    probes = [layer.open_probe() for layer in layers]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the probe itself does not warn: the monitor does, once
        after = logits_of(model, ids, mask)
    results = [probe.close() for probe in probes]
    assert torch.equal(before, after)
    assert [(r.calls, r.stats, r.failures) for r in results] == [
        (1, [], ["RuntimeError: boom"])
    ] * 2


def test_flash_attention_calls_apply_padding_causality_and_the_sliding_window():
    attn = build("llama").model.layers[0].self_attn
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    padding = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    call = calls.MaskedCall.of(
        attn, q, k, padding, {"sliding_window": 3}, "flash_attention_2", scale=0.5
    )
    stats = call.stats()
    i, j = torch.arange(6)[:, None], torch.arange(6)
    allowed = (j <= i) & (i - j < 3) & padding.bool()[:, None, None, :]
    scores = (q.double() @ k.double().repeat_interleave(2, dim=1).transpose(-1, -2)) * 0.5
    p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    assert_close(stats.entropy.double(), entropy, rtol=1e-5, atol=1e-6)
    assert_close(
        stats.attended.double(), allowed.expand(2, 4, 6, 6).sum(-1).double(), rtol=0, atol=0
    )


# --- transformers versions (qkmonitor.attention._hf_compat)
# ----------------------------------------------


@pytest.mark.skipif(
    BERT_DISPATCHES, reason=f"transformers {TRANSFORMERS}: BERT attention dispatches (from 5.0)"
)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_bert_before_transformers_5_is_read_by_intercepting_its_own_attention(attn):
    """Before 5.0 BERT computes its attention in its own forward (nothing to route): the generic
    family intercepts that computation, and the statistics equal the eager attention weights."""
    from qkmonitor.attention.intercept import InterceptedAttentionLayer

    model = build("bert", attn)
    ids, mask = batch(True)
    layers = find_attention_layers(model)
    assert all(isinstance(layer, InterceptedAttentionLayer) for layer in layers)
    assert all(layer.supports_stats for layer in layers)
    before = logits_of(model, ids, mask)
    after, stats, probs = probed(layers, lambda: logits_of(model, ids, mask), probs_slice=(2, 4))
    assert torch.equal(before, after)
    attentions = eager_twin(model)(
        input_ids=ids, attention_mask=mask, output_attentions=True
    ).attentions
    assert_stats_match_eager_weights(stats, probs, attentions, (2, 4))
    # the weights, read by name and checked against the forward: query and key
    spectrum = QKSpectrum(per_head=True)
    monitoring = Monitoring(model, [spectrum], writer=MemorySink(), every_n_steps=1)
    with monitoring.step(0):
        logits_of(model, ids, mask)
    monitoring.close()
    for i, block in enumerate(model.encoder.layer):
        attn = block.attention.self
        heads = [attn.query.weight[h * 8 : (h + 1) * 8].T for h in range(4)]
        keys = [attn.key.weight[h * 8 : (h + 1) * 8].T for h in range(4)]
        expected = dense_kappa(heads, keys, 4)
        assert_close(spectrum.latest["kappa"][i].double(), expected, rtol=1e-5, atol=1e-6)


class _OwnAttention(transformers.models.llama.modeling_llama.LlamaAttention):
    """A user's subclass that computes attention itself (here: none at all), in its own module."""

    def forward(self, hidden_states, *args, **kwargs):
        return self.o_proj(hidden_states), None


class _WrappedAttention(transformers.models.llama.modeling_llama.LlamaAttention):
    """A user's subclass, in its own module, that keeps the dispatch through ``super().forward``."""

    def forward(self, *args, **kwargs):
        self.calls = getattr(self, "calls", 0) + 1
        return super().forward(*args, **kwargs)


def test_a_subclass_computing_attention_itself_warns_instead_of_silently_giving_nothing():
    model = build("llama")
    model.model.layers[1].self_attn.__class__ = _OwnAttention
    layers = find_attention_layers(model)
    ids, mask = batch(True)
    assert layers[0].supports_stats
    warning = (
        r"no attention statistics for 'model\.layers\.1\.self_attn' "
        rf"\(transformers {transformers.__version__}: _OwnAttention computes"
    )
    with pytest.warns(RuntimeWarning, match=warning):
        assert not layers[1].supports_stats
    before = logits_of(model, ids, mask)
    from qkmonitor.engine import AttentionEntropy, Monitoring

    with pytest.warns(RuntimeWarning, match=warning):  # the monitor measures the other layers
        monitoring = Monitoring(model, [AttentionEntropy(every_n_steps=1)])
    with monitoring.step(0):
        after = logits_of(model, ids, mask)
    assert torch.equal(before, after)
    entropy = monitoring.engines[0].latest["entropy"]
    assert torch.isfinite(entropy[0]).all() and torch.isnan(entropy[1]).all()


def test_a_subclass_calling_super_forward_is_still_probed():
    model = build("llama")
    for block in model.model.layers:
        block.self_attn.__class__ = _WrappedAttention
    ids, mask = batch(True)
    layers = find_attention_layers(model)
    assert all(layer.supports_stats for layer in layers)
    before = logits_of(model, ids, mask)
    after, stats, _ = probed(layers, lambda: logits_of(model, ids, mask))
    assert torch.equal(before, after)
    attentions = eager_twin(model)(
        input_ids=ids, attention_mask=mask, output_attentions=True
    ).attentions
    for st, a in zip(stats, attentions, strict=True):
        entropy = -(a.double() * a.double().clamp_min(1e-300).log()).sum(-1)
        assert_close(st.entropy.double(), entropy, rtol=1e-5, atol=2e-6)
    assert all(block.self_attn.calls == 2 for block in model.model.layers)


def test_a_call_without_scaling_is_measured_at_the_scale_sdpa_applies():
    # GPT-2 before 5.4 passes no `scaling`: SDPA then scales by 1/sqrt(head_dim) whatever the
    # config says, while GPT-2's own eager function follows scale_attn_by_inverse_layer_idx
    attn = build("gpt2", scale_attn_by_inverse_layer_idx=True).transformer.h[1].attn
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 4, 3, 8, generator=g)
    assert hf._hf_compat.as_applied(attn, q, k, None, {}, "sdpa")[1]["scaling"] == pytest.approx(
        8**-0.5
    )
    assert (
        hf._hf_compat.as_applied(attn, q, k, None, {"scaling": 0.25}, "sdpa")[1]["scaling"] == 0.25
    )
    assert "scaling" not in hf._hf_compat.as_applied(attn, q, k, None, {}, "eager")[1]


# --- wiring ------------------------------------------------------------------------------------


def test_without_transformers_nothing_hf_is_looked_for(monkeypatch):
    from qkmonitor.attention.intercept import InterceptedAttentionLayer

    model = build("llama")
    monkeypatch.setitem(sys.modules, "transformers", None)
    # the Hugging Face family is not asked; the generic one still reads `LlamaAttention` by its
    # names
    layers = find_attention_layers(model)
    assert layers and all(type(layer) is InterceptedAttentionLayer for layer in layers)
    with pytest.raises(ValueError, match="No attention layers found in Linear: looked for .*hf"):
        find_attention_layers(nn.Linear(2, 2))


def test_qkmonitor_imports_without_transformers():
    # torchmetrics imports transformers when it is installed, so it is loaded first; then
    # transformers is made unimportable before anything of qkmonitor is imported.
    code = (
        "import sys, torchmetrics, lightning.pytorch\nfor name in [n for n in sys.modules if n == "
        "'transformers' or n.startswith('transformers.')]:\n    del "
        "sys.modules[name]\nsys.modules['transformers'] = None\nimport qkmonitor, "
        "qkmonitor.attention.hf, qkmonitor.callbacks\n"
        "from qkmonitor.attention.adapters import find_attention_layers\nimport "
        "torch\nassert find_attention_layers(torch.nn.MultiheadAttention(8, 2))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


class RecordingLogger(Logger):
    def __init__(self):
        super().__init__()
        self.metrics: dict[str, list[tuple[int, float]]] = {}

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        for key, value in metrics.items():
            self.metrics.setdefault(key, []).append((step, float(value)))


class TinyLlama(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = transformers.LlamaForCausalLM(llama_config())

    def training_step(self, batch, batch_idx):
        ids, mask = batch
        return self.model(
            input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)
        ).loss

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, VOCAB, (16, SEQ), generator=g)
        mask = torch.ones_like(ids)
        mask[::2, 5:] = 0
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, mask), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_lightning_run_on_a_tiny_llama_logs_entropy_and_kappa_for_every_layer(tmp_path):
    module, logger = TinyLlama(), RecordingLogger()
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=3,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[AttentionEntropyMonitor(every_n_steps=1), QKSpectrumMonitor(every_n_steps=1)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        accelerator="cpu",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no metric may have failed
        trainer.fit(module)
    for layer in range(2):
        for metric in ("entropy", "entropy_norm", "max_prob", "kappa"):
            values = logger.metrics[f"qkmonitor/{metric}/layer_{layer:02d}"]
            assert {0, 1, 2} <= {s for s, _ in values}
            assert all(math.isfinite(v) for _, v in values)
        assert all(
            0.0 < v <= 1.0 for _, v in logger.metrics[f"qkmonitor/entropy_norm/layer_{layer:02d}"]
        )
    config = module.model.config
    assert config._attn_implementation == "sdpa"
    assert all(block.self_attn.config is config for block in module.model.model.layers)


@pytest.mark.parametrize(
    ("config", "cls", "kinds"),
    [
        ("BartConfig", "BartForConditionalGeneration", {"Bart": 3}),
        ("MistralConfig", "MistralForCausalLM", {"Mistral": 2}),
        ("GPT2Config", "GPT2LMHeadModel", {"GPT2": 2}),
    ],
)
def test_the_start_up_line_names_each_layers_own_class(config, cls, kinds, caplog):
    """Each layer is labelled by the class the registry found, not by the reading it shares with
    another family (every LLaMA-shaped module was `transformers.llama`)."""
    small = dict(vocab_size=VOCAB, max_position_embeddings=64)
    shapes = {
        "BartConfig": dict(
            d_model=16,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
        ),
        "MistralConfig": dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
        "GPT2Config": dict(n_embd=16, n_layer=2, n_head=2, n_positions=64),
    }[config]
    if config == "GPT2Config":
        small.pop("max_position_embeddings")
    model = getattr(transformers, cls)(getattr(transformers, config)(**small, **shapes))
    with caplog.at_level("INFO", logger="qkmonitor"):
        Monitoring(model, [QKSpectrum()], writer=MemorySink()).close()
    (line,) = [r.getMessage() for r in caplog.records if "measures" in r.getMessage()]
    ((prefix, total),) = kinds.items()
    # the class as the installed release names it (BartSdpaAttention before 5.0)
    (own,) = {type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Attention")}
    assert own.startswith(prefix)
    assert line.endswith(f"measures {total} attention layers: {total} transformers.{own}"), line
    assert "transformers.llama" not in line

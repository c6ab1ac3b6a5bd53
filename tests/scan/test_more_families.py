"""Saved models beyond the first four: a bf16 file (read as bf16, computed in float32), GPT-2's
transposed fused ``c_attn``, T5 (no logit scale), and the float32 staging the scan copies a
layer's bf16 weights into."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from torch.testing import assert_close

import qkmonitor
from qkmonitor.measures.layer_spectra import QKWeights
from qkmonitor.scanning.run import Float32Staging
from tests.scan.conftest import tiny_llama
from tests.scan.test_exact import check, dense_kappa, sharpened

transformers = pytest.importorskip("transformers")


def test_a_bf16_file_is_read_as_bf16_and_equals_a_float64_svd_of_its_values(tmp_path, ids):
    torch.manual_seed(0)
    model = sharpened(tiny_llama()).eval().to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
        stored = handle.get_slice("model.layers.0.self_attn.q_proj.weight").get_dtype()
    assert stored == "BF16"
    refs = [  # the bf16 values, exactly, in float64
        dense_kappa(b.self_attn.q_proj.weight, b.self_attn.k_proj.weight, 8, 2)
        for b in model.model.layers
    ]
    scanned = check(tmp_path, model, refs, ids)
    assert all(layer.metrics["kappa"].dtype == torch.float32 for layer in scanned)


def test_gpt2_transposed_fused_c_attn(tmp_path, ids):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16)
    model = sharpened(transformers.GPT2LMHeadModel(config)).eval()
    model.save_pretrained(tmp_path)
    refs = []
    for block in model.transformer.h:
        w = block.attn.c_attn.weight.T  # Conv1D stores (d, 3d): rows [q | k | v] after .T
        refs.append(dense_kappa(w[:32], w[32:64], 4, 4))
    scanned = check(tmp_path, model, refs, ids)
    assert [layer.name for layer in scanned] == ["transformer.h.0.attn", "transformer.h.1.attn"]


def test_t5_self_and_cross_attention_have_no_logit_scale(tmp_path, ids):
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4
    )
    model = sharpened(transformers.T5ForConditionalGeneration(config)).eval()
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "t5"
    attentions = {
        name: module
        for name, module in model.named_modules()
        if type(module).__name__ == "T5Attention"
    }
    scanned = {layer.name: layer for layer in qkmonitor.scan(tmp_path)}
    assert set(scanned) == set(attentions)  # encoder and decoder self, decoder cross
    for name, attn in attentions.items():
        w_q, w_k = attn.q.weight, attn.k.weight
        assert_close(
            scanned[name].metrics["kappa"].double(),
            dense_kappa(w_q, w_k, 4, 4),
            rtol=1e-5,
            atol=1e-7,
        )
        # scale 1: T5 folds 1/sqrt(d_k) into its weights
        w_qk = w_q.double().view(4, 8, 32).mT @ w_k.double().view(4, 8, 32)
        top = torch.linalg.svdvals(w_qk)[:, 0]
        assert_close(scanned[name].metrics["qk_spectral_norm"].double(), top, rtol=1e-5, atol=0)


def test_the_staging_copies_bf16_exactly_reuses_its_buffers_and_passes_float32_through():
    staging = Float32Staging()
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(16, 8, generator=gen), torch.randn(8, 8, generator=gen)
    big = QKWeights(q.bfloat16(), k.half(), 2, 1, 1.0)
    staged = staging.stage(big)
    assert staged.w_q.dtype == staged.w_k.dtype == torch.float32
    assert torch.equal(staged.w_q, big.w_q.float()) and torch.equal(staged.w_k, big.w_k.float())
    assert (staged.num_heads, staged.num_kv_heads, staged.scale) == (2, 1, 1.0)
    first = staged.w_q.data_ptr()
    small = QKWeights(  # a transposed (non-contiguous) weight, as GPT-2's Conv1D reads
        torch.randn(8, 4, generator=gen).bfloat16().mT, big.w_k, 1, 1, 1.0
    )
    again = staging.stage(small)
    assert again.w_q.data_ptr() == first and again.w_q.shape == (4, 8)  # the same buffer
    assert torch.equal(again.w_q, small.w_q.float())
    plain = QKWeights(torch.randn(4, 8), torch.randn(4, 8, dtype=torch.float64), 1, 1, 1.0)
    passed = staging.stage(plain)
    assert passed.w_q is plain.w_q and passed.w_k is plain.w_k


FALCON_LAYOUTS = {
    "groups": dict(new_decoder_architecture=True, num_kv_heads=2),  # Falcon-40B/180B
    "multi-query": dict(new_decoder_architecture=False, multi_query=True),  # Falcon-7B
    "per-head": dict(new_decoder_architecture=False, multi_query=False),
}


def falcon_rows(weight: torch.Tensor, layout: str, heads: int, kv_heads: int, head_dim: int):
    """(W_Q, W_K) rows of Falcon's fused ``query_key_value`` weight, split as FalconAttention's
    forward splits its output (transformers' modeling_falcon)."""
    d = weight.shape[1]
    if layout == "groups":  # per key/value group: its queries, then its key, then its value
        grouped = weight.view(kv_heads, -1, head_dim, d)
        return grouped[:, :-2].reshape(-1, d), grouped[:, -2].reshape(-1, d)
    if layout == "multi-query":  # all queries, then one key, then one value
        return weight[: heads * head_dim], weight[heads * head_dim : (heads + 1) * head_dim]
    per_head = weight.view(heads, 3, head_dim, d)  # per head [q | k | v]
    return per_head[:, 0].reshape(-1, d), per_head[:, 1].reshape(-1, d)


@pytest.mark.parametrize("layout", list(FALCON_LAYOUTS))
def test_falcon_fused_query_key_value_in_each_of_its_three_orders(tmp_path, ids, layout):
    torch.manual_seed(0)
    config = transformers.FalconConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        **FALCON_LAYOUTS[layout],
    )  # fmt: skip
    model = sharpened(transformers.FalconForCausalLM(config)).eval()
    model.save_pretrained(tmp_path)
    kv_heads = {"groups": 2, "multi-query": 1, "per-head": 4}[layout]
    refs = []
    for block in model.transformer.h:
        w_q, w_k = falcon_rows(block.self_attention.query_key_value.weight, layout, 4, kv_heads, 8)
        refs.append(dense_kappa(w_q, w_k, 4, kv_heads))
    check(tmp_path, model, refs, ids)

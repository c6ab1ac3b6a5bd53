"""κ of a saved model, read from its files, equals a float64 SVD of W_Q^h (W_K^g)^T built from the
model's own tensors and the live QKSpectrum's values on the same weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import qkmonitor
from qkmonitor.engine import Monitoring, QKSpectrum
from qkmonitor.output.sinks import MemorySink
from tests.scan.conftest import tiny_llama

transformers = pytest.importorskip("transformers")


def sharpened(model: nn.Module, seed: int = 2) -> nn.Module:
    """Norm weights away from 1 (so that diag(g) counts in a latent W_QK) and projections large
    enough for the heads to differ."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.copy_(0.5 + 1.5 * torch.rand(p.shape, generator=gen))
            elif p.dim() == 2 and "embed" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
    return model


def dense_kappa(w_q: torch.Tensor, w_k: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """κ per head from the explicit d x d W_QK^h = W_Q^h (W_K^g)^T in float64 (rows as stored)."""
    w_q, w_k = w_q.double(), w_k.double()
    d_k = w_q.shape[0] // heads
    out = []
    for h in range(heads):
        g = h // (heads // kv_heads)
        q_h, k_g = w_q[h * d_k : (h + 1) * d_k], w_k[g * d_k : (g + 1) * d_k]
        s = torch.linalg.svdvals(q_h.T @ k_g)
        out.append(s[0] / s.sum())
    return torch.stack(out)


def live_values(model: nn.Module, inputs: dict) -> dict[str, list[torch.Tensor]]:
    """What the live QKSpectrum logs for ``model``'s weights at step 0 (one forward checks the
    layouts read by name)."""
    spectrum = QKSpectrum(per_head=True)
    monitoring = Monitoring(model, [spectrum], writer=MemorySink(), every_n_steps=1)
    with monitoring.step(0), torch.no_grad():
        model(**inputs)
    monitoring.close()
    return spectrum.latest


def check(path, model, references, ids, rtol=1e-5):
    scanned = qkmonitor.scan(path)
    live = live_values(model, {"input_ids": ids})
    assert len(scanned) == len(references) == len(live["kappa"])
    for layer, reference, kappa, norm in zip(
        scanned, references, live["kappa"], live["qk_spectral_norm"]
    ):
        assert_close(layer.metrics["kappa"].double(), reference, rtol=rtol, atol=1e-7)
        assert_close(layer.metrics["kappa"], kappa, rtol=1e-5, atol=1e-7)
        assert_close(layer.metrics["qk_spectral_norm"], norm, rtol=1e-5, atol=1e-7)
    return scanned


def test_llama_gqa_from_sharded_safetensors(tmp_path, ids):
    torch.manual_seed(0)
    model = sharpened(tiny_llama()).eval()
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    refs = [
        dense_kappa(b.self_attn.q_proj.weight, b.self_attn.k_proj.weight, 8, 2)
        for b in model.model.layers
    ]
    scanned = check(tmp_path, model, refs, ids)
    assert [layer.name for layer in scanned] == [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
    ]


def test_gpt_neox_fused_query_key_value_per_head(tmp_path, ids):
    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
    )
    model = sharpened(transformers.GPTNeoXForCausalLM(config)).eval()
    model.save_pretrained(tmp_path)
    refs = []
    for layer in model.gpt_neox.layers:
        per_head = layer.attention.query_key_value.weight.view(4, 3, 8, 32)
        refs.append(dense_kappa(per_head[:, 0].flatten(0, 1), per_head[:, 1].flatten(0, 1), 4, 4))
    check(tmp_path, model, refs, ids)


def test_phi3_fused_qkv_in_blocks_with_gqa(tmp_path, ids):
    torch.manual_seed(0)
    config = transformers.Phi3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    model = sharpened(transformers.Phi3ForCausalLM(config)).eval()
    model.save_pretrained(tmp_path)
    refs = []
    for layer in model.model.layers:
        w = layer.self_attn.qkv_proj.weight
        refs.append(dense_kappa(w[:32], w[32:48], 4, 2))
    check(tmp_path, model, refs, ids)


def test_bert_from_pytorch_model_bin(tmp_path, ids):
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
    )
    model = sharpened(transformers.BertModel(config)).eval()
    model.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()  # the older format, read with weights_only=True
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    refs = [
        dense_kappa(b.attention.self.query.weight, b.attention.self.key.weight, 4, 4)
        for b in model.encoder.layer
    ]
    check(tmp_path, model, refs, ids)


def latent_reference(attn, heads: int, nope: int, rope: int, value: int, rank: int):
    """κ per head from W_Q and W_K written here from DeepSeek's projections, float64."""
    if attn.q_proj is not None:
        w_q = attn.q_proj.weight.double()
    else:
        g_q = torch.diag(attn.q_a_layernorm.weight.double())
        w_q = attn.q_b_proj.weight.double() @ g_q @ attn.q_a_proj.weight.double()
    kv_a = attn.kv_a_proj_with_mqa.weight.double()
    kv_b = attn.kv_b_proj.weight.double().view(heads, nope + value, rank)[:, :nope]
    k_nope = kv_b @ torch.diag(attn.kv_a_layernorm.weight.double()) @ kv_a[:rank]
    w_k = torch.cat([k_nope, kv_a[rank:].expand(heads, rope, -1)], 1).flatten(0, 1)
    return dense_kappa(w_q, w_k, heads, heads)


@pytest.mark.parametrize("q_lora_rank", [8, None], ids=["factored-query", "one-query"])
def test_deepseek_v3_latent_attention(tmp_path, ids, q_lora_rank):
    if not hasattr(transformers, "DeepseekV3Config"):  # transformers before 4.50 (the minimums)
        pytest.skip(f"transformers {transformers.__version__} has no DeepseekV3Config")
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        first_k_dense_replace=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=12,
        qk_nope_head_dim=6,
        qk_rope_head_dim=4,
        v_head_dim=5,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
    )
    model = sharpened(transformers.DeepseekV3ForCausalLM(config)).eval()
    model.save_pretrained(tmp_path)
    refs = [latent_reference(b.self_attn, 4, 6, 4, 5, 12) for b in model.model.layers]
    check(tmp_path, model, refs, ids)

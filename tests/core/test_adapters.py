"""find_attention_layers on torch's MultiheadAttention, qkmonitor's own modules and user lists."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from qkmonitor.attention.adapters import AttentionLayer, find_attention_layers
from qkmonitor.attention.multihead import MultiheadAttentionLayer
from qkmonitor.attention.native import NativeAttentionLayer
from qkmonitor.measures.layer_spectra import QKWeights
from qkmonitor.models import DecoderLM, TransformerConfig


@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_encoder_layers_are_found_in_order_with_packed_weights(batch_first):
    layer = nn.TransformerEncoderLayer(
        d_model=32, nhead=4, dim_feedforward=64, batch_first=batch_first
    )
    encoder = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
    found = find_attention_layers(encoder)
    assert [f.name for f in found] == [f"layers.{i}.self_attn" for i in range(3)]
    assert [f.index for f in found] == [0, 1, 2]
    assert all(isinstance(f, MultiheadAttentionLayer) for f in found)
    w = found[1].qk_weights()
    packed = encoder.layers[1].self_attn.in_proj_weight
    assert (
        w.w_q is not None and torch.equal(w.w_q, packed[:32]) and torch.equal(w.w_k, packed[32:64])
    )
    assert (w.num_heads, w.num_kv_heads) == (4, 4)
    assert w.scale == pytest.approx(1 / math.sqrt(8))


def test_multihead_attention_with_separate_key_dims_uses_separate_weights():
    mha = nn.MultiheadAttention(embed_dim=16, num_heads=2, kdim=12, vdim=10)
    w = find_attention_layers(mha)[0].qk_weights()
    assert w.w_q is mha.q_proj_weight and w.w_k is mha.k_proj_weight
    assert tuple(w.w_k.shape) == (16, 12)


def test_bundled_decoder_layers_are_native():
    model = DecoderLM(
        TransformerConfig(vocab_size=16, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2)
    )
    found = find_attention_layers(model)
    assert [f.name for f in found] == [f"blocks.{i}.attn" for i in range(3)]
    assert all(isinstance(f, NativeAttentionLayer) for f in found)
    w = found[2].qk_weights()
    assert (
        w.w_q is model.blocks[2].attn.q_proj.weight and w.w_k is model.blocks[2].attn.k_proj.weight
    )
    assert (w.num_heads, w.num_kv_heads, w.scale) == (4, 2, pytest.approx(1 / math.sqrt(8)))


def test_model_without_attention_names_what_was_looked_for():
    with pytest.raises(
        ValueError, match="No attention layers found in Sequential: looked for .*MultiheadAttention"
    ):
        find_attention_layers(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))


def test_user_supplied_layers_list_function_and_custom_adapter():
    encoder = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(16, 2, 32), 2, enable_nested_tensor=False
    )
    only_last = find_attention_layers(encoder, layers=[encoder.layers[1].self_attn])
    assert [(f.index, f.name) for f in only_last] == [(0, "layers.1.self_attn")]
    by_function = find_attention_layers(
        encoder, layers=lambda m: [layer.self_attn for layer in m.layers]
    )
    assert len(by_function) == 2

    class Bilinear(nn.Module):  # a user's own attention, described by a custom adapter
        def __init__(self):
            super().__init__()
            self.wq, self.wk = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)

    class BilinearLayer(AttentionLayer):
        def qk_weights(self) -> QKWeights:
            return QKWeights(self.module.wq.weight, self.module.wk.weight, 2, 2, 0.5)

    custom = Bilinear()
    found = find_attention_layers(custom, layers=[BilinearLayer("mine", custom)])
    assert_close(found[0].qk_weights().w_q, custom.wq.weight)


def test_unsupported_user_module_is_rejected():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(
        ValueError, match=r"`layers\[0\]` \(Linear\) is not a supported attention module"
    ):
        find_attention_layers(model, layers=[model[0]])
    with pytest.raises(ValueError, match="at least one"):
        find_attention_layers(model, layers=[])
    with pytest.raises(ValueError, match="`model` to be a torch.nn.Module"):
        find_attention_layers("not a model")

"""Every bundled model from one TransformerConfig: builds, runs, trains a step, keeps its
promises."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from qkmonitor.attention.adapters import find_attention_layers
from qkmonitor.models import (
    DecoderLM,
    EncoderClassifier,
    EncoderDecoder,
    MultiHeadAttention,
    TransformerConfig,
    VisionEncoder,
)

SMALL = dict(vocab_size=11, d_model=16, n_layers=2, n_heads=4, max_seq_len=12)


def forward_backward(model: nn.Module, *inputs) -> torch.Tensor:
    out = model(*inputs)
    out.float().square().mean().backward()
    assert torch.isfinite(out).all()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    return out


GRID = list(
    itertools.product(
        ["pre", "post"],
        ["layernorm", "rmsnorm"],
        [False, True],
        ["gelu", "swiglu"],
        ["none", "learned", "sinusoidal", "rope", "rope_interleaved"],
        ["standard", "log_n", "polylog"],
    )
)


@pytest.mark.parametrize(("norm_position", "norm", "qk_norm", "mlp", "positional", "scale"), GRID)
def test_every_config_combination_builds_runs_and_backpropagates(
    norm_position, norm, qk_norm, mlp, positional, scale
):
    config = TransformerConfig(
        **SMALL,
        n_kv_heads=2,
        norm_position=norm_position,
        norm=norm,
        qk_norm=qk_norm,
        mlp=mlp,
        positional=positional,
        attention_scale=scale,
        scale_train_len=4,
    )
    torch.manual_seed(0)
    out = forward_backward(DecoderLM(config), torch.randint(11, (2, 9)))
    assert out.shape == (2, 9, 11)


@pytest.mark.parametrize("scaling", ["linear", "ntk", "yarn"])
def test_rope_scalings_run(scaling):
    config = TransformerConfig(**SMALL, rope_scaling=scaling, rope_scaling_factor=2.0)
    forward_backward(DecoderLM(config), torch.randint(11, (2, 12)))


@pytest.mark.parametrize("model_kind", ["decoder", "encoder", "seq2seq", "vision2d", "vision3d"])
def test_each_model_kind_runs_and_every_attention_is_visible_to_the_adapters(model_kind):
    torch.manual_seed(0)
    if model_kind == "decoder":
        model, inputs, n_attn = (
            DecoderLM(TransformerConfig(**SMALL)),
            (torch.randint(11, (2, 7)),),
            2,
        )
    elif model_kind == "encoder":
        model = EncoderClassifier(TransformerConfig(**SMALL, num_classes=3))
        inputs, n_attn = (torch.randint(11, (2, 7)), torch.ones(2, 7, dtype=torch.bool)), 2
    elif model_kind == "seq2seq":
        model = EncoderDecoder(TransformerConfig(**SMALL, n_decoder_layers=3))
        inputs, n_attn = (torch.randint(11, (2, 7)), torch.randint(11, (2, 5))), 2 + 3 * 2
    else:
        grid = (3, 4) if model_kind == "vision2d" else (2, 2, 3)
        positional = "rope_2d" if model_kind == "vision2d" else "rope_3d"
        # 3 axes need a head dim divisible by 3 with an even share each: d_k = 12 -> 4 per axis
        d_model, n_heads = (16, 4) if model_kind == "vision2d" else (24, 2)
        config = TransformerConfig(
            **{**SMALL, "d_model": d_model, "n_heads": n_heads},
            positional=positional,
            grid_size=grid,
            patch_dim=5,
            num_classes=3,
        )
        model, inputs, n_attn = VisionEncoder(config), (torch.randn(2, 12, 5),), 2
    out = forward_backward(model, *inputs)
    layers = find_attention_layers(model)
    assert len(layers) == n_attn
    assert all(
        isinstance(layer.module, MultiHeadAttention) and layer.supports_stats for layer in layers
    )
    if model_kind == "seq2seq":
        assert out.shape == (2, 5, 11)  # one distribution per target position
        assert sum(layer.module.cross for layer in layers) == 3
    elif model_kind != "decoder":
        assert out.shape == (2, 3)


def test_decoder_of_seq2seq_is_causal_and_reads_the_source():
    torch.manual_seed(0)
    model = EncoderDecoder(TransformerConfig(**SMALL)).eval()
    source, target = torch.randint(11, (2, 6)), torch.randint(11, (2, 8))
    changed_target = target.clone()
    changed_target[:, 5:] = (target[:, 5:] + 1) % 11
    with torch.no_grad():
        base = model(source, target)
        torch.testing.assert_close(
            model(source, changed_target)[:, :5], base[:, :5], rtol=1e-5, atol=1e-5
        )
        assert not torch.allclose(
            model((source + 1) % 11, target)[:, 0], base[:, 0]
        )  # cross-attention works


def test_encoder_padding_is_ignored():
    torch.manual_seed(0)
    model = EncoderClassifier(TransformerConfig(**SMALL, num_classes=3)).eval()
    tokens = torch.randint(11, (1, 5))
    padded = torch.cat([tokens, torch.randint(11, (1, 3))], dim=1)
    mask = torch.tensor([[True] * 5 + [False] * 3])
    with torch.no_grad():
        torch.testing.assert_close(model(padded, mask), model(tokens), rtol=1e-5, atol=1e-5)


def test_vision_encoder_with_axial_rope_sees_2d_position():
    """Moving a patch to another cell changes the output only because of the position encoding."""
    torch.manual_seed(0)
    config = TransformerConfig(
        **SMALL, positional="rope_2d", grid_size=(3, 3), patch_dim=4, num_classes=2
    )
    model = VisionEncoder(config).eval()
    patches = torch.zeros(1, 9, 4)
    patches[0, 0] = 1.0
    moved = torch.zeros(1, 9, 4)
    moved[0, 4] = 1.0
    none = VisionEncoder(
        TransformerConfig(
            **{**SMALL, "positional": "none"}, grid_size=(3, 3), patch_dim=4, num_classes=2
        )
    ).eval()
    with torch.no_grad():
        assert not torch.allclose(model(patches), model(moved), atol=1e-6)
        torch.testing.assert_close(
            none(patches), none(moved), rtol=1e-5, atol=1e-5
        )  # permutation invariant


def test_mha_parameter_count_is_four_d_model_squared_plus_biases():
    attn = MultiHeadAttention(
        TransformerConfig(d_model=512, n_heads=8, bias=True, positional="none")
    )
    weights = sum(p.numel() for name, p in attn.named_parameters() if name.endswith("weight"))
    biases = sum(p.numel() for name, p in attn.named_parameters() if name.endswith("bias"))
    qkv = sum(getattr(attn, f"{x}_proj").weight.numel() for x in "qkv")
    assert qkv == 3 * 512 * 512 == 786_432
    assert attn.o_proj.weight.numel() == 262_144
    assert weights == 4 * 512**2 == 1_048_576 and biases == 4 * 512 == 2_048


def test_tied_and_untied_embeddings():
    tied, untied = (
        DecoderLM(TransformerConfig(**SMALL)),
        DecoderLM(TransformerConfig(**SMALL, tie_embeddings=False)),
    )
    assert tied.head.weight is tied.embed.tokens.weight
    assert untied.head.weight is not untied.embed.tokens.weight


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"norm": "batchnorm"}, "`norm` to be one of"),
        ({"norm_position": "middle"}, "`norm_position`"),
        ({"mlp": "relu2"}, "`mlp`"),
        ({"positional": "alibi"}, "`positional` to be one of"),
        ({"attention_scale": "cosine"}, "`attention_scale`"),
        ({"rope_scaling": "dynamic"}, "`rope_scaling`"),
        ({"rope_scaling": "ntk", "rope_scaling_factor": 1.0}, "`rope_scaling_factor` > 1"),
        ({"positional": "rope_2d"}, "`grid_size` with 2 axes"),
        ({"positional": "rope_2d", "grid_size": (2, 2, 2)}, "`grid_size` with 2 axes"),
        ({"n_decoder_layers": 0}, "`n_decoder_layers`"),
        ({"num_classes": -1}, "`num_classes`"),
        ({"d_model": 12, "n_heads": 4}, "even head dim"),
    ],
)
def test_bad_configs_raise_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TransformerConfig(**{**SMALL, **kwargs})


def test_models_missing_their_fields_say_which():
    with pytest.raises(ValueError, match="`num_classes`"):
        EncoderClassifier(TransformerConfig(**SMALL))
    with pytest.raises(ValueError, match="`grid_size`, `patch_dim` and `num_classes`"):
        VisionEncoder(TransformerConfig(**SMALL, num_classes=2))

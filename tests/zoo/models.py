"""The model zoo: tiny third-party (and bundled) transformers, each with its own reading of W_Q and
W_K.

Every entry builds a model from its config with random weights (seeded), sharpens its attention
(the query and key projections multiplied by a factor, so that the heads are not near-uniform),
turns every dropout off, and says, from *this file's* reading of the library's source (never from
qkmonitor):

* ``qk(model)``: for each attention module (qualified name, ``named_modules`` order), the float64
  per-head ``W_Q^h`` and the paired ``W_K^{g(h)}`` as ``(H, d, d_k)`` tensors;
* ``loss(model)``: the loss of one fixed batch;
* ``fail``: the children of an attention module that run before and after its attention kernel
  (where the failure-path test raises).

Layout facts used here (read from the installed sources):

* timm ``Attention``: ``qkv`` Linear rows ``[3, H, d_k]`` (q, k, v blocks); ``num_heads``,
  ``head_dim``, ``scale``; ``fused_attn`` chooses ``F.scaled_dot_product_attention`` or
  ``q*scale @ k^T`` + ``Tensor.softmax(-1)``.
* nanoGPT ``CausalSelfAttention``: ``c_attn`` rows ``[q | k | v]`` each ``[H, d_k]``; ``n_head``,
  ``n_embd``; a ``bias`` *buffer* (the causal tril) on the non-flash path.
* torchtitan ``Attention``: ``wq`` ``[H, d_k]``, ``wk`` ``[H_kv, d_k]``; ``n_heads``,
  ``n_kv_heads``, ``n_rep``, ``head_dim``; key head ``h // n_rep``; complex (interleaved-pair) RoPE.
* litgpt 0.5 ``CausalSelfAttention``: ``qkv`` rows ``[q (H·hs) | k (G·hs) | v (G·hs)]`` (split, not
  the pre-0.5 per-group interleave); sizes on ``attn.config`` (``n_head``, ``n_query_groups``,
  ``head_size``); ``k.repeat_interleave(H // G)``: key head ``h // (H // G)``; SDPA with
  ``is_causal=True`` and ``scale = 1/sqrt(attention_scores_scalar or head_size)``.
* x-transformers ``Attention``: ``to_q`` ``[H, d_h]``, ``to_k`` ``[H_kv, d_h]``; ``heads``,
  ``kv_heads``; ``repeat('b kvh n d -> b (r kvh) n d')``: key head ``h % H_kv``; the kernel runs in
  the child ``attend`` (``Attend``): ``F.softmax`` (float32) over ``einsum`` scores masked with
  ``-finfo.max``, or SDPA with ``attn_flash=True``.
* GPT-NeoX ``query_key_value``: rows ``[H, 3, d_k]`` (per-head q, k, v interleave); no ``num_heads``
  on the module (``config.num_attention_heads``, ``head_size``).
* Phi-3 ``qkv_proj``: rows ``[q (H·d_k) | k (H_kv·d_k) | v]``; key head ``h // groups``.
* T5 ``q``, ``k`` ``[H, d_kv]``; ``n_heads``, ``key_value_proj_dim``; no 1/sqrt(d) (scale 1), the
  relative position bias added to the logits.
* ModernBERT ``Wqkv``: rows ``[3, H, d_k]``; ``head_dim`` only (``config.num_attention_heads``).
* DistilBERT ``q_lin``, ``k_lin``; ``n_heads``, ``dim``, ``attention_head_size``.
* GPT-BigCode multi-query ``c_attn``: rows ``[q (d) | k (d_k) | v (d_k)]``, one key head.
* Falcon ``query_key_value``: multi-query ``[H + 2, d_k]`` (queries, then one k, one v);
  ``new_decoder_architecture`` ``[H_kv, H/H_kv + 2, d_k]`` (each group's queries, its k, its v);
  multi-head (ALiBi) ``[H, 3, d_k]``.
* BLOOM ``query_key_value``: rows ``[H, 3, d_k]``; ALiBi via ``alibi.baddbmm``, always softmax.
* timm Twins: ``LocallyGroupedAttn`` ``qkv`` rows ``[3, H, d_k]``, SDPA (or softmax) on 5-D
  ``(B, windows, H, ws², d_k)`` q/k; ``GlobalSubSampleAttn`` ``q`` rows ``[H, d_k]`` and ``kv`` rows
  ``[2, H, d_k]`` (keys first), its keys from a strided conv of the tokens (``sr_ratio``).
* timm CaiT: ``TalkingHeadAttn`` ``qkv`` rows ``[3, H, d_k]``, q pre-scaled, ``proj_l`` (a Linear
  over the heads) on ``q @ kᵀ`` before the softmax; ``ClassAttn`` ``q``, ``k`` rows ``[H, d_k]``,
  the class token's query alone.
* timm XCiT: ``XCA`` ``qkv`` rows ``[3, H, d_h]`` permuted to ``(B, H, d_h, N)``: the softmax is
  over a head's ``d_h`` channels; ``ClassAttn`` as CaiT's.
* timm NesT: ``Attention`` ``qkv`` rows ``[3, H, d_k]`` over ``(B, T, N, C)`` inputs (T image
  blocks of N tokens), cut as ``reshape(B, T, N, 3, H, d).permute(3, 0, 4, 1, 2, 5)``: q/k of
  ``(B, H, T, N, d_k)``, the heads *before* the blocks; SDPA, or ``q * scale @ kᵀ`` and a softmax.
* timm ConViT: ``GPSA`` ``qk`` rows ``[2, H, d_k]`` (queries and keys alone); two softmaxes, of
  ``(q @ kᵀ) * scale`` (content) and of ``pos_proj`` of the relative positions, mixed by
  ``sigmoid(gating_param)`` and renormalised; ``MHSA`` as timm's ``Attention`` (softmax path).
* x-transformers ``pre_talking_heads``: ``Attend.pre_softmax_talking_heads``, a 1×1 ``Conv2d``
  over the heads, ``sim + conv(sim)`` on the scaled ``einsum`` scores before the softmax.
* HF Swinv2: ``query``, ``key`` rows ``[H, d_k]``; cosine logits × ``logit_scale``, a continuous
  relative position bias, and the layer's shifted-window mask (``get_attn_mask``: 0 or -100) added
  to the logits twice before ``softmax``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB, SEQ, BATCH = 32, 12, 2
#: docs/metrics.md, "Masked keys": an additive mask entry at or below it blocks its key
MASK_FLOOR = -80.0
QK = dict[str, tuple[Tensor, Tensor]]


@dataclass
class Built:
    """A built zoo entry. ``fail`` maps ``"before"``/``"after"`` to a child of the attention module
    (relative name) that runs before/after the kernel; ``None`` there: patch ``fail_patch``
    instead."""

    model: nn.Module
    loss: Callable[[nn.Module], Tensor]
    qk: Callable[[nn.Module], QK]
    fail: dict[str, str | None]
    kernel_patches: list[tuple[object, str]] = field(
        default_factory=list
    )  # (module, attr) kernels to capture
    fail_patch: tuple[object, str] | None = None
    atol: float = 2e-5
    kappa_atol: float | None = None  # None: rtol 1e-5, atol 1e-7; else this atol and no rtol
    #: layer -> the keys its softmax may attend, from the model's own mask (``allowed(logits)``,
    #: logits as the softmax got them), where the module adds its mask to its logits itself
    allowed: dict[str, Callable[[Tensor], Tensor]] = field(default_factory=dict)
    #: layer -> a pattern of the warning that refuses its κ by name (κ NaN)
    kappa_refused: dict[str, str] = field(default_factory=dict)
    #: layer -> a pattern of the warning that refuses its statistics by name (NaN)
    stats_refused: dict[str, str] = field(default_factory=dict)
    #: the dim of the modules' own attention calls (SDPA's q, a softmax's logits) that holds
    #: their heads, from the end: -3 for (..., H, N, D); NesT's (B, H, T, N, D): -4
    heads_at: int = -3


@dataclass(frozen=True)
class Entry:
    name: str
    requires: tuple[str, ...]
    build: Callable[[], Built]


ZOO: dict[str, Entry] = {}


def entry(name: str, *requires: str):
    def register(build):
        ZOO[name] = Entry(name, requires, build)
        return build

    return register


# ------------------------------------------------------------------------------------------ helpers


def heads(w: Tensor, n: int) -> Tensor:
    """(n·d_k, d) nn.Linear rows -> (n, d, d_k) float64: head i is ``w[i·d_k:(i+1)·d_k]ᵀ``."""
    w = w.detach().double()
    return w.reshape(n, w.shape[0] // n, w.shape[1]).transpose(1, 2)


def blocked(h: int, h_kv: int) -> list[int]:
    """Query head -> key head when each group is a block of H/H_kv consecutive query heads."""
    return [i // (h // h_kv) for i in range(h)]


def modulo(h: int, h_kv: int) -> list[int]:
    """Query head -> key head when the key heads are tiled H/H_kv times (x-transformers)."""
    return [i % h_kv for i in range(h)]


def pair(wq: Tensor, wk: Tensor, groups: list[int]) -> tuple[Tensor, Tensor]:
    return wq, wk[groups]


@torch.no_grad()
def scale_rows_(weight: Tensor, rows, factor: float) -> None:
    weight[rows] *= factor


def no_dropout(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def tokens(seed: int = 0, batch: int = BATCH, seq: int = SEQ, low: int = 1) -> Tensor:
    return torch.randint(low, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def padding_mask(batch: int = BATCH, seq: int = SEQ, pad: int = 4) -> Tensor:
    """(B, N) 1/0 int mask: the last sequence ends with ``pad`` padding tokens."""
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, seq - pad :] = 0
    return mask


def logits_of(out) -> Tensor:
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def lm_loss(logits: Tensor, ids: Tensor) -> Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def mlm_loss(logits: Tensor, ids: Tensor) -> Tensor:
    labels = torch.roll(ids, 1, dims=1)  # any fixed target will do
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def causal_lm(ids: Tensor, mask: Tensor | None = None, hf: bool = True):
    def loss(model):
        if hf:
            out = (
                model(input_ids=ids, attention_mask=mask)
                if mask is not None
                else model(input_ids=ids)
            )
        else:
            out = model(ids)
        return lm_loss(logits_of(out)[..., :VOCAB].float(), ids)

    return loss


def modules_of(model: nn.Module, kind: type | tuple[type, ...]) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, kind)]


def seeded(seed: int = 0):
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------------------- controls


@entry("bundled")
def _bundled() -> Built:
    import qkmonitor.models.attention as bundled_attention
    from qkmonitor.models import DecoderLM, MultiHeadAttention, TransformerConfig

    seeded()
    model = DecoderLM(
        TransformerConfig(
            vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16
        )
    )
    for _, attn in modules_of(model, MultiHeadAttention):
        scale_rows_(attn.q_proj.weight, slice(None), 2.0)
        scale_rows_(attn.k_proj.weight, slice(None), 2.0)

    def qk(model):
        return {
            n: pair(heads(a.q_proj.weight, 4), heads(a.k_proj.weight, 2), blocked(4, 2))
            for n, a in modules_of(model, MultiHeadAttention)
        }

    return Built(
        model.train(),
        causal_lm(tokens(), hf=False),
        qk,
        {"before": "q_proj", "after": "o_proj"},
        kernel_patches=[(bundled_attention, "attention")],
    )


class TorchEncoder(nn.Module):
    """A user's model: nn.TransformerEncoder over embeddings, with a key padding mask."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids, keep):
        return self.head(self.encoder(self.embed(ids), src_key_padding_mask=~keep.bool()))


@entry("torch-mha")
def _torch_mha() -> Built:
    seeded()
    model = TorchEncoder()
    for _, attn in modules_of(model, nn.MultiheadAttention):
        scale_rows_(attn.in_proj_weight, slice(0, 64), 3.0)  # q and k rows
    ids, keep = tokens(), padding_mask()

    def qk(model):
        out = {}
        for n, a in modules_of(model, nn.MultiheadAttention):
            w, d = a.in_proj_weight, a.embed_dim  # rows [q | k | v], each [H, d_k]
            out[n] = heads(w[:d], a.num_heads), heads(w[d : 2 * d], a.num_heads)
        return out

    return Built(
        model.train(),
        lambda m: mlm_loss(m(ids, keep), ids),
        qk,
        {"before": None, "after": None},
        fail_patch=(F, "multi_head_attention_forward"),
    )


def hf_build(cls, config, impl: str, factor_rows: Callable[[nn.Module], None]):
    seeded()
    model = cls._from_config(config, attn_implementation=impl)
    factor_rows(model)
    return no_dropout(model).train()


@entry("hf-llama", "transformers")
def _hf_llama() -> Built:
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaAttention

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        initializer_range=0.2,
    )

    def sharpen(model):
        for _, a in modules_of(model, LlamaAttention):
            scale_rows_(a.q_proj.weight, slice(None), 1.5)
            scale_rows_(a.k_proj.weight, slice(None), 1.5)

    model = hf_build(transformers.LlamaForCausalLM, config, "sdpa", sharpen)

    def qk(model):
        return {
            n: pair(heads(a.q_proj.weight, 4), heads(a.k_proj.weight, 2), blocked(4, 2))
            for n, a in modules_of(model, LlamaAttention)
        }

    return Built(model, causal_lm(tokens()), qk, {"before": "q_proj", "after": "o_proj"})


def _deepseek_v3(q_lora_rank: int | None) -> Built:
    """Multi-head latent attention (DeepSeek-V3, Kimi K2's architecture), the query projection
    single (``q_lora_rank`` None) or factored. This file's reading of modeling_deepseek_v3: per
    head, the query is ``[q_pass | q_rot]`` of ``q_proj`` (or ``q_b_proj(q_a_layernorm(q_a_proj
    x))``), rows ``[H, d_n + d_r]``; the key is ``[k_nope | k_rot]``, ``k_nope`` the first d_n of
    each head's ``[d_n | d_v]`` rows of ``kv_b_proj`` applied to ``kv_a_layernorm`` of the first
    ``kv_lora_rank`` outputs of ``kv_a_proj_with_mqa``, ``k_rot`` its last d_r outputs, one for
    every head. The norms' per-token 1/rms is left out (position 0 of RoPE, unit factor)."""
    transformers = pytest.importorskip("transformers")
    modeling = pytest.importorskip(
        "transformers.models.deepseek_v3.modeling_deepseek_v3",
        reason="DeepSeek-V3: transformers 4.50+",
    )
    DeepseekV3Attention = modeling.DeepseekV3Attention

    heads_, nope, rope, value, rank = 4, 6, 4, 5, 12
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        first_k_dense_replace=2,  # dense MLPs: the attention is what is under test
        num_attention_heads=heads_,
        num_key_value_heads=heads_,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=rank,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=value,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        max_position_embeddings=32,
        initializer_range=0.2,
    )

    def sharpen(model):
        gen = torch.Generator().manual_seed(1)
        for _, a in modules_of(model, DeepseekV3Attention):
            scale_rows_(a.kv_b_proj.weight, slice(None), 1.5)
            norms = [a.kv_a_layernorm] + ([a.q_a_layernorm] if a.q_lora_rank else [])
            with torch.no_grad():  # norm weights away from 1, so that diag(g) counts
                for norm in norms:
                    norm.weight.copy_(0.5 + 1.5 * torch.rand(norm.weight.shape, generator=gen))

    model = hf_build(transformers.DeepseekV3ForCausalLM, config, "sdpa", sharpen)

    def qk(model):
        out = {}
        for n, a in modules_of(model, DeepseekV3Attention):
            if a.q_lora_rank is None:
                wq = a.q_proj.weight.detach().double()
            else:
                g = torch.diag(a.q_a_layernorm.weight.detach().double())
                wq = a.q_b_proj.weight.detach().double() @ g @ a.q_a_proj.weight.detach().double()
            kv_a = a.kv_a_proj_with_mqa.weight.detach().double()  # (rank + rope, d)
            kv_b = a.kv_b_proj.weight.detach().double().view(heads_, nope + value, rank)
            g = torch.diag(a.kv_a_layernorm.weight.detach().double())
            k_nope = kv_b[:, :nope] @ g @ kv_a[:rank]  # (H, d_n, d)
            k_rot = kv_a[rank:].expand(heads_, rope, -1)  # (H, d_r, d): the shared rotary key
            wk = torch.cat([k_nope, k_rot], dim=1)  # (H, d_n + d_r, d)
            out[n] = heads(wq, heads_), wk.transpose(1, 2)
        return out

    before = "q_proj" if q_lora_rank is None else "q_a_proj"
    return Built(model, causal_lm(tokens()), qk, {"before": before, "after": "o_proj"})


entry("hf-deepseek-v3", "transformers")(lambda: _deepseek_v3(None))
entry("hf-deepseek-v3-q-lora", "transformers")(lambda: _deepseek_v3(8))


# --------------------------------------------------------------------------------------------- timm


def _fused_qkv(attn_cls, weight: Callable[[nn.Module], Tensor] = lambda a: a.qkv.weight):
    """``qk`` for a fused q/k/v projection with rows ``[q | k | v]``, each ``[H, d_k]`` (timm's
    ``qkv``, ``nn.MultiheadAttention``'s ``in_proj_weight``)."""

    def qk(model):
        out = {}
        for n, a in modules_of(model, attn_cls):
            w = weight(a)
            d = w.shape[0] // 3
            out[n] = heads(w[:d], a.num_heads), heads(w[d : 2 * d], a.num_heads)
        return out

    return qk


IMAGES = torch.randn(BATCH, 3, 16, 16, generator=torch.Generator().manual_seed(0))
LABELS = torch.tensor([1, 3])


def classify(model: nn.Module) -> Tensor:
    """The image classifiers' loss on one fixed batch (the first output of a distilled model)."""
    logits = model(IMAGES)
    return F.cross_entropy(logits[0] if isinstance(logits, tuple) else logits, LABELS)


def timm_built(model: nn.Module, attn_cls, factor: float, fused: bool | None = None) -> Built:
    """A timm classifier whose attention has a fused ``qkv`` (rows ``[q | k | v]``): the query
    and key rows sharpened by ``factor`` (init std 0.02), ``fused_attn`` set where given."""
    for _, a in modules_of(model, attn_cls):
        if fused is not None:
            a.fused_attn = fused
        q_and_k = 2 * (a.qkv.weight.shape[0] // 3)
        scale_rows_(a.qkv.weight, slice(0, q_and_k), factor)
    return Built(
        no_dropout(model).train(),
        classify,
        _fused_qkv(attn_cls),
        {"before": "qkv", "after": "proj"},
    )


def _timm_vit(fused: bool) -> Built:
    pytest.importorskip("timm")
    from timm.layers import Attention
    from timm.models.vision_transformer import VisionTransformer

    seeded()
    model = VisionTransformer(
        img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, num_classes=5
    )
    return timm_built(model, Attention, 12.0, fused)


entry("timm-vit-sdpa", "timm")(lambda: _timm_vit(True))
entry("timm-vit-softmax", "timm")(lambda: _timm_vit(False))


def _timm_beit(fused: bool) -> Built:
    """timm BEiT: ``qkv`` Linear without a bias, rows ``[3, H, d_k]``; its forward assembles the
    bias ``cat(q_bias, zeros, v_bias)`` and calls ``F.linear(x, weight=self.qkv.weight,
    bias=qkv_bias)`` with keywords; a relative position bias added to the logits (SDPA's float
    mask, or before the softmax)."""
    pytest.importorskip("timm")
    from timm.models.beit import Attention, Beit

    seeded()
    model = Beit(
        img_size=16,
        patch_size=4,
        embed_dim=32,
        depth=2,
        num_heads=4,
        num_classes=5,
        use_rel_pos_bias=True,
    )
    gen = torch.Generator().manual_seed(3)
    for _, a in modules_of(model, Attention):
        a.fused_attn = fused
        scale_rows_(a.qkv.weight, slice(0, 64), 12.0)  # init std 0.02
        with torch.no_grad():  # biases of their own, so that the assembled bias counts
            a.q_bias.copy_(torch.randn(a.q_bias.shape, generator=gen))
            a.v_bias.copy_(torch.randn(a.v_bias.shape, generator=gen))
            a.relative_position_bias_table.copy_(
                torch.randn(a.relative_position_bias_table.shape, generator=gen)
            )
    qk = _fused_qkv(Attention)

    return Built(
        no_dropout(model).train(),
        classify,
        qk,
        {"before": None, "after": "proj"},  # its qkv weight is not called as a module
        fail_patch=(F, "linear"),
    )


entry("timm-beit-sdpa", "timm")(lambda: _timm_beit(True))
entry("timm-beit-softmax", "timm")(lambda: _timm_beit(False))


def window_keys(mask: Tensor | None, logits: Tensor) -> Tensor:
    """The keys a shifted-window mask lets each row attend: ``mask`` (windows, N, N), 0 or at or
    below the floor, for ``(B·windows, H, N, N)`` logits (windows of one image consecutive);
    None: every key."""
    free = torch.ones(logits.shape, dtype=torch.bool)
    if mask is None:
        return free
    per_window = (mask > MASK_FLOOR)[:, None]  # (windows, 1, N, N)
    return free & per_window.repeat(logits.shape[0] // mask.shape[0], 1, 1, 1)


def _timm_swin(fused: bool) -> Built:
    """timm Swin: ``qkv`` Linear rows ``[3, H, d_k]`` in each window's ``WindowAttention``; the
    shifted block masks the keys of other regions with an additive ``-100`` (``get_attn_mask``),
    added to the relative position bias: SDPA's float mask, or the logits before the softmax."""
    pytest.importorskip("timm")
    from timm.models.swin_transformer import SwinTransformer, WindowAttention

    seeded()
    model = SwinTransformer(
        img_size=16,
        patch_size=2,
        in_chans=3,
        num_classes=5,
        embed_dim=16,
        depths=(2,),
        num_heads=(2,),
        window_size=4,
        drop_path_rate=0.0,  # stochastic depth: a step of its own at every call
    )
    blocks = model.layers[0].blocks
    assert any(any(b.shift_size) for b in blocks), "no shifted window"
    built = timm_built(model, WindowAttention, 18.0, fused)
    # the softmax's logits hold the -100 the module adds itself: its keys are masked (the block's
    # own mask, as SDPA's additive mask blocks them on the fused path)
    built.allowed = {
        f"layers.0.blocks.{i}.attn": partial(window_keys, block.attn_mask)
        for i, block in enumerate(blocks)
    }
    return built


entry("timm-swin-sdpa", "timm")(lambda: _timm_swin(True))
entry("timm-swin-softmax", "timm")(lambda: _timm_swin(False))


# ------------------------------------------------------------------------------------------ nanoGPT


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = VOCAB
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True
    flash: bool = True


class LayerNorm(nn.Module):
    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention (karpathy/nanoGPT model.py), the flash path switchable."""

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.flash = config.flash and hasattr(torch.nn.functional, "scaled_dot_product_attention")
        if not self.flash:
            self.register_buffer(
                "bias",
                torch.tril(torch.ones(config.block_size, config.block_size)).view(
                    1, 1, config.block_size, config.block_size
                ),
            )

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = torch.nn.functional.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=None,
                dropout_p=self.dropout if self.training else 0,
                is_causal=True,
            )
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.vocab_size, config.n_embd),
                "wpe": nn.Embedding(config.block_size, config.n_embd),
                "drop": nn.Dropout(config.dropout),
                "h": nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                "ln_f": LayerNorm(config.n_embd, bias=config.bias),
            }
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        _, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )
        return logits, loss


def _nanogpt(flash: bool) -> Built:
    seeded()
    model = GPT(GPTConfig(flash=flash))
    for _, a in modules_of(model, CausalSelfAttention):
        scale_rows_(a.c_attn.weight, slice(0, 64), 15.0)  # init std 0.02: rows [q | k | v]
    ids = tokens()

    def qk(model):
        out = {}
        for n, a in modules_of(model, CausalSelfAttention):
            w, d = a.c_attn.weight, a.n_embd
            out[n] = heads(w[:d], a.n_head), heads(w[d : 2 * d], a.n_head)
        return out

    def loss(m):
        _, value = m(ids[:, :-1], ids[:, 1:].contiguous())
        return value

    return Built(model.train(), loss, qk, {"before": "c_attn", "after": "c_proj"})


entry("nanogpt-sdpa")(lambda: _nanogpt(True))
entry("nanogpt-softmax")(lambda: _nanogpt(False))


# --------------------------------------------------------------------------------------- torchtitan


@dataclass
class TitanArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = VOCAB
    multiple_of: int = 16
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 16


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def apply_rotary_emb(xq: Tensor, xk: Tensor, freqs_cis: Tensor) -> tuple[Tensor, Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[: xq_.shape[1]].view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class TitanAttention(nn.Module):
    """torchtitan llama3 ``Attention``: wq/wk/wv/wo, GQA by repeating k and v, RoPE, SDPA causal."""

    def __init__(self, args: TitanArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: Tensor, freqs_cis: Tensor) -> Tensor:
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys = torch.repeat_interleave(xk, self.n_rep, dim=2)  # (bs, seqlen, n_heads, head_dim)
        values = torch.repeat_interleave(xv, self.n_rep, dim=2)
        xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class TitanFeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanBlock(nn.Module):
    def __init__(self, layer_id: int, args: TitanArgs):
        super().__init__()
        self.attention = TitanAttention(args)
        self.feed_forward = TitanFeedForward(args.dim, 2 * args.dim)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanTransformer(nn.Module):
    def __init__(self, args: TitanArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len * 2, args.rope_theta),
            persistent=False,
        )
        self.layers = nn.ModuleDict({str(i): TitanBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


@entry("torchtitan-llama")
def _torchtitan() -> Built:
    seeded()
    model = TitanTransformer(TitanArgs())
    for _, a in modules_of(model, TitanAttention):
        scale_rows_(a.wq.weight, slice(None), 3.0)
        scale_rows_(a.wk.weight, slice(None), 3.0)

    def qk(model):
        return {
            n: pair(heads(a.wq.weight, a.n_heads), heads(a.wk.weight, a.n_kv_heads), blocked(4, 2))
            for n, a in modules_of(model, TitanAttention)
        }

    return Built(model.train(), causal_lm(tokens(), hf=False), qk, {"before": "wq", "after": "wo"})


# ------------------------------------------------------------------------------------------- litgpt


def _litgpt(pythia: bool) -> Built:
    pytest.importorskip("litgpt")
    from litgpt.config import Config
    from litgpt.model import GPT as LitGPT
    from litgpt.model import CausalSelfAttention as LitAttention

    if pythia:  # GPT-NeoX-like: n_query_groups == n_head, partial rotary, parallel residual, biases
        config = Config.from_name(
            "pythia-14m",
            block_size=16,
            vocab_size=VOCAB,
            padded_vocab_size=VOCAB,
            n_layer=2,
            n_embd=32,
            n_head=4,
            intermediate_size=64,
        )
    else:
        config = Config(
            block_size=16,
            vocab_size=VOCAB,
            padded_vocab_size=VOCAB,
            n_layer=2,
            n_head=4,
            n_embd=32,
            n_query_groups=2,
            rotary_percentage=1.0,
            parallel_residual=False,
            bias=False,
            norm_class_name="RMSNorm",
            mlp_class_name="LLaMAMLP",
            intermediate_size=64,
        )
    seeded()
    model = LitGPT(config)
    h, g, hs = config.n_head, config.n_query_groups, config.head_size
    for _, a in modules_of(model, LitAttention):
        scale_rows_(
            a.qkv.weight, slice(0, (h + g) * hs), 3.0
        )  # rows [q (H·hs) | k (G·hs) | v (G·hs)]

    def qk(model):
        out = {}
        for n, a in modules_of(model, LitAttention):
            c = a.config
            w, q_size, k_size = a.qkv.weight, c.n_head * c.head_size, c.n_query_groups * c.head_size
            wq, wk = (
                heads(w[:q_size], c.n_head),
                heads(w[q_size : q_size + k_size], c.n_query_groups),
            )
            out[n] = pair(wq, wk, blocked(c.n_head, c.n_query_groups))
        return out

    return Built(
        no_dropout(model).train(),
        causal_lm(tokens(), hf=False),
        qk,
        {"before": "qkv", "after": "proj"},
    )


entry("litgpt-gqa", "litgpt")(lambda: _litgpt(False))
entry("litgpt-pythia", "litgpt")(lambda: _litgpt(True))


# ----------------------------------------------------------------------------------- x-transformers


def _xtransformers(**attn_kwargs) -> Built:
    pytest.importorskip("x_transformers")
    from x_transformers import Decoder, TransformerWrapper
    from x_transformers.x_transformers import Attention as XAttention

    seeded()
    model = TransformerWrapper(
        num_tokens=VOCAB,
        max_seq_len=16,
        attn_layers=Decoder(dim=32, depth=2, heads=4, attn_dim_head=8, **attn_kwargs),
    )
    for _, a in modules_of(model, XAttention):
        scale_rows_(a.to_q.weight, slice(None), 3.0)
        scale_rows_(a.to_k.weight, slice(None), 3.0)

    def qk(model):
        return {
            n: pair(
                heads(a.to_q.weight, a.heads),
                heads(a.to_k.weight, a.kv_heads),
                modulo(a.heads, a.kv_heads),
            )
            for n, a in modules_of(model, XAttention)
        }

    return Built(
        no_dropout(model).train(),
        causal_lm(tokens(), hf=False),
        qk,
        {"before": "to_q", "after": "to_out"},
    )


class Beside(nn.Module):
    """Models run side by side on one input, their outputs summed."""

    def __init__(self, *models: nn.Module) -> None:
        super().__init__()
        self.models = nn.ModuleList(models)

    def forward(self, x: Tensor) -> Tensor:
        return sum(model(x) for model in self.models)


@entry("xtransformers-talking-heads", "x_transformers")
def _xtransformers_talking() -> Built:
    """x-transformers with ``pre_talking_heads`` (a 1×1 Conv2d mixing the heads of its einsum
    scores before the softmax: κ read, statistics refused by name) beside a plain decoder (einsum
    scores, no mixing: measured)."""
    from x_transformers.attend import Attend

    plain = _xtransformers()
    talking = _xtransformers(attn_pre_talking_heads=True)
    for _, attend in modules_of(talking.model, Attend):  # dirac-initialised: mix for real
        with torch.no_grad():
            attend.pre_softmax_talking_heads.weight.add_(0.5 * torch.randn(4, 4, 1, 1))
    model = Beside(plain.model, talking.model)
    refused = {
        n: r"mixes its heads' logits before the softmax \(talking heads: a convolution over the 4"
        for n in plain.qk(model)
        if n.startswith("models.1.")
    }
    return replace(plain, model=model, stats_refused=refused)


entry("xtransformers-softmax", "x_transformers")(lambda: _xtransformers())
entry("xtransformers-sdpa", "x_transformers")(lambda: _xtransformers(attn_flash=True))
entry("xtransformers-gqa", "x_transformers")(lambda: _xtransformers(attn_kv_heads=2))
# ALiBi through SDPA: a float attn_mask, the causal part filled with -finfo.max // 2 (not -inf)
entry("xtransformers-alibi-sdpa", "x_transformers")(
    lambda: _xtransformers(attn_flash=True, alibi_pos_bias=True)
)


# ------------------------------------------------------------------------------------- Hugging Face


def _gpt_neox(impl: str) -> Built:
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention

    config = transformers.GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        initializer_range=0.2,
    )

    def neox_rows(a, which):  # rows [H, 3, d_k]: head h's q, k, v are consecutive d_k blocks
        hd = a.head_size
        return torch.cat(
            [torch.arange(h * 3 * hd + which * hd, h * 3 * hd + (which + 1) * hd) for h in range(4)]
        )

    def sharpen(model):
        for _, a in modules_of(model, GPTNeoXAttention):
            scale_rows_(
                a.query_key_value.weight, torch.cat([neox_rows(a, 0), neox_rows(a, 1)]), 1.5
            )

    model = hf_build(transformers.GPTNeoXForCausalLM, config, impl, sharpen)

    def qk(model):
        out = {}
        for n, a in modules_of(model, GPTNeoXAttention):
            w = a.query_key_value.weight
            out[n] = heads(w[neox_rows(a, 0)], 4), heads(w[neox_rows(a, 1)], 4)
        return out

    return Built(model, causal_lm(tokens()), qk, {"before": "query_key_value", "after": "dense"})


entry("hf-gpt-neox-eager", "transformers")(lambda: _gpt_neox("eager"))
entry("hf-gpt-neox-sdpa", "transformers")(lambda: _gpt_neox("sdpa"))


@entry("hf-phi3", "transformers")
def _phi3() -> Built:
    transformers = pytest.importorskip("transformers")
    from transformers.models.phi3.modeling_phi3 import Phi3Attention

    config = transformers.Phi3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        original_max_position_embeddings=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.2,
        attention_dropout=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    )
    q_size, k_size = 32, 2 * 8

    def sharpen(model):
        for _, a in modules_of(model, Phi3Attention):
            scale_rows_(a.qkv_proj.weight, slice(0, q_size + k_size), 1.5)

    model = hf_build(transformers.Phi3ForCausalLM, config, "sdpa", sharpen)

    def qk(model):
        out = {}
        for n, a in modules_of(model, Phi3Attention):
            w = a.qkv_proj.weight  # rows [q (H·d_k) | k (H_kv·d_k) | v (H_kv·d_k)]
            out[n] = pair(
                heads(w[:q_size], 4), heads(w[q_size : q_size + k_size], 2), blocked(4, 2)
            )
        return out

    return Built(model, causal_lm(tokens()), qk, {"before": "qkv_proj", "after": "o_proj"})


def _t5(impl: str) -> Built:
    transformers = pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5Attention

    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
    )

    def sharpen(model):
        for _, a in modules_of(model, T5Attention):
            scale_rows_(a.q.weight, slice(None), 2.0)
            scale_rows_(a.k.weight, slice(None), 2.0)

    model = hf_build(transformers.T5ForConditionalGeneration, config, impl, sharpen)
    src, src_mask, tgt = tokens(1), padding_mask(pad=3), tokens(2, seq=10)

    def qk(model):
        return {
            n: (heads(a.q.weight, a.n_heads), heads(a.k.weight, a.n_heads))
            for n, a in modules_of(model, T5Attention)
        }

    def loss(m):
        logits = m(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt).logits
        return lm_loss(logits, tgt)

    return Built(model, loss, qk, {"before": "q", "after": "o"})


entry("hf-t5-eager", "transformers")(lambda: _t5("eager"))
entry("hf-t5-sdpa", "transformers")(lambda: _t5("sdpa"))


@entry("hf-modernbert", "transformers")
def _modernbert() -> Built:
    transformers = pytest.importorskip("transformers")
    from transformers.models.modernbert.modeling_modernbert import ModernBertAttention

    # a sliding window of 2 on either side in the second layer (the first is global), and padding
    config = transformers.ModernBertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
        global_attn_every_n_layers=2,
        local_attention=4,
        initializer_range=0.2,
        attention_dropout=0.0,
        embedding_dropout=0.0,
        mlp_dropout=0.0,
    )

    def sharpen(model):
        for _, a in modules_of(model, ModernBertAttention):
            scale_rows_(a.Wqkv.weight, slice(0, 64), 1.5)  # rows [3, H, d_k]

    model = hf_build(transformers.ModernBertForMaskedLM, config, "sdpa", sharpen)
    ids, mask = tokens(), padding_mask()

    def qk(model):
        return {
            n: (heads(a.Wqkv.weight[:32], 4), heads(a.Wqkv.weight[32:64], 4))
            for n, a in modules_of(model, ModernBertAttention)
        }

    return Built(
        model,
        lambda m: mlm_loss(m(input_ids=ids, attention_mask=mask).logits, ids),
        qk,
        {"before": "Wqkv", "after": "Wo"},
    )


def _distilbert(impl: str) -> Built:
    transformers = pytest.importorskip("transformers")
    from transformers.models.distilbert.modeling_distilbert import DistilBertSelfAttention

    config = transformers.DistilBertConfig(
        vocab_size=VOCAB,
        dim=32,
        n_layers=2,
        n_heads=4,
        hidden_dim=64,
        dropout=0.0,
        attention_dropout=0.0,
        max_position_embeddings=32,
        pad_token_id=0,
        initializer_range=0.2,
    )

    def sharpen(model):
        for _, a in modules_of(model, DistilBertSelfAttention):
            scale_rows_(a.q_lin.weight, slice(None), 1.5)
            scale_rows_(a.k_lin.weight, slice(None), 1.5)

    model = hf_build(transformers.DistilBertForMaskedLM, config, impl, sharpen)
    ids, mask = tokens(), padding_mask()

    def qk(model):
        return {
            n: (heads(a.q_lin.weight, a.n_heads), heads(a.k_lin.weight, a.n_heads))
            for n, a in modules_of(model, DistilBertSelfAttention)
        }

    return Built(
        model,
        lambda m: mlm_loss(m(input_ids=ids, attention_mask=mask).logits, ids),
        qk,
        {"before": "q_lin", "after": "out_lin"},
    )


entry("hf-distilbert-eager", "transformers")(lambda: _distilbert("eager"))
entry("hf-distilbert-sdpa", "transformers")(lambda: _distilbert("sdpa"))


def _bigcode(impl: str) -> Built:
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_bigcode.modeling_gpt_bigcode import GPTBigCodeAttention

    config = transformers.GPTBigCodeConfig(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=32,
        multi_query=True,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        initializer_range=0.2,
    )

    def sharpen(model):
        for _, a in modules_of(model, GPTBigCodeAttention):
            scale_rows_(a.c_attn.weight, slice(0, 32 + 8), 1.5)  # rows [q (d) | k (d_k) | v (d_k)]

    model = hf_build(transformers.GPTBigCodeForCausalLM, config, impl, sharpen)

    def qk(model):
        out = {}
        for n, a in modules_of(model, GPTBigCodeAttention):
            w = a.c_attn.weight
            out[n] = pair(heads(w[:32], 4), heads(w[32:40], 1), [0] * 4)
        return out

    return Built(model, causal_lm(tokens()), qk, {"before": "c_attn", "after": "c_proj"})


entry("hf-gpt-bigcode-mqa-sdpa", "transformers")(lambda: _bigcode("sdpa"))
entry("hf-gpt-bigcode-mqa-eager", "transformers")(lambda: _bigcode("eager"))


def _falcon(impl: str, layout: str, padded: bool = False) -> Built:
    transformers = pytest.importorskip("transformers")
    from transformers.models.falcon.modeling_falcon import FalconAttention

    arch = {  # blocks of d_k rows in query_key_value:
        # Falcon-7B: multi-query, [H queries, k, v]
        "mqa": {"new_decoder_architecture": False, "multi_query": True},
        # the "new decoder architecture" (Falcon-40B/180B): per group [H/H_kv queries, k, v]
        "gqa": {"new_decoder_architecture": True, "num_kv_heads": 2},
        # Falcon-RW: multi-head with ALiBi, per head [q, k, v]; ALiBi/sqrt(d_k) added to the float
        # mask
        "alibi": {
            "new_decoder_architecture": False,
            "multi_query": False,
            "alibi": True,
            "parallel_attn": False,
        },
    }[layout]
    config = transformers.FalconConfig(
        **{"alibi": False, **arch},
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bias=False,
        initializer_range=0.2,
    )
    hd = 8

    def rows(which: str) -> tuple[Tensor, int, list[int]]:
        """(rows of the fused weight, number of heads they hold, query head -> key head)."""
        if layout == "gqa":
            per = 4 // 2 + 2  # blocks per group
            idx = (
                [g * per + j for g in range(2) for j in range(2)]
                if which == "q"
                else [g * per + 2 for g in range(2)]
            )
            groups = blocked(4, 2)
        elif layout == "mqa":
            idx, groups = (list(range(4)) if which == "q" else [4]), [0] * 4
        else:
            idx, groups = [h * 3 + (which == "k") for h in range(4)], list(range(4))
        return torch.cat([torch.arange(i * hd, (i + 1) * hd) for i in idx]), len(idx), groups

    def sharpen(model):
        for _, a in modules_of(model, FalconAttention):
            scale_rows_(a.query_key_value.weight, torch.cat([rows("q")[0], rows("k")[0]]), 1.5)

    model = hf_build(transformers.FalconForCausalLM, config, impl, sharpen)

    def qk(model):
        out = {}
        for n, a in modules_of(model, FalconAttention):
            w = a.query_key_value.weight
            (rq, nq, groups), (rk, nk, _) = rows("q"), rows("k")
            out[n] = pair(heads(w[rq], nq), heads(w[rk], nk), groups)
        return out

    ids = tokens()
    return Built(
        model,
        causal_lm(ids, padding_mask() if padded else None),
        qk,
        {"before": "query_key_value", "after": "dense"},
    )


entry("hf-falcon-mqa-sdpa", "transformers")(lambda: _falcon("sdpa", "mqa"))
entry("hf-falcon-gqa-eager", "transformers")(lambda: _falcon("eager", "gqa"))
entry("hf-falcon-alibi-sdpa", "transformers")(lambda: _falcon("sdpa", "alibi", padded=True))


@entry("hf-bloom", "transformers")
def _bloom() -> Built:
    transformers = pytest.importorskip("transformers")
    from transformers.models.bloom.modeling_bloom import BloomAttention

    config = transformers.BloomConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        n_layer=2,
        n_head=4,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        initializer_range=0.2,
    )

    def bloom_rows(which):  # rows [H, 3, d_k]
        return torch.cat(
            [torch.arange(h * 24 + which * 8, h * 24 + (which + 1) * 8) for h in range(4)]
        )

    def sharpen(model):
        for _, a in modules_of(model, BloomAttention):
            scale_rows_(a.query_key_value.weight, torch.cat([bloom_rows(0), bloom_rows(1)]), 1.5)

    model = hf_build(transformers.BloomForCausalLM, config, "eager", sharpen)
    ids, mask = tokens(), padding_mask()

    def qk(model):
        out = {}
        for n, a in modules_of(model, BloomAttention):
            w = a.query_key_value.weight
            out[n] = heads(w[bloom_rows(0)], 4), heads(w[bloom_rows(1)], 4)
        return out

    return Built(model, causal_lm(ids, mask), qk, {"before": "query_key_value", "after": "dense"})


# ------------------------------------------------- the "Works with" table's other models (issue 33)


def _separate(attn_cls, q: str = "q_proj", k: str = "k_proj", heads_of=None):
    """``qk`` for modules with separate query/key ``nn.Linear`` projections whose rows are the
    heads in order, query head h reading key head h // (H / H_kv); ``heads_of(module)`` gives
    (H, H_kv)."""

    def qk(model):
        out = {}
        for n, a in modules_of(model, attn_cls):
            h, kv = heads_of(a)
            wq, wk = getattr(a, q).weight, getattr(a, k).weight
            out[n] = pair(heads(wq, h), heads(wk, kv), blocked(h, kv))
        return out

    return qk


def _sharpen_separate(attn_cls, factor: float, q: str = "q_proj", k: str = "k_proj"):
    def sharpen(model):
        for _, a in modules_of(model, attn_cls):
            scale_rows_(getattr(a, q).weight, slice(None), factor)
            scale_rows_(getattr(a, k).weight, slice(None), factor)

    return sharpen


def _hf_decoder(
    config_name: str,
    model_name: str,
    attn_path: str,
    impl: str,
    factor: float,
    out: str = "o_proj",
    **config_kw,
) -> Built:
    """A Hugging Face causal LM whose attention has separate ``q_proj``/``k_proj`` Linear rows
    ``[H, d_k]`` and ``[H_kv, d_k]`` (this file's reading of each modeling file named below),
    H and H_kv as its config says."""
    transformers = pytest.importorskip("transformers")
    module_name, cls_name = attn_path.rsplit(".", 1)
    attn_cls = getattr(pytest.importorskip(module_name), cls_name)
    config = getattr(transformers, config_name)(vocab_size=VOCAB, **config_kw)
    model = hf_build(
        getattr(transformers, model_name), config, impl, _sharpen_separate(attn_cls, factor)
    )
    h = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or h
    qk = _separate(attn_cls, heads_of=lambda a: (h, kv))
    return Built(model, causal_lm(tokens()), qk, {"before": "q_proj", "after": out})


_DECODER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    max_position_embeddings=32,
    initializer_range=0.2,
)

# Mistral: GQA, a sliding window shorter than the batch's sequence (eager: in the 4-D mask)
entry("hf-mistral-sliding", "transformers")(
    lambda: _hf_decoder(
        "MistralConfig",
        "MistralForCausalLM",
        "transformers.models.mistral.modeling_mistral.MistralAttention",
        "eager",
        1.5,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=5,
        **_DECODER,
    )
)
# Gemma-2: soft-capped logits, sliding and global layers alternating, head_dim of its own
entry("hf-gemma2-eager", "transformers")(
    lambda: _hf_decoder(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        "transformers.models.gemma2.modeling_gemma2.Gemma2Attention",
        "eager",
        3.0,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=5,
        attn_logit_softcapping=10.0,
        **_DECODER,
    )
)
# Qwen3: QK-norm per head (q_norm, k_norm), not part of W_QK
entry("hf-qwen3", "transformers")(
    lambda: _hf_decoder(
        "Qwen3Config",
        "Qwen3ForCausalLM",
        "transformers.models.qwen3.modeling_qwen3.Qwen3Attention",
        "sdpa",
        1.5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        **_DECODER,
    )
)
# OLMo-2: QK-norm over the whole projection
entry("hf-olmo2", "transformers")(
    lambda: _hf_decoder(
        "Olmo2Config",
        "Olmo2ForCausalLM",
        "transformers.models.olmo2.modeling_olmo2.Olmo2Attention",
        "sdpa",
        1.5,
        num_attention_heads=4,
        num_key_value_heads=4,
        **_DECODER,
    )
)
# GPT-J: partial rotary, out_proj, sizes in n_embd/n_head
entry("hf-gptj", "transformers")(
    lambda: _hf_decoder(
        "GPTJConfig",
        "GPTJForCausalLM",
        "transformers.models.gptj.modeling_gptj.GPTJAttention",
        "eager",
        1.0,
        out="out_proj",
        n_embd=32,
        n_layer=2,
        n_head=4,
        rotary_dim=4,
        n_positions=32,
        initializer_range=0.2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
)
# OPT: biases, the 1/sqrt(d) folded into the queries (scaling), out_proj
entry("hf-opt", "transformers")(
    lambda: _hf_decoder(
        "OPTConfig",
        "OPTForCausalLM",
        "transformers.models.opt.modeling_opt.OPTAttention",
        "sdpa",
        2.0,
        out="out_proj",
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
        word_embed_proj_dim=32,
        init_std=0.2,
        dropout=0.0,
        attention_dropout=0.0,
    )
)


@entry("hf-bart", "transformers")
def _bart() -> Built:
    """BART: encoder self-attention (padding), decoder causal self-attention and cross-attention
    over the encoder's keys; ``q_proj``/``k_proj`` rows ``[H, d_k]``."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.bart.modeling_bart import BartAttention

    config = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=32,
        init_std=0.2,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=0,
    )
    model = hf_build(
        transformers.BartForConditionalGeneration,
        config,
        "sdpa",
        _sharpen_separate(BartAttention, 1.5),
    )
    src, src_mask, tgt = tokens(1), padding_mask(pad=3), tokens(2, seq=10)

    def loss(m):
        logits = m(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt).logits
        return lm_loss(logits, tgt)

    qk = _separate(BartAttention, heads_of=lambda a: (a.num_heads, a.num_heads))
    return Built(model, loss, qk, {"before": "q_proj", "after": "out_proj"})


@entry("hf-whisper", "transformers")
def _whisper() -> Built:
    """Whisper: an audio encoder (self-attention), a text decoder (causal self-attention and
    cross-attention); ``k_proj`` has no bias."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.whisper.modeling_whisper import WhisperAttention

    config = transformers.WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=8,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=8,
        max_target_positions=16,
        init_std=0.2,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=0,
        decoder_start_token_id=1,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = hf_build(
        transformers.WhisperForConditionalGeneration,
        config,
        "sdpa",
        _sharpen_separate(WhisperAttention, 2.0),
    )
    features = torch.randn(BATCH, 8, 16, generator=torch.Generator().manual_seed(0))
    tgt = tokens(2, seq=10)

    def loss(m):
        return lm_loss(m(input_features=features, decoder_input_ids=tgt).logits, tgt)

    qk = _separate(WhisperAttention, heads_of=lambda a: (a.num_heads, a.num_heads))
    return Built(model, loss, qk, {"before": "q_proj", "after": "out_proj"})


@entry("hf-clip", "transformers")
def _clip() -> Built:
    """CLIP: a text tower (causal, padding) and a vision tower, each ``q_proj``/``k_proj``."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.clip.modeling_clip import CLIPAttention

    text = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=16,
        initializer_range=0.2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        image_size=16,
        patch_size=4,
        initializer_range=0.2,
    )
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    model = hf_build(transformers.CLIPModel, config, "sdpa", _sharpen_separate(CLIPAttention, 2.0))
    ids = tokens(3, seq=10, low=3)
    pixels = torch.randn(BATCH, 3, 16, 16, generator=torch.Generator().manual_seed(0))

    def loss(m):
        out = m(input_ids=ids, pixel_values=pixels, return_loss=True)
        return out.loss

    qk = _separate(CLIPAttention, heads_of=lambda a: (a.num_heads, a.num_heads))
    return Built(model, loss, qk, {"before": "q_proj", "after": "out_proj"})


@entry("hf-vit", "transformers")
def _hf_vit() -> Built:
    """Hugging Face ViT: ``ViTAttention`` with ``q_proj``/``k_proj`` Linear rows ``[H, d_k]``
    (5.x; before, ``ViTSelfAttention`` with ``query``/``key``)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.vit import modeling_vit

    attn_cls = getattr(modeling_vit, "ViTSelfAttention", None) or modeling_vit.ViTAttention
    q, k = ("query", "key") if attn_cls.__name__ == "ViTSelfAttention" else ("q_proj", "k_proj")
    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=16,
        patch_size=4,
        num_labels=5,
        initializer_range=0.2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = hf_build(
        transformers.ViTForImageClassification,
        config,
        "sdpa",
        _sharpen_separate(attn_cls, 1.5, q, k),
    )
    qk = _separate(attn_cls, q, k, lambda a: (4, 4))
    return Built(
        model,
        lambda m: F.cross_entropy(m(pixel_values=IMAGES).logits, LABELS),
        qk,
        {"before": q, "after": None},
        fail_patch=(F, "scaled_dot_product_attention"),
    )


@entry("timm-deit", "timm")
def _timm_deit() -> Built:
    """timm DeiT (distilled): ViT's ``Attention`` (fused ``qkv``) with a distillation token."""
    pytest.importorskip("timm")
    from timm.layers import Attention
    from timm.models.deit import VisionTransformerDistilled

    seeded()
    model = VisionTransformerDistilled(
        img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, num_classes=5
    )
    return timm_built(model, Attention, 12.0)


@entry("torchvision-vit", "torchvision")
def _torchvision_vit() -> Built:
    """torchvision's VisionTransformer: ``nn.MultiheadAttention`` in each encoder block."""
    pytest.importorskip("torchvision")
    from torchvision.models import VisionTransformer

    seeded()
    model = VisionTransformer(
        image_size=16,
        patch_size=4,
        num_layers=2,
        num_heads=4,
        hidden_dim=32,
        mlp_dim=64,
        num_classes=5,
    )
    for _, a in modules_of(model, nn.MultiheadAttention):
        scale_rows_(a.in_proj_weight, slice(0, 64), 3.0)
    qk = _fused_qkv(nn.MultiheadAttention, lambda a: a.in_proj_weight)

    return Built(
        no_dropout(model).train(),
        classify,
        qk,
        {"before": None, "after": None},
        fail_patch=(F, "multi_head_attention_forward"),
    )


# ------------------------------------------------------------------ windows, mixed heads, channels


def _twins(fused: bool) -> Built:
    """timm Twins-SVT (``twins_svt_small``'s structure, tiny): per stage a locally grouped block
    (windows of ws² tokens, 5-D q/k) then a global sub-sampled one (keys from a stride-sr conv:
    M < N at sr_ratio 2)."""
    pytest.importorskip("timm")
    from timm.models.twins import GlobalSubSampleAttn, LocallyGroupedAttn, Twins

    seeded()
    model = Twins(
        img_size=16,
        patch_size=2,
        embed_dims=(16, 32),
        num_heads=(2, 4),
        mlp_ratios=(2, 2),
        depths=(2, 2),
        wss=(2, 2),
        sr_ratios=(2, 1),
        num_classes=5,
    )
    for _, a in modules_of(model, (LocallyGroupedAttn, GlobalSubSampleAttn)):
        a.fused_attn = fused
        if isinstance(a, LocallyGroupedAttn):
            scale_rows_(a.qkv.weight, slice(0, 2 * a.dim), 14.0)
        else:
            scale_rows_(a.q.weight, slice(None), 14.0)
            scale_rows_(a.kv.weight, slice(0, a.dim), 14.0)

    def qk(model):
        out = {}
        for n, a in modules_of(model, (LocallyGroupedAttn, GlobalSubSampleAttn)):
            if isinstance(a, LocallyGroupedAttn):
                w = a.qkv.weight
                out[n] = heads(w[: a.dim], a.num_heads), heads(w[a.dim : 2 * a.dim], a.num_heads)
            else:
                out[n] = heads(a.q.weight, a.num_heads), heads(a.kv.weight[: a.dim], a.num_heads)
        return out

    return Built(
        no_dropout(model).train(),
        classify,
        qk,
        {"before": "q", "after": "proj"},
        atol=3e-7,
        kappa_atol=2e-8,
    )


entry("timm-twins-sdpa", "timm")(lambda: _twins(True))
entry("timm-twins-softmax", "timm")(lambda: _twins(False))


@entry("hf-swinv2", "transformers")
def _swinv2() -> Built:
    """Hugging Face Swinv2: two blocks of 4×4 windows over 8×8 tokens, the second shifted (its
    mask blocks the keys of other regions: -100, added twice). The reference blocks the keys the
    layer's own ``get_attn_mask`` marks (at or below the floor), whatever else the logits hold."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.swinv2.modeling_swinv2 import Swinv2Layer, Swinv2SelfAttention

    config = transformers.Swinv2Config(
        image_size=16,
        patch_size=2,
        embed_dim=16,
        depths=[2],
        num_heads=[2],
        window_size=4,
        num_labels=5,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
    )
    model = hf_build(
        transformers.Swinv2ForImageClassification,
        config,
        "eager",
        _sharpen_separate(Swinv2SelfAttention, 4.0, "query", "key"),
    )
    layers = modules_of(model, Swinv2Layer)
    assert any(layer.shift_size > 0 for _, layer in layers), "no shifted window"
    allowed = {  # each layer's own mask over its 8×8 tokens, or None: not shifted
        f"{name}.attention.self": partial(window_keys, layer.get_attn_mask(8, 8, torch.float64))
        for name, layer in layers
    }
    qk = _separate(Swinv2SelfAttention, "query", "key", lambda a: (2, 2))
    return Built(
        model,
        lambda m: F.cross_entropy(m(pixel_values=IMAGES).logits, LABELS),
        qk,
        {"before": "query", "after": None},
        fail_patch=(F, "softmax"),
        allowed=allowed,
        atol=3e-7,
        kappa_refused={n: r"same directions: it normalizes each head's queries" for n in qk(model)},
    )


@entry("timm-cait", "timm")
def _cait() -> Built:
    """timm CaiT: talking-heads self-attention blocks (their heads' logits mixed by ``proj_l``
    before the softmax: κ read, statistics refused by name) and a class-attention block."""
    pytest.importorskip("timm")
    from timm.models.cait import Cait, ClassAttn, TalkingHeadAttn

    seeded()
    model = Cait(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, depth_token_only=1)
    model.reset_classifier(5)
    for _, a in modules_of(model, TalkingHeadAttn):
        scale_rows_(a.qkv.weight, slice(0, 64), 12.0)
    for _, a in modules_of(model, ClassAttn):
        a.fused_attn = True
        scale_rows_(a.q.weight, slice(None), 12.0)
        scale_rows_(a.k.weight, slice(None), 12.0)

    def qk(model):
        out = {}
        for n, a in modules_of(model, (TalkingHeadAttn, ClassAttn)):
            if isinstance(a, TalkingHeadAttn):
                w = a.qkv.weight
                out[n] = heads(w[:32], a.num_heads), heads(w[32:64], a.num_heads)
            else:
                out[n] = heads(a.q.weight, a.num_heads), heads(a.k.weight, a.num_heads)
        return out

    refused = {
        n: r"mixes its heads' logits before the softmax \(talking heads.*proj_l"
        for n, _ in modules_of(model, TalkingHeadAttn)
    }
    return Built(
        no_dropout(model).train(),
        classify,
        qk,
        {"before": "qkv", "after": "proj"},
        atol=3e-7,
        kappa_atol=2e-8,
        stats_refused=refused,
    )


def _xcit(fused: bool) -> Built:
    """timm XCiT: cross-covariance attention blocks (a softmax, or SDPA, over each head's
    channels: κ and statistics refused by name) and a class-attention block (read)."""
    pytest.importorskip("timm")
    from timm.models.cait import ClassAttn
    from timm.models.xcit import XCA, Xcit

    seeded()
    model = Xcit(img_size=16, patch_size=8, embed_dim=32, depth=2, num_heads=4, cls_attn_layers=1)
    model.reset_classifier(5)
    for _, a in modules_of(model, XCA):
        a.fused_attn = fused
        scale_rows_(a.qkv.weight, slice(0, 64), 12.0)
    for _, a in modules_of(model, ClassAttn):
        a.fused_attn = True
        scale_rows_(a.q.weight, slice(None), 12.0)
        scale_rows_(a.k.weight, slice(None), 12.0)

    def qk(model):
        out = {}
        for n, a in modules_of(model, (XCA, ClassAttn)):
            if isinstance(a, XCA):  # rows [3, H, d_h], as the module cuts them; κ refused
                w = a.qkv.weight
                out[n] = heads(w[:32], a.num_heads), heads(w[32:64], a.num_heads)
            else:
                out[n] = heads(a.q.weight, a.num_heads), heads(a.k.weight, a.num_heads)
        return out

    xca = [n for n, _ in modules_of(model, XCA)]
    return Built(
        no_dropout(model).train(),
        classify,
        qk,
        {"before": "qkv", "after": "proj"},
        atol=3e-7,
        kappa_atol=2e-8,
        kappa_refused={n: r"over channels \(cross-covariance.*no W_QK over tokens" for n in xca},
        stats_refused={n: r"softmax is over channels, not tokens \(cross-covariance" for n in xca},
    )


entry("timm-xcit-sdpa", "timm")(lambda: _xcit(True))
entry("timm-xcit-softmax", "timm")(lambda: _xcit(False))


def _nest(fused: bool) -> Built:
    """timm NesT (``nest_tiny``'s structure, tiny): three levels of 16, 4 and 1 image blocks of
    4 tokens, with 2, 4 and 4 heads: q/k of ``(B, H, T, N, d_k)``, the heads before the blocks,
    with T ≠ H, T = H and T = 1."""
    pytest.importorskip("timm")
    from timm.models.nest import Attention, Nest

    seeded()
    model = Nest(
        img_size=16,
        patch_size=2,
        num_levels=3,
        embed_dims=(16, 32, 64),
        num_heads=(2, 4, 4),
        depths=(1, 1, 1),
        num_classes=5,
        drop_path_rate=0.0,
    )
    built = timm_built(model, Attention, 12.0, fused)
    return replace(built, heads_at=-4, atol=3e-7, kappa_atol=2e-8)


entry("timm-nest-sdpa", "timm")(lambda: _nest(True))
entry("timm-nest-softmax", "timm")(lambda: _nest(False))


@entry("timm-convit", "timm")
def _convit() -> Built:
    """timm ConViT: a gated positional self-attention block (GPSA: a content and a position
    softmax mixed by a gate: κ read from its fused ``qk``, statistics refused by name) and a
    plain one (MHSA, measured). 4 heads of 12: ``qk``'s 96 rows are also 3 × 4 heads of 8 (as
    ``convit_tiny``'s 4 heads of 48), which only its name tells apart from q, k, v."""
    pytest.importorskip("timm")
    from timm.models.convit import GPSA, MHSA, ConVit

    seeded()
    model = ConVit(
        img_size=16, patch_size=4, embed_dim=12, depth=2, num_heads=4, local_up_to_layer=1
    )
    model.reset_classifier(5)
    for _, a in modules_of(model, GPSA):
        scale_rows_(a.qk.weight, slice(None), 12.0)
    for _, a in modules_of(model, MHSA):
        scale_rows_(a.qkv.weight, slice(0, 96), 12.0)

    def qk(model):
        out = {}
        for n, a in modules_of(model, (GPSA, MHSA)):
            w = a.qk.weight if isinstance(a, GPSA) else a.qkv.weight
            c = w.shape[1]  # rows [q | k (| v)], each [H, d_k]
            out[n] = heads(w[:c], a.num_heads), heads(w[c : 2 * c], a.num_heads)
        return out

    refused = {
        n: r"two softmaxes over the same queries' keys .*ConViT's GPSA"
        for n, _ in modules_of(model, GPSA)
    }
    return Built(
        no_dropout(model).train(),
        classify,
        qk,
        {"before": "qkv", "after": "proj"},  # of the second module, an MHSA
        atol=3e-7,
        kappa_atol=2e-8,
        stats_refused=refused,
    )

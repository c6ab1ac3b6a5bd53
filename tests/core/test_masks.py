"""Additive masks a module adds to its own logits, seen by the interception (docs/metrics.md,
"Masked keys"), and what is refused by name: heads mixed before the softmax, attention over
channels, leading window dims folded into the batch.

References are float64 math on each module's own weights and inputs, written here.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from qkmonitor.engine import AttentionEntropy, Monitoring, QKSpectrum
from qkmonitor.output.sinks import MemorySink

D, H, T, B = 16, 4, 8, 2
MASK_FLOOR = -80.0  # docs/metrics.md, "Masked keys"
UNMASKED = "no additive mask seen in its forward"  # the capture's warning


def region_mask(fill: float) -> torch.Tensor:
    """(T, T) 0/``fill``: the first half of the tokens and the second may not see each other
    (a shifted window's regions)."""
    half = torch.arange(T) < T // 2
    return torch.where(half[:, None] == half[None, :], 0.0, fill)


class ScoresAttention(nn.Module):
    """Separate q/k/v Linears and an explicit softmax over logits it builds itself, adding a
    shifted-window-like mask in one of several ways (``how``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.q, self.k, self.v, self.proj = (nn.Linear(D, D) for _ in range(4))
        self.num_heads, self.how = H, how
        self.register_buffer("mask", region_mask(-100.0))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k = (p(x).view(b, t, H, D // H).transpose(1, 2) for p in (self.q, self.k))
        return (q @ k.transpose(-2, -1)) / math.sqrt(D // H)  # (B, H, T, T)

    def forward(self, x):
        b, t, _ = x.shape
        s = self.logits(x)
        if self.how == "twice":  # HF Swinv2: added twice, through a 5-D view, then viewed back
            s = s.view(b, 1, H, t, t) + self.mask[None, None, None]
            s = s + self.mask[None, None, None]
            s = s.view(b, H, t, t)
        elif self.how == "in_place":
            s += self.mask
        elif self.how == "filled":
            s = s.masked_fill(self.mask < 0, -1e4)
        elif self.how == "untraced":  # a mask no add or fill carries: its -200 is not read
            s = torch.where(self.mask < 0, s - 200.0, s)
        v = self.v(x).view(b, t, H, D // H).transpose(1, 2)
        y = F.softmax(s, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, D))


def step(model, *inputs, steps: int = 1):
    """Monitored steps; the warnings they gave."""
    spectrum, entropy = QKSpectrum(per_head=True), AttentionEntropy(per_head=True)
    monitoring = Monitoring(model, [spectrum, entropy], writer=MemorySink(), every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for i in range(steps):
                with monitoring.step(i):
                    model(*inputs).float().pow(2).mean().backward()
        finally:
            monitoring.close()
    return spectrum, entropy, [str(w.message) for w in caught]


def statistics(s: torch.Tensor, allowed: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per head, from float64 logits (B, H, N, M) and the keys each row may attend."""
    p = s.masked_fill(~allowed, -math.inf).softmax(-1)
    plogp = torch.where(p > 0, p * p.clamp_min(1e-300).log(), 0.0)
    n = allowed.sum(-1).double()
    return {
        "entropy_norm": (-plogp.sum(-1) / n.log()).mean(dim=(0, 2)),
        "max_prob": p.amax(-1).mean(dim=(0, 2)),
    }


def sharp(module: nn.Module, factor: float = 4.0) -> nn.Module:
    with torch.no_grad():
        for name in ("q", "k"):
            getattr(module, name).weight.mul_(factor)
    return module


@pytest.mark.parametrize("how", ["twice", "in_place", "filled"])
def test_a_mask_the_module_adds_to_its_logits_blocks_its_keys(how):
    torch.manual_seed(0)
    model = sharp(ScoresAttention(how))
    x = torch.randn(B, T, D)
    _, entropy, said = step(model, x)
    with torch.no_grad():
        s = model.logits(x).double()
    allowed = (region_mask(-100.0) > MASK_FLOOR).expand_as(s)  # the mask's keys blocked
    reference = statistics(s, allowed)
    for metric in ("entropy_norm", "max_prob"):
        assert_close(entropy.latest[metric][0].double(), reference[metric], rtol=0, atol=3e-7)
    assert not [m for m in said if UNMASKED in m]


def test_logits_no_seen_mask_explains_count_as_keys_and_are_named_once():
    """A -200 the capture cannot link to a mask: counted as keys (the documented rule), and one
    warning over two probes names the layer, the lowest value and the rule."""
    torch.manual_seed(0)
    model = nn.Sequential(sharp(ScoresAttention("untraced")))
    x = torch.randn(B, T, D)
    _, entropy, said = step(model, x, steps=2)
    with torch.no_grad():
        s = model[0].logits(x).double()
        s = torch.where(region_mask(-200.0) < 0, s - 200.0, s)
    lowest = float(s[s <= MASK_FLOOR].min())
    reference = statistics(s, torch.ones_like(s, dtype=torch.bool))  # every key counted
    for metric in ("entropy_norm", "max_prob"):
        assert_close(entropy.latest[metric][0].double(), reference[metric], rtol=0, atol=3e-7)
    named = [m for m in said if UNMASKED in m]
    assert len(named) == 1, said
    assert "layer '0'" in named[0] and f"{lowest:.4g}" in named[0]
    assert "counted as keys" in named[0] and "attn_mask" in named[0]


class Talking(nn.Module):
    """Talking heads (timm CaiT's TalkingHeadAttn, reduced): heads mixed by a Linear before the
    softmax and after it."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.proj_l, self.proj_w = nn.Linear(H, H), nn.Linear(H, H)
        self.num_heads = H

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)
        a = (q * (D // H) ** -0.5) @ k.transpose(-2, -1)
        a = self.proj_l(a.permute(0, 2, 3, 1)).permute(0, 3, 1, 2).softmax(-1)
        a = self.proj_w(a.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.proj((a @ v).transpose(1, 2).reshape(b, t, D))


def test_heads_mixed_before_the_softmax_keep_kappa_and_refuse_statistics_by_name():
    torch.manual_seed(0)
    model = nn.Sequential(Talking(), ScoresAttention("none"))
    spectrum, entropy, said = step(model, torch.randn(B, T, D))
    w = model[0].qkv.weight.detach().double()
    wq, wk = (w[i * D : (i + 1) * D].view(H, D // H, D) for i in (0, 1))
    sigma = torch.linalg.svdvals(wq.transpose(1, 2) @ wk)  # W_Q^h W_K^hᵀ, (H, D, D)
    assert_close(
        spectrum.latest["kappa"][0].double(), sigma[:, 0] / sigma.sum(-1), rtol=0, atol=1e-7
    )
    assert torch.isnan(entropy.latest["entropy_norm"][0]).all()
    assert any("layer '0'" in m and "mixes its heads' logits" in m for m in said), said


class CrossCovariance(nn.Module):
    """timm XCiT's XCA, reduced: q·kᵀ over the tokens, a softmax over each head's channels."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.num_heads = H

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, H, D // H).permute(2, 0, 3, 4, 1)
        a = (F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)).softmax(-1)
        return self.proj((a @ v).permute(0, 3, 1, 2).reshape(b, t, D))


def test_attention_over_channels_is_refused_by_name_with_its_reason():
    """κ and the statistics of cross-covariance attention are NaN, each with a warning naming the
    layer and why; the ordinary layer beside it is measured."""
    torch.manual_seed(0)
    model = nn.Sequential(CrossCovariance(), ScoresAttention("none"))
    spectrum, entropy, said = step(model, torch.randn(B, T, D))
    assert torch.isnan(spectrum.latest["kappa"][0]).all()
    assert torch.isnan(entropy.latest["entropy_norm"][0]).all()
    assert any("'0'" in m and "no W_QK over tokens" in m for m in said), said
    assert any("'0'" in m and "softmax is over channels, not tokens" in m for m in said), said
    assert torch.isfinite(spectrum.latest["kappa"][1]).all()
    assert torch.isfinite(entropy.latest["entropy_norm"][1]).all()
    assert not [m for m in said if UNMASKED in m]


class Windows(nn.Module):
    """timm Twins' LocallyGroupedAttn, reduced: SDPA (or q @ kᵀ and a softmax) on
    (B, windows, H, ws, d) queries."""

    def __init__(self, flash: bool) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.num_heads, self.flash = H, flash

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(x.view(b, WINDOWS, t // WINDOWS, D))
        q, k, v = qkv.reshape(b, WINDOWS, t // WINDOWS, 3, H, D // H).permute(3, 0, 1, 4, 2, 5)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v)
        else:
            y = (q @ k.transpose(-2, -1) * (D // H) ** -0.5).softmax(-1) @ v
        return self.proj(y.transpose(2, 3).reshape(b, t, D))


WINDOWS = 2


@pytest.mark.parametrize("flash", [True, False])
def test_windows_before_the_heads_are_sequences_of_their_own(flash):
    """q of (B, windows, H, ws, d): each window an attention problem of its own, measured
    exactly, and the layout checked through the 4-D projection input."""
    torch.manual_seed(0)
    model = sharp_qkv(nn.Sequential(Windows(flash)))
    x = torch.randn(B, T, D)
    spectrum, entropy, said = step(model, x)
    w = model[0].qkv.weight.detach().double()
    b = model[0].qkv.bias.detach().double()
    xw = x.double().view(B * WINDOWS, T // WINDOWS, D)
    q, k = (
        (xw @ w[i * D : (i + 1) * D].T + b[i * D : (i + 1) * D])
        .view(B * WINDOWS, T // WINDOWS, H, D // H)
        .transpose(1, 2)
        for i in (0, 1)
    )
    s = q @ k.transpose(-2, -1) / math.sqrt(D // H)
    reference = statistics(s, torch.ones_like(s, dtype=torch.bool))
    for metric in ("entropy_norm", "max_prob"):
        assert_close(entropy.latest[metric][0].double(), reference[metric], rtol=0, atol=3e-7)
    wq, wk = (w[i * D : (i + 1) * D].view(H, D // H, D) for i in (0, 1))
    sigma = torch.linalg.svdvals(wq.transpose(1, 2) @ wk)
    assert_close(
        spectrum.latest["kappa"][0].double(), sigma[:, 0] / sigma.sum(-1), rtol=0, atol=1e-7
    )
    assert not said or all("qkmonitor" not in m or "no optimizer step" in m for m in said), said


def sharp_qkv(model: nn.Module, factor: float = 4.0) -> nn.Module:
    with torch.no_grad():
        model[0].qkv.weight[: 2 * D].mul_(factor)
    return model


class Mixing(nn.Module):
    """Scaled q·kᵀ (a matmul, or an einsum as x-transformers' scores) through an op over the
    heads before the softmax (issue 59): one that mixes them (an einsum over the head index, a
    1×1 convolution over the heads, as EfficientFormerV2's talking heads), or one that keeps
    each head its own (a gain per head, by einsum or a grouped convolution)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.q, self.k, self.v, self.proj = (nn.Linear(D, D) for _ in range(4))
        self.num_heads, self.how = H, how
        self.mix = nn.Parameter(torch.eye(H) + 0.5 * torch.randn(H, H))
        self.gain = nn.Parameter(torch.rand(H) + 0.5)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The logits the op gets: (B, H, T, T), the scale after the product."""
        b, t, _ = x.shape
        q, k = (p(x).view(b, t, H, D // H).transpose(1, 2) for p in (self.q, self.k))
        if self.how.startswith("einsum"):
            s = torch.einsum("bhid,bhjd->bhij", q, k)
        else:
            s = q @ k.transpose(-2, -1)
        return s * (D // H) ** -0.5

    def op(self, s: torch.Tensor) -> torch.Tensor:
        mix, gain = self.mix.to(s.dtype), self.gain.to(s.dtype)
        if self.how == "einsum-mix":
            return torch.einsum("bhij,hg->bgij", s, mix)
        if self.how == "einsum-gain":
            return torch.einsum("bhij,h->bhij", s, gain)
        if self.how == "conv-mix":
            return F.conv2d(s, mix.T[:, :, None, None])
        return F.conv2d(s, gain[:, None, None, None], groups=H)  # conv-gain

    def forward(self, x):
        b, t, _ = x.shape
        v = self.v(x).view(b, t, H, D // H).transpose(1, 2)
        y = self.op(self.logits(x)).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, D))


def qk_sigma(module: nn.Module) -> torch.Tensor:
    """(H, D) singular values of each head's W_Q^h W_K^hᵀ (separate q/k Linears), float64."""
    wq, wk = (p.weight.detach().double().view(H, D // H, D) for p in (module.q, module.k))
    return torch.linalg.svdvals(wq.transpose(1, 2) @ wk)


@pytest.mark.parametrize("how", ["einsum-mix", "conv-mix"])
def test_heads_mixed_by_an_einsum_or_a_convolution_are_refused_by_name(how):
    """Issue 59: an einsum over the head index and a 1×1 convolution over the heads of scaled
    q·kᵀ (not the product itself, as CaiT's proj_l gets it) refuse the statistics by name; κ and
    qk_spectral_norm (σ₁ · the factor on q·kᵀ before the mixing) are read. The old capture
    measured these heads as if each were its own."""
    torch.manual_seed(0)
    model = nn.Sequential(sharp(Mixing(how)), sharp(ScoresAttention("none")))
    spectrum, entropy, said = step(model, torch.randn(B, T, D))
    for metric in ("entropy_norm", "max_prob", "max_logit"):
        assert torch.isnan(entropy.latest[metric][0]).all(), (metric, entropy.latest[metric][0])
    what = "an einsum that sums over the 4 heads" if how == "einsum-mix" else "a convolution"
    named = [m for m in said if "layer '0'" in m and "mixes its heads' logits" in m]
    assert len(named) == 1 and what in named[0], said
    sigma = qk_sigma(model[0])
    assert_close(
        spectrum.latest["kappa"][0].double(), sigma[:, 0] / sigma.sum(-1), rtol=0, atol=1e-7
    )
    assert_close(
        spectrum.latest["qk_spectral_norm"][0].double(),
        sigma[:, 0] * (D // H) ** -0.5,
        rtol=1e-5,
        atol=0,
    )
    assert torch.isfinite(entropy.latest["entropy_norm"][1]).all()


@pytest.mark.parametrize("how", ["einsum-gain", "conv-gain"])
def test_an_op_over_the_heads_that_keeps_each_its_own_is_measured(how):
    """A gain per head (an einsum that keeps the head index, a convolution grouped by head)
    mixes nothing: measured exactly, against the float64 logits the softmax gets."""
    torch.manual_seed(0)
    model = nn.Sequential(sharp(Mixing(how)))
    x = torch.randn(B, T, D)
    _, entropy, said = step(model, x)
    with torch.no_grad():
        s = model[0].op(model[0].logits(x).double())
    reference = statistics(s, torch.ones_like(s, dtype=torch.bool))
    for metric in ("entropy_norm", "max_prob"):
        assert_close(entropy.latest[metric][0].double(), reference[metric], rtol=0, atol=3e-7)
    assert_close(
        entropy.latest["max_logit"][0].double(), s.amax(dim=(0, 2, 3)), rtol=1e-5, atol=1e-6
    )
    assert not [m for m in said if "mixes its heads" in m], said


class Blocks(nn.Module):
    """timm NesT's Attention, reduced: q/k of (B, H, T, N, d), the heads before T image blocks,
    here as many blocks as heads; ``contiguous``: q and k copied in that order (no stride tells
    the heads from the blocks then)."""

    def __init__(self, contiguous: bool) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.num_heads, self.contiguous = H, contiguous

    def qkv_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, t, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, t, n, 3, H, D // H).permute(3, 0, 4, 1, 2, 5)
        return qkv.unbind(0)

    def forward(self, x):
        q, k, v = self.qkv_heads(x)
        if self.contiguous:
            q, k = q.contiguous(), k.contiguous()
        y = F.scaled_dot_product_attention(q, k, v)  # (B, H, T, N, d)
        return self.proj(y.permute(0, 2, 3, 1, 4).flatten(-2)).flatten(1, 2)  # (B, T·N, D)


@pytest.mark.parametrize("contiguous", [False, True])
def test_as_many_blocks_as_heads_are_told_apart_by_strides_or_refused_by_name(contiguous):
    """Issue 59: NesT-like (B, H, T, N, d) queries with T = H. Viewed from the projection, the
    heads are the dim cut from a token's features: measured exactly, per head; copied
    contiguous, nothing tells the two dims apart: refused by name (statistics and κ)."""
    torch.manual_seed(0)
    model = nn.Sequential(Blocks(contiguous), ScoresAttention("none"))
    with torch.no_grad():
        model[0].qkv.weight[: 2 * D].mul_(4.0)
    x = torch.randn(B, H, 4, D)  # T = H blocks of 4 tokens
    spectrum, entropy, said = step(model, x)
    if contiguous:
        assert torch.isnan(entropy.latest["entropy_norm"][0]).all()
        assert torch.isnan(spectrum.latest["kappa"][0]).all()
        named = [m for m in said if "layer '0'" in m and "strides do not tell" in m]
        assert named, said
        return
    with torch.no_grad():
        q, k, _ = (t.double() for t in model[0].qkv_heads(x))
    s = (q @ k.transpose(-2, -1) / math.sqrt(D // H)).movedim(1, 2).flatten(0, 1)
    reference = statistics(s, torch.ones_like(s, dtype=torch.bool))
    for metric in ("entropy_norm", "max_prob"):
        assert_close(entropy.latest[metric][0].double(), reference[metric], rtol=0, atol=3e-7)
    assert_close(
        entropy.latest["max_logit"][0].double(), s.amax(dim=(0, 2, 3)), rtol=1e-5, atol=1e-6
    )
    w = model[0].qkv.weight.detach().double()
    wq, wk = (w[i * D : (i + 1) * D].view(H, D // H, D) for i in (0, 1))
    sigma = torch.linalg.svdvals(wq.transpose(1, 2) @ wk)
    assert_close(
        spectrum.latest["kappa"][0].double(), sigma[:, 0] / sigma.sum(-1), rtol=0, atol=1e-7
    )

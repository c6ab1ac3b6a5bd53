"""qk_spectral_norm (σ₁ · scale) of intercepted attention, wherever a module puts its logit scale.

The scale that matters is the factor between the projections' ``q·kᵀ`` and the logits the
softmax gets: on q before the product (timm's ``fused_attn=False``), on the product after it, as
d^-1/4 on both q and k, none at all (1), or SDPA's own. Each plain-torch module below is measured
with no user code and compared with σ₁(W_Q^h W_K^hᵀ) · its true scale in float64; where the
logits are not a scaled ``q·kᵀ`` (plus a bias the same over the batch), the metric is refused by
name (NaN, κ still read) rather than guessed.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkmonitor.engine import Monitoring, QKSpectrum
from qkmonitor.output.sinks import MemorySink

DIM, HEADS, HEAD_DIM, SEQ, BATCH = 32, 4, 8, 6, 3


class PlacedScaleAttention(nn.Module):
    """timm-style attention (fused ``qkv`` rows ``[3, H, d_k]``) with its logit scale placed as
    ``placement`` says; ``scale`` is the module's attribute (timm's), whatever it applies."""

    def __init__(self, placement: str) -> None:
        super().__init__()
        self.num_heads, self.head_dim = HEADS, HEAD_DIM
        self.scale = HEAD_DIM**-0.5
        self.placement = placement
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.rel_bias = nn.Parameter(torch.randn(HEADS, SEQ, SEQ))
        self.proj_l = nn.Linear(HEADS, HEADS)  # talking heads (CaiT's), where the placement mixes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        placement = self.placement
        if placement == "sdpa-q":  # q pre-scaled, SDPA told scale 1
            out = F.scaled_dot_product_attention(q * self.scale, k, v, scale=1.0)
        else:
            if placement in ("q", "q-bias", "talking"):
                q = q * self.scale
            elif placement == "both":
                q, k = q * HEAD_DIM**-0.25, k * HEAD_DIM**-0.25
            attn = q @ k.transpose(-2, -1)
            if placement in ("product", "softcap", "talking-softcap", "talking-bias"):
                attn = attn * self.scale
            if placement in ("inplace", "talking-inplace"):
                attn.mul_(self.scale)
            if placement == "talking-softcap":  # no multiple of q·kᵀ when the heads are mixed
                attn = 2.0 * torch.tanh(attn / 2.0)
            if placement == "talking-bias":
                attn = attn + self.rel_bias
            if placement.startswith("talking"):
                attn = self.proj_l(attn.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
            if placement == "q-bias":
                attn = attn + self.rel_bias
            if placement == "softcap":
                attn = 2.0 * torch.tanh(attn / 2.0)
            out = attn.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, n, DIM))


class Model(nn.Module):
    def __init__(self, placement: str) -> None:
        super().__init__()
        self.attn = PlacedScaleAttention(placement)
        with torch.no_grad():
            self.attn.qkv.weight[: 2 * DIM] *= 3.0  # sharper heads: logits of order 1 and more

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


#: placement -> the true factor between the projections' q·kᵀ and the softmax's logits
TRUE_SCALE = {
    "q": HEAD_DIM**-0.5,
    "product": HEAD_DIM**-0.5,
    "both": HEAD_DIM**-0.5,
    "none": 1.0,
    "q-bias": HEAD_DIM**-0.5,
    "sdpa-q": HEAD_DIM**-0.5,
    "inplace": HEAD_DIM**-0.5,
    # heads mixed before the softmax: the factor on each head's own q·kᵀ before the mixing,
    # measured between the product and the logits the mixing op got (issue 59: not only where
    # it mixes the product as the matmul gave it)
    "talking": HEAD_DIM**-0.5,
    "talking-inplace": HEAD_DIM**-0.5,
    "talking-bias": HEAD_DIM**-0.5,
}


def measured(placement: str, batch: int = BATCH) -> tuple[Model, QKSpectrum, list[str]]:
    torch.manual_seed(0)
    model = Model(placement)
    x = torch.randn(batch, SEQ, DIM)
    spectrum = QKSpectrum(per_head=True)
    monitoring = Monitoring(model, [spectrum], writer=MemorySink(), every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with monitoring.step(0):
                model(x).square().mean().backward()
        finally:
            monitoring.close()
    return model, spectrum, [str(w.message) for w in caught]


def sigma_1(model: Model) -> torch.Tensor:
    """σ₁ of each head's W_Q^h (W_K^h)ᵀ in float64 (``nn.Linear`` rows ``[q | k | v]``)."""
    w = model.attn.qkv.weight.detach().double()
    wq = w[:DIM].view(HEADS, HEAD_DIM, DIM).transpose(1, 2)
    wk = w[DIM : 2 * DIM].view(HEADS, HEAD_DIM, DIM).transpose(1, 2)
    return torch.linalg.svdvals(wq @ wk.transpose(-1, -2))[:, 0]


def kappa(model: Model) -> torch.Tensor:
    w = model.attn.qkv.weight.detach().double()
    wq = w[:DIM].view(HEADS, HEAD_DIM, DIM).transpose(1, 2)
    wk = w[DIM : 2 * DIM].view(HEADS, HEAD_DIM, DIM).transpose(1, 2)
    sigma = torch.linalg.svdvals(wq @ wk.transpose(-1, -2))
    return sigma[:, 0] / sigma.sum(-1)


@pytest.mark.parametrize("placement", list(TRUE_SCALE))
def test_qk_spectral_norm_is_sigma_1_times_the_scale_wherever_the_module_applies_it(placement):
    model, spectrum, said = measured(placement)
    assert not [m for m in said if "qk_spectral_norm" in m or "non-finite" in m], said
    torch.testing.assert_close(
        spectrum.latest["qk_spectral_norm"][0].double(),
        sigma_1(model) * TRUE_SCALE[placement],
        rtol=1e-5,
        atol=0,
    )
    torch.testing.assert_close(  # κ is scale-free: the same whatever the placement
        spectrum.latest["kappa"][0].double(), kappa(model), rtol=1e-5, atol=1e-7
    )


def test_a_position_bias_with_one_sequence_leaves_the_scale_unknown_and_refused_by_name():
    """One sequence and a bias of each head's own: the logits do not tell the factor on q·kᵀ from
    the bias (no second batch element to take the bias out), so qk_spectral_norm is NaN with a
    warning naming the layer; κ is read."""
    model, spectrum, said = measured("q-bias", batch=1)
    assert torch.isnan(spectrum.latest["qk_spectral_norm"][0]).all()
    assert any(
        "'attn'" in m and re.search(r"not known .*qk_spectral_norm.* is NaN", m) for m in said
    ), said
    torch.testing.assert_close(
        spectrum.latest["kappa"][0].double(), kappa(model), rtol=1e-5, atol=1e-7
    )


def test_soft_capped_logits_refuse_the_spectral_norm_by_name():
    """``cap · tanh(s q·kᵀ / cap)`` is no multiple of q·kᵀ: the scale is not guessed."""
    model, spectrum, said = measured("softcap")
    assert torch.isnan(spectrum.latest["qk_spectral_norm"][0]).all()
    assert any("'attn'" in m and "qk_spectral_norm" in m for m in said), said
    # the refusal is the one word on it: a refused scale is undefined, not a broken weight
    assert not [m for m in said if "non-finite" in m], said
    torch.testing.assert_close(
        spectrum.latest["kappa"][0].double(), kappa(model), rtol=1e-5, atol=1e-7
    )


def test_heads_mixed_from_logits_no_multiple_of_q_k_refuse_the_spectral_norm_by_name():
    """Soft-capped logits, then talking heads: what the heads are mixed from is no multiple of
    q·kᵀ and no softmax shows the factor, so it is not guessed (NaN, named); κ is read."""
    model, spectrum, said = measured("talking-softcap")
    assert torch.isnan(spectrum.latest["qk_spectral_norm"][0]).all()
    assert any(
        "'attn'" in m and "mixed from logits not a multiple of its q·kᵀ" in m for m in said
    ), said
    torch.testing.assert_close(
        spectrum.latest["kappa"][0].double(), kappa(model), rtol=1e-5, atol=1e-7
    )

"""Multi-head latent attention outside Hugging Face: a user's module of DeepSeek's structure, found
with no code (DeepSeek's own names) or through an AttentionSpec (names of its own), measured
against float64 math written here from the module's weights."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import qkmonitor
from qkmonitor import AttentionSpec, LatentNames, register_attention
from qkmonitor.attention.registry import unregister_family
from qkmonitor.engine import AttentionEntropy, Monitoring, QKSpectrum
from qkmonitor.output.sinks import MemorySink

D, H, NOPE, ROPE, VALUE, RANK, Q_RANK, T = 32, 4, 6, 4, 5, 12, 8, 10


def rotate(x: torch.Tensor) -> torch.Tensor:
    """RoPE on the last dim of (B, H, T, d_r), half-split pairs, base 10000."""
    t = torch.arange(x.shape[-2], dtype=torch.float64)
    freqs = 10000.0 ** (-torch.arange(0, x.shape[-1], 2, dtype=torch.float64) / x.shape[-1])
    angle = (t[:, None] * freqs[None]).to(x.dtype)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class MLA(nn.Module):
    """DeepSeek-V3's latent attention as its own inference code names it (``wq_a``, ``q_norm``,
    ``wq_b``, ``wkv_a``, ``kv_norm``, ``wkv_b``), in plain torch with SDPA; ``names`` renames the
    projections (an AttentionSpec's case)."""

    def __init__(self, factored: bool = True, names: dict | None = None) -> None:
        super().__init__()
        self.names = names = names or {}
        self.n_heads, self.qk_rope_head_dim, self.kv_lora_rank = H, ROPE, RANK
        self.factored = factored
        if factored:
            setattr(self, names.get("wq_a", "wq_a"), nn.Linear(D, Q_RANK))
            setattr(self, names.get("q_norm", "q_norm"), nn.RMSNorm(Q_RANK))
            setattr(self, names.get("wq_b", "wq_b"), nn.Linear(Q_RANK, H * (NOPE + ROPE)))
        else:
            setattr(self, names.get("wq", "wq"), nn.Linear(D, H * (NOPE + ROPE)))
        setattr(self, names.get("wkv_a", "wkv_a"), nn.Linear(D, RANK + ROPE))
        setattr(self, names.get("kv_norm", "kv_norm"), nn.RMSNorm(RANK))
        setattr(self, names.get("wkv_b", "wkv_b"), nn.Linear(RANK, H * (NOPE + VALUE)))
        self.wo = nn.Linear(H * VALUE, D)

    def part(self, name: str) -> nn.Module:
        return getattr(self, self.names.get(name, name))

    def qk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        if self.factored:
            q = self.part("wq_b")(self.part("q_norm")(self.part("wq_a")(x)))
        else:
            q = self.part("wq")(x)
        q = q.view(b, t, H, NOPE + ROPE).transpose(1, 2)
        latent, k_rot = self.part("wkv_a")(x).split([RANK, ROPE], -1)
        kv = self.part("wkv_b")(self.part("kv_norm")(latent)).view(b, t, H, NOPE + VALUE)
        k_nope, v = kv.transpose(1, 2).split([NOPE, VALUE], -1)
        q = torch.cat([q[..., :NOPE], rotate(q[..., NOPE:])], -1)
        k_rot = rotate(k_rot[:, None]).expand(b, H, t, ROPE)  # one rotary key for every head
        return q, torch.cat([k_nope, k_rot], -1), v

    def forward(self, x):
        q, k, v = self.qk(x)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).flatten(2))


def _attend_elsewhere(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    b, t, _ = x.shape
    q = block.b(block.a(x)).view(b, t, H, -1).transpose(1, 2)
    latent, k_rot = block.d(x).split([RANK, ROPE], -1)
    k_nope, v = block.f(latent).view(b, t, H, -1).transpose(1, 2).split([NOPE, VALUE], -1)
    k = torch.cat([k_nope, k_rot[:, None].expand(b, H, t, ROPE)], -1)
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)


class Model(nn.Module):
    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, D)
        self.blocks = nn.ModuleList(blocks)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return x


def sharpened(model: nn.Module) -> nn.Module:
    """Weights large enough for the heads to differ, and the norms' weights away from 1 (so that
    diag(g) counts in W_QK)."""
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + 1.5 * torch.rand(p.shape, generator=gen))
            elif name.endswith("weight") and "embed" not in name:
                p.mul_(2.0)
    return model


def kappa_reference(block: MLA) -> torch.Tensor:
    """κ per head from the dense float64 d×d W_QK^h = W_Q^h^T W_K^h, written from the weights."""
    w = {name: block.part(name) for name in ("wkv_a", "kv_norm", "wkv_b")}
    if block.factored:
        g_q = torch.diag(block.part("q_norm").weight.double())
        w_q = block.part("wq_b").weight.double() @ g_q @ block.part("wq_a").weight.double()
    else:
        w_q = block.part("wq").weight.double()
    kv_a = w["wkv_a"].weight.double()
    kv_b = w["wkv_b"].weight.double().view(H, NOPE + VALUE, RANK)[:, :NOPE]
    k_nope = kv_b @ torch.diag(w["kv_norm"].weight.double()) @ kv_a[:RANK]
    w_k = torch.cat([k_nope, kv_a[RANK:].expand(H, ROPE, D)], 1)  # (H, d_n + d_r, D)
    out = []
    for h in range(H):
        w_qh = w_q[h * (NOPE + ROPE) : (h + 1) * (NOPE + ROPE)]
        s = torch.linalg.svdvals(w_qh.T @ w_k[h])
        out.append(s[0] / s.sum())
    return torch.stack(out)


def entropy_reference(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = q.double(), k.double()
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    attended = allowed.sum(-1).double()
    rows = attended > 1
    return (entropy[..., rows] / attended[rows].log()).mean(dim=(0, 2)), p.amax(-1).mean(dim=(0, 2))


def measure(model: Model):
    spectrum, entropy = QKSpectrum(per_head=True), AttentionEntropy(per_head=True)
    tokens = torch.randint(0, 20, (2, T), generator=torch.Generator().manual_seed(1))
    seen = {}

    def keep_qk(module, args, output) -> None:  # the reference's own q and k, the module's code
        with torch.no_grad():
            seen.setdefault(module, module.qk(args[0]))

    handles = [block.register_forward_hook(keep_qk) for block in model.blocks]
    monitoring = Monitoring(model, [spectrum, entropy], writer=MemorySink(), every_n_steps=1)
    with monitoring.step(0):
        model(tokens).sum().backward()
    monitoring.close()
    for handle in handles:
        handle.remove()
    return spectrum, entropy, seen


@pytest.mark.parametrize("factored", [True, False], ids=["q-factored", "q-single"])
def test_deepseeks_own_latent_attention_is_found_and_measured_against_float64(factored, leftovers):
    torch.manual_seed(0)
    model = sharpened(Model(MLA(factored), MLA(factored)))
    spectrum, entropy, seen = measure(model)
    assert all(layer.kind.endswith(".MLA") for layer in spectrum.layers)  # found by its names
    for i, block in enumerate(model.blocks):
        assert_close(
            spectrum.latest["kappa"][i].double(), kappa_reference(block), rtol=1e-5, atol=1e-7
        )
        q, k, _ = seen[block]
        norm, max_prob = entropy_reference(q.detach(), k.detach())
        assert_close(entropy.latest["entropy_norm"][i].double(), norm, rtol=0, atol=2e-6)
        assert_close(entropy.latest["max_prob"][i].double(), max_prob, rtol=0, atol=2e-6)
        assert 0.1 < float(norm.mean()) < 0.95  # sharpened: not a near-uniform comparison
    assert leftovers(model) == []


def test_a_latent_attention_of_other_names_is_measured_through_an_attention_spec():
    names = {
        "wq_a": "q_down",
        "q_norm": "q_ln",
        "wq_b": "q_up",
        "wkv_a": "kv_down",
        "kv_norm": "kv_ln",
        "wkv_b": "kv_up",
    }

    class Latent(MLA):
        pass

    torch.manual_seed(0)
    model = sharpened(Model(Latent(names=names)))
    spec = AttentionSpec(
        match=Latent,
        latent=LatentNames(
            kv_down="kv_down",
            kv_up="kv_up",
            kv_norm="kv_ln",
            q=None,
            q_down="q_down",
            q_norm="q_ln",
            q_up="q_up",
            num_heads=H,
            rope_dim=ROPE,
        ),
    )
    register_attention(spec)
    try:
        spectrum, _, _ = measure(model)
    finally:
        unregister_family(spec.family)
    assert [layer.kind for layer in spectrum.layers] == ["spec:Latent"]
    assert_close(
        spectrum.latest["kappa"][0].double(),
        kappa_reference(model.blocks[0]),
        rtol=1e-5,
        atol=1e-7,
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(latent="kv_b_proj"), "`latent` to be a qkmonitor.attention.latent.LatentNames"),
        (dict(latent=qkmonitor.LatentNames("a", "b", None, "q", None, None, None), q="q"), "both"),
    ],
)
def test_a_bad_latent_spec_is_named(kwargs, message):
    with pytest.raises(ValueError, match=None) as info:
        AttentionSpec(match=MLA, **kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (
            dict(kv_down="", kv_up="b", kv_norm=None, q="q", q_down=None, q_norm=None, q_up=None),
            "kv_down",
        ),
        (
            dict(kv_down="a", kv_up="b", kv_norm=None, q=None, q_down="x", q_norm=None, q_up=None),
            "q_down",
        ),
        (
            dict(
                kv_down="a",
                kv_up="b",
                kv_norm=None,
                q="q",
                q_down=None,
                q_norm=None,
                q_up=None,
                num_heads=0,
            ),
            "num_heads",
        ),
    ],
)
def test_bad_latent_names_are_named(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        LatentNames(**kwargs)


def test_a_spec_whose_latent_names_do_not_fit_the_module_says_so():
    spec = AttentionSpec(
        match=MLA,
        latent=LatentNames("kv_down", "kv_up", None, "q", None, None, None, num_heads=H),
    )
    with pytest.raises(ValueError, match="`latent`: MLA has no latent projections 'kv_down'"):
        spec.layout(MLA())


def test_a_latent_attention_of_unknown_names_is_named_in_the_error():
    """Found by nothing (its projections have names of its own): the error names the module that
    looks like attention and was passed over, and the spec to describe it."""

    class RenamedAttention(nn.Module):  # its attention call is in a function of another module
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(D, Q_RANK), nn.Linear(Q_RANK, H * (NOPE + ROPE))
            self.d, self.f = nn.Linear(D, RANK + ROPE), nn.Linear(RANK, H * (NOPE + VALUE))

        def forward(self, x):
            return _attend_elsewhere(self, x)

    model = Model(RenamedAttention())
    with pytest.raises(ValueError, match="No attention layers found in Model") as info:
        qkmonitor.find_attention_layers(model)
    assert "Passed over, though they look like attention: 'blocks.0' (RenamedAttention)" in str(
        info.value
    )
    assert "AttentionSpec" in str(info.value)

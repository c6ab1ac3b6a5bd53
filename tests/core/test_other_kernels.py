"""Attention through kernels other than SDPA and a (B, H, N, M) softmax: ``flex_attention`` (its
score_mod and block mask), a softmax over (B·H, N, M) or (B, N, H, M) logits; and what a user is
told when a forward runs a call qkmonitor cannot read.

References are float64 math written here from the modules' own weights and inputs: the masks from
the mask functions on index grids, the score mods applied to the scores directly.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from qkmonitor.engine import AttentionEntropy, Monitoring, QKSpectrum
from qkmonitor.output.sinks import MemorySink

flex_module = pytest.importorskip("torch.nn.attention.flex_attention")
flex_attention, create_block_mask = flex_module.flex_attention, flex_module.create_block_mask

D, H, T, B = 16, 4, 12, 2
WINDOW = 4


def causal_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)


def soft_cap(score, b, h, q_idx, kv_idx):
    return 2.0 * torch.tanh(score / 2.0)


def head_bias(score, b, h, q_idx, kv_idx):
    return score - 0.25 * h * (q_idx - kv_idx).abs()


class FlexAttention(nn.Module):
    """A module calling flex_attention as its code imports it (a name in this file's globals)."""

    def __init__(self, score_mod=None, mask_mod=None, kv_heads: int = H) -> None:
        super().__init__()
        self.q_proj = nn.Linear(D, D)
        self.k_proj = nn.Linear(D, kv_heads * (D // H))
        self.v_proj = nn.Linear(D, kv_heads * (D // H))
        self.o_proj = nn.Linear(D, D)
        self.num_heads, self.num_kv_heads = H, kv_heads
        self.score_mod, self.mask_mod = score_mod, mask_mod

    def qk(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, H, -1).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, -1).transpose(1, 2)
        return q, k

    def forward(self, x):
        b, t, _ = x.shape
        q, k = self.qk(x)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, -1).transpose(1, 2)
        mask = None
        if self.mask_mod is not None:
            mask = create_block_mask(self.mask_mod, None, None, t, t, device=x.device)
        y = flex_attention(
            q,
            k,
            v,
            score_mod=self.score_mod,
            block_mask=mask,
            enable_gqa=self.num_kv_heads != H,
        )
        return self.o_proj(y.transpose(1, 2).reshape(b, t, D))


class Folded(nn.Module):
    """Heads folded into the batch: a softmax over (B·H, N, M) logits, as ``torch.bmm`` code
    (and ``nn.MultiheadAttention``'s internals) computes it."""

    def __init__(self, heads_attribute: bool = True) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, D) for _ in range(3))
        if heads_attribute:
            self.num_heads = H

    def qk(self, x):
        b, t, _ = x.shape
        q, k = (p(x).view(b, t, H, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj))
        return q, k

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, H, -1).transpose(1, 2).reshape(b * H, t, -1)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        logits = torch.einsum("bnd,bmd->bnm", q, k) / math.sqrt(D // H)
        logits = logits.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        y = torch.softmax(logits, dim=-1) @ v
        return y.view(b, H, t, -1).transpose(1, 2).reshape(b, t, D)


class HeadsThird(Folded):
    """Logits as DeepSeek's own code lays them out: ``einsum("bshd,bthd->bsht")``, heads third."""

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, H, -1) for p in (self.q_proj, self.k_proj, self.v_proj))
        logits = torch.einsum("bshd,bthd->bsht", q, k) / math.sqrt(D // H)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)[None, :, None, :]
        probs = logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
        return torch.einsum("bsht,bthd->bshd", probs, v).reshape(b, t, D)


class Model(nn.Module):
    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def sharpened(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_proj.weight" in name or "k_proj.weight" in name:
                p.mul_(4.0)
    return model


def kappa_reference(block: nn.Module) -> torch.Tensor:
    w_q, w_k = block.q_proj.weight.double(), block.k_proj.weight.double()
    d, kv = D // H, w_k.shape[0] // (D // H)
    out = []
    for h in range(H):
        g = h // (H // kv)
        s = torch.linalg.svdvals(w_q[h * d : (h + 1) * d].T @ w_k[g * d : (g + 1) * d])
        out.append(s[0] / s.sum())
    return torch.stack(out)


def entropy_reference(q, k, allowed, score_mod=None):
    """entropy_norm and max_prob per head, float64, from q (B,H,N,d), k (B,H_kv,M,d), the allowed
    keys (broadcastable to (B,H,N,M)) and a score mod applied to the scaled scores."""
    q, k = q.double(), k.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    b, h, n, m = s.shape
    if score_mod is not None:
        index = [
            torch.arange(size).view([-1 if i == axis else 1 for i in range(4)])
            for axis, size in enumerate((b, h, n, m))
        ]
        s = score_mod(s, *index)
    allowed = allowed.expand(b, h, n, m)
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    attended = allowed.sum(-1).double()
    rows = attended > 1
    norm = torch.where(rows, entropy / attended.clamp_min(2).log(), 0.0).sum((0, 2)) / rows.sum(
        (0, 2)
    )
    return norm, p.amax(-1).mean(dim=(0, 2))


def grid_mask(mask_mod, n: int) -> torch.Tensor:
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return mask_mod(None, None, i, j)[None, None]


def monitored(model: Model, x: torch.Tensor, grad: bool):
    spectrum, entropy = QKSpectrum(per_head=True), AttentionEntropy(per_head=True)
    seen = {}

    def keep_qk(module, args, output) -> None:
        with torch.no_grad():
            seen.setdefault(module, module.qk(args[0]))

    handles = [block.register_forward_hook(keep_qk) for block in model.blocks]
    monitoring = Monitoring(model, [spectrum, entropy], writer=MemorySink(), every_n_steps=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        try:
            if grad:
                with monitoring.step(0):
                    out = model(x)
                    out.sum().backward()
            else:  # flex_attention has no backward on CPU: a forward-only step
                with torch.no_grad(), monitoring.step(0):
                    out = model(x)
        finally:
            monitoring.close()
            for handle in handles:
                handle.remove()
    return spectrum, entropy, seen, out


FLEX_CASES = {
    "score_mod": dict(score_mod=soft_cap),
    "block_mask": dict(mask_mod=causal_window),
    "both-per-head": dict(score_mod=head_bias, mask_mod=causal_window),
    "gqa-block_mask": dict(mask_mod=causal_window, kv_heads=2),
}


@pytest.mark.parametrize("case", list(FLEX_CASES))
def test_flex_attention_is_measured_as_flex_computes_it(case, leftovers):
    kwargs = FLEX_CASES[case]
    torch.manual_seed(0)
    model = sharpened(Model(FlexAttention(**kwargs), FlexAttention(**kwargs)))
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        with torch.no_grad():
            expected_out = model(x)
    spectrum, entropy, seen, out = monitored(model, x, grad=False)
    assert torch.equal(out, expected_out)  # the model's own computation, untouched
    assert globals()["flex_attention"] is flex_module.flex_attention  # the names put back
    assert leftovers(model) == []
    for i, block in enumerate(model.blocks):
        q, k = seen[block]
        mask_mod = kwargs.get("mask_mod")
        allowed = grid_mask(mask_mod, T) if mask_mod else torch.ones(1, 1, T, T, dtype=torch.bool)
        norm, max_prob = entropy_reference(q, k, allowed, kwargs.get("score_mod"))
        assert_close(entropy.latest["entropy_norm"][i].double(), norm, rtol=0, atol=2e-6)
        assert_close(entropy.latest["max_prob"][i].double(), max_prob, rtol=0, atol=2e-6)
        assert 0.2 < float(norm.mean()) < 0.95  # sharpened: not a near-uniform comparison
        # the layout is checked against the call's own queries and keys, as for SDPA
        assert_close(
            spectrum.latest["kappa"][i].double(), kappa_reference(block), rtol=1e-5, atol=1e-7
        )


class FlexMixer(FlexAttention):
    """A class whose name says nothing of attention: found by its code calling flex_attention."""


def test_a_module_found_only_by_its_flex_attention_call_is_measured(leftovers):
    torch.manual_seed(0)
    model = sharpened(Model(FlexMixer(mask_mod=causal_window), FlexMixer(mask_mod=causal_window)))
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1))
    spectrum, entropy, seen, _ = monitored(model, x, grad=False)
    assert leftovers(model) == []
    allowed = grid_mask(causal_window, T)
    for i, block in enumerate(model.blocks):
        norm, _ = entropy_reference(*seen[block], allowed, None)
        assert_close(entropy.latest["entropy_norm"][i].double(), norm, rtol=0, atol=2e-6)
        assert_close(
            spectrum.latest["kappa"][i].double(), kappa_reference(block), rtol=1e-5, atol=1e-7
        )


@pytest.mark.parametrize("module", [Folded, HeadsThird], ids=["B*H,N,M", "B,N,H,M"])
def test_a_softmax_over_folded_or_reordered_heads_is_measured(module, leftovers):
    torch.manual_seed(0)
    model = sharpened(Model(module(), module()))
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1))
    spectrum, entropy, seen, _ = monitored(model, x, grad=True)
    assert leftovers(model) == []
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    for i, block in enumerate(model.blocks):
        norm, max_prob = entropy_reference(*seen[block], causal)
        assert_close(entropy.latest["entropy_norm"][i].double(), norm, rtol=0, atol=2e-6)
        assert_close(entropy.latest["max_prob"][i].double(), max_prob, rtol=0, atol=2e-6)
        assert 0.2 < float(norm.mean()) < 0.95
        assert_close(
            spectrum.latest["kappa"][i].double(), kappa_reference(block), rtol=1e-5, atol=1e-7
        )


class Unreadable(Folded):
    """Heads folded into the batch, and no head count anywhere on the module."""

    def __init__(self) -> None:
        super().__init__(heads_attribute=False)


class Skipped(Folded):
    """A layer the model holds but does not call in this forward."""


def test_a_layer_that_ran_unread_says_what_it_called_and_never_that_it_did_not_run():
    torch.manual_seed(0)
    model = Model(Folded(), Unreadable())
    model.spare = Skipped()  # found, never called
    entropy = AttentionEntropy()
    monitoring = Monitoring(model, [entropy], writer=MemorySink(), every_n_steps=1)
    x = torch.randn(B, T, D)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            with monitoring.step(step):
                model(x).sum().backward()
        monitoring.close()
    messages = [str(w.message) for w in caught]
    unread = [m for m in messages if "'blocks.1'" in m]
    assert len(unread) == 1, messages  # once per layer
    assert "ran in the probed forward, but none of its attention calls could be read" in unread[0]
    assert f"3-D tensor of shape ({B * H}, {T}, {T})" in unread[0]
    assert "names no head count" in unread[0]
    assert not any("'blocks.1' did not run" in m for m in messages)
    assert any("'spare' did not run in the probed forward" in m for m in messages)
    assert torch.isfinite(entropy.latest["entropy_norm"][0]).all()
    assert torch.isnan(entropy.latest["entropy_norm"][1]).all()


def test_a_monitor_that_can_read_none_of_its_layers_is_an_error_naming_the_calls(leftovers):
    torch.manual_seed(0)
    model = Model(Unreadable(), Unreadable())
    monitoring = Monitoring(model, [AttentionEntropy()], writer=MemorySink(), every_n_steps=1)
    none = "measures none of its 2 attention layers"
    with pytest.raises(ValueError, match=none) as info, monitoring.step(0):
        model(torch.randn(B, T, D)).sum().backward()
    monitoring.close()
    assert "'blocks.0': a softmax over the last dim of a 3-D tensor" in str(info.value)
    assert "register_attention" in str(info.value)
    assert leftovers(model) == []


def test_a_module_calling_an_unread_kernel_is_told_so():
    """A layer found by its code (its class computes a softmax) whose forward runs another
    kernel: the warning names what qkmonitor reads."""

    class CustomKernel(Folded):  # found: its class's code (Folded's) calls a softmax
        def forward(self, x):  # attention by a kernel of its own: exp and a sum
            q, k = self.qk(x)
            w = (q @ k.transpose(-1, -2)).exp()
            return x + (w / w.sum(-1, keepdim=True)).mean(1) @ x

    torch.manual_seed(0)
    model = Model(Folded(), CustomKernel())
    entropy = AttentionEntropy()
    monitoring = Monitoring(model, [entropy], writer=MemorySink(), every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with monitoring.step(0):
            model(torch.randn(B, T, D)).sum().backward()
        monitoring.close()
    (message,) = [str(w.message) for w in caught if "'blocks.1'" in str(w.message)]
    assert "called none of F.scaled_dot_product_attention, flex_attention or a softmax" in message


def test_hugging_face_flex_attention_is_measured_as_its_eager_twin():
    """Gemma-2 through attn_implementation="flex_attention" (a BlockMask, soft-capping): the
    statistics equal those of the same weights under eager attention."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma2Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=32,
        sliding_window=4,
        attn_logit_softcapping=5.0,
    )
    ids = torch.randint(0, 32, (2, 10), generator=torch.Generator().manual_seed(0))
    values = {}
    for implementation in ("eager", "flex_attention"):
        torch.manual_seed(0)
        model = transformers.Gemma2ForCausalLM._from_config(
            config, attn_implementation=implementation
        ).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(6.0)
        entropy = AttentionEntropy(per_head=True)
        monitoring = Monitoring(model, [entropy], writer=MemorySink(), every_n_steps=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad(), monitoring.step(0):
                model(ids, use_cache=False)  # 4.48: a HybridCache shorter than the input fails
            monitoring.close()
        assert not [w for w in caught if "not supported" in str(w.message)]
        values[implementation] = entropy.latest
    for metric in ("entropy_norm", "max_prob", "max_logit"):
        for eager, flex in zip(values["eager"][metric], values["flex_attention"][metric]):
            assert torch.isfinite(flex).all()
            assert_close(flex, eager, rtol=1e-5, atol=1e-5)


class Boom(Exception):
    pass


def test_a_step_that_raises_after_flex_leaves_the_names_and_the_model_as_they_were(leftovers):
    """A failure inside a probed flex forward: the observed names are put back, nothing stays on
    the model or the torch function stack, and the next step measures every layer."""
    torch.manual_seed(0)
    model = sharpened(Model(FlexAttention(score_mod=soft_cap), FlexAttention(score_mod=soft_cap)))
    entropy = AttentionEntropy()
    monitoring = Monitoring(model, [entropy], writer=MemorySink(), every_n_steps=1)
    x = torch.randn(B, T, D)

    def boom(module, args, output):
        raise Boom

    handle = model.blocks[1].o_proj.register_forward_hook(boom)  # after its flex call
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        with pytest.raises(Boom), torch.no_grad(), monitoring.step(0):
            model(x)
        handle.remove()
        assert globals()["flex_attention"] is flex_module.flex_attention
        assert leftovers(model) == []
        with torch.no_grad(), monitoring.step(1):
            model(x)
    monitoring.close()
    assert leftovers(model) == []
    assert all(torch.isfinite(h).all() for h in entropy.latest["entropy_norm"])


def test_two_monitorings_share_the_observed_names_until_the_last_one_closes(leftovers):
    torch.manual_seed(0)
    model = sharpened(Model(FlexAttention(mask_mod=causal_window)))
    first, second = AttentionEntropy(), AttentionEntropy(log_key_prefix="second")
    one = Monitoring(model, [first], writer=MemorySink(), every_n_steps=1)
    two = Monitoring(model, [second], writer=MemorySink(), every_n_steps=1)
    x = torch.randn(B, T, D)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        with torch.no_grad():
            one.begin(0)
            two.begin(0)
            model(x)
            one.end()
            assert globals()["flex_attention"] is not flex_module.flex_attention  # still held
            model(x)
            two.end()
    assert globals()["flex_attention"] is flex_module.flex_attention
    one.close()
    two.close()
    assert leftovers(model) == []
    assert torch.equal(first.latest["entropy_norm"][0], second.latest["entropy_norm"][0])

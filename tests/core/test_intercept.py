"""Attention found with no user code: SDPA/softmax interception, layouts read by name and checked.

References are float64 math on the modules' own weights and inputs, written here; the models are
small user-style modules (a nanoGPT block, a torchtitan-style GQA block, a module pairing query
head h with key head h % H_kv, a module whose attention qkmonitor cannot read).
"""

from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import qkmonitor
from qkmonitor import AttentionSpec, find_attention_layers, register_attention
from qkmonitor.attention.layouts import fused_rows
from qkmonitor.attention.registry import unregister_family
from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum
from qkmonitor.output.sinks import MemorySink

D, H, T = 16, 4, 8


class NanoAttention(nn.Module):
    """nanoGPT's CausalSelfAttention: one c_attn, SDPA (flash) or an explicit masked softmax."""

    def __init__(self, flash: bool = True, prescale: bool = False) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.n_head, self.n_embd, self.flash, self.prescale = H, D, flash, prescale

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
            for z in self.c_attn(x).split(c, 2)
        )
        if self.prescale:  # some modules fold the temperature into q and call SDPA with scale=1
            q = q * (c // self.n_head) ** -0.5
        if self.flash:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=1.0 if self.prescale else None
            )
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class ModuloGQA(nn.Module):
    """Separate wq/wk with 2 key heads, expanded so that query head h uses key head h % 2 (as
    x-transformers does), RoPE on q and k, SDPA."""

    def __init__(self, kv_heads: int = 2, modulo: bool = True) -> None:
        super().__init__()
        self.wq, self.wk = nn.Linear(D, D, bias=False), nn.Linear(D, kv_heads * D // H, bias=False)
        self.wv, self.wo = nn.Linear(D, kv_heads * D // H, bias=False), nn.Linear(D, D, bias=False)
        self.n_heads, self.n_kv_heads, self.modulo = H, kv_heads, modulo

    def forward(self, x):
        b, t, _ = x.shape
        d = D // H
        q = self.wq(x).view(b, t, H, d).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, d).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, d).transpose(1, 2)
        q, k = _rope(q), _rope(k)
        r = H // self.n_kv_heads
        if self.modulo:
            k, v = k.repeat(1, r, 1, 1), v.repeat(1, r, 1, 1)
        else:
            k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
        return self.wo(
            F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D)
        )


def _rope(x):
    t, d = x.shape[-2:]
    angle = torch.arange(t)[:, None] * (10000.0 ** (-torch.arange(0, d, 2) / d))
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class Blind(nn.Module):
    """Attention qkmonitor cannot read: the scores are a custom product, no SDPA, no softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        return self.proj(torch.sigmoid(x @ x.transpose(-1, -2)) @ x)


class BlindAttention(Blind):
    pass


class Model(nn.Module):
    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
        self.embed, self.blocks, self.head = (
            nn.Embedding(20, D),
            nn.ModuleList(blocks),
            nn.Linear(D, 20),
        )

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def sharpen(model: nn.Module, factor: float = 2.0) -> nn.Module:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(key in name for key in ("c_attn", "wq", "wk")):
                p.mul_(factor)
    return model


def monitored_step(model, *engines, tokens=None):
    tokens = (
        torch.randint(0, 20, (3, T), generator=torch.Generator().manual_seed(1))
        if tokens is None
        else tokens
    )
    monitoring = Monitoring(model, list(engines), writer=MemorySink(), every_n_steps=1)
    with monitoring.step(0):
        loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
    monitoring.close()
    return loss.detach()


def kappa_reference(w_q: torch.Tensor, w_k: torch.Tensor, pairing: list[int]) -> torch.Tensor:
    d = w_q.shape[0] // len(pairing)
    out = []
    for h, g in enumerate(pairing):
        s = torch.linalg.svdvals(
            w_q[h * d : (h + 1) * d].double().T @ w_k[g * d : (g + 1) * d].double()
        )
        out.append(s[0] / s.sum())
    return torch.stack(out)


def entropy_reference(q, k, causal=True):
    """entropy_norm and max_prob per head from float64 probabilities of q (B,H,N,d), k."""
    q, k = q.double(), k.double()
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = s.shape[-1]
    allowed = (
        torch.ones(n, n, dtype=torch.bool).tril() if causal else torch.ones(n, n, dtype=torch.bool)
    )
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    ent = -(p * p.clamp_min(1e-300).log()).sum(-1)
    attended = allowed.sum(-1).double()
    rows = attended > 1
    norm = (ent[..., rows] / attended[rows].log()).mean(dim=(0, 2))
    return norm, p.amax(-1).mean(dim=(0, 2))


@pytest.mark.parametrize("flash", [True, False], ids=["sdpa", "softmax"])
def test_a_nanogpt_block_is_found_and_measured_against_float64(flash):
    torch.manual_seed(0)
    model = sharpen(Model(NanoAttention(flash), NanoAttention(flash)))
    spectrum, entropy = QKSpectrum(per_head=True), AttentionEntropy(per_head=True)
    seen = {}

    def keep_qk(module, args, output):  # the reference's own q and k, from the module's weights
        x = args[0]
        with torch.no_grad():
            q, k, _ = module.c_attn(x).split(D, 2)
        seen[module] = tuple(z.view(x.shape[0], T, H, D // H).transpose(1, 2) for z in (q, k))

    handles = [block.register_forward_hook(keep_qk) for block in model.blocks]
    monitored_step(model, spectrum, entropy)
    for handle in handles:
        handle.remove()
    for i, block in enumerate(model.blocks):
        w = block.c_attn.weight
        expected = kappa_reference(w[:D], w[D : 2 * D], list(range(H)))
        assert_close(spectrum.latest["kappa"][i].double(), expected, rtol=1e-5, atol=1e-7)
        norm, max_prob = entropy_reference(*seen[block])
        assert_close(entropy.latest["entropy_norm"][i].double(), norm, rtol=0, atol=2e-6)
        assert_close(entropy.latest["max_prob"][i].double(), max_prob, rtol=0, atol=2e-6)
        assert 0.2 < float(norm.mean()) < 0.95  # sharpened: not a near-uniform comparison
        assert spectrum.layers[i].layout.scale == pytest.approx(1 / math.sqrt(D // H), rel=1e-12)


@pytest.mark.parametrize("modulo", [True, False], ids=["h%Hkv", "h//r"])
def test_the_key_head_of_each_query_head_is_the_one_the_model_uses(modulo):
    torch.manual_seed(0)
    model = sharpen(Model(ModuloGQA(modulo=modulo)))
    spectrum = QKSpectrum(per_head=True)
    monitored_step(model, spectrum, AttentionEntropy())
    block = model.blocks[0]
    pairing = [h % 2 for h in range(H)] if modulo else [h // 2 for h in range(H)]
    expected = kappa_reference(block.wq.weight, block.wk.weight, pairing)
    assert_close(spectrum.latest["kappa"][0].double(), expected, rtol=1e-5, atol=1e-7)
    wrong = kappa_reference(
        block.wq.weight, block.wk.weight, [h // 2 if modulo else h % 2 for h in range(H)]
    )
    assert not torch.allclose(expected, wrong, rtol=1e-3)  # the pairing matters on this model


def test_a_module_that_prescales_q_keeps_its_effective_logit_scale():
    torch.manual_seed(0)
    model = Model(NanoAttention(prescale=True))
    spectrum = QKSpectrum()
    monitored_step(model, spectrum)
    assert spectrum.layers[0].layout.scale == pytest.approx((D // H) ** -0.5, rel=1e-5)


def test_a_layout_that_does_not_reproduce_the_call_is_nan_with_a_warning_naming_the_layer():
    torch.manual_seed(0)
    model = Model(NanoAttention())
    # a wrong declared layout: per-head interleaved where the module uses blocks
    register_attention(
        AttentionSpec(match=NanoAttention, qkv="c_attn", fused="heads", num_heads="n_head")
    )
    try:
        spectrum = QKSpectrum()
        with pytest.warns(RuntimeWarning, match=r"'blocks.0'.*NaN"):
            monitored_step(model, spectrum)
    finally:
        unregister_family("spec:NanoAttention")
    assert torch.isnan(spectrum.latest["kappa"][0]).all()


def test_the_readme_worked_example_an_attention_spec_for_a_module_no_rule_covers():
    class Mixer(
        nn.Module
    ):  # names no rule knows: `to_scores` holds W_Q then W_K, heads in `groups`
        def __init__(self):
            super().__init__()
            self.to_scores, self.to_values, self.groups = (
                nn.Linear(D, 2 * D, bias=False),
                nn.Linear(D, D),
                H,
            )

        def forward(self, x):
            b, t, _ = x.shape
            q, k = self.to_scores(x).view(b, t, 2, self.groups, D // H).permute(2, 0, 3, 1, 4)
            v = self.to_values(x).view(b, t, self.groups, D // H).transpose(1, 2)
            return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, D)

    torch.manual_seed(0)
    model = Model(Mixer())
    with pytest.raises(ValueError, match="weights.*not found.*AttentionSpec"):
        Monitoring(model, [QKSpectrum()])
    register_attention(
        AttentionSpec(match=Mixer, qkv="to_scores", num_heads="groups", num_kv_heads="groups")
    )
    try:
        spectrum = QKSpectrum(per_head=True)
        monitored_step(model, spectrum)
        assert [layer.kind for layer in spectrum.layers] == ["spec:Mixer"]
    finally:
        unregister_family("spec:Mixer")
    w = model.blocks[0].to_scores.weight
    assert_close(
        spectrum.latest["kappa"][0].double(),
        kappa_reference(w[:D], w[D:], list(range(H))),
        rtol=1e-5,
        atol=1e-7,
    )


def test_attention_spec_arguments_are_checked_by_name():
    with pytest.raises(ValueError, match="either `q` and `k`.*or `qkv`"):
        AttentionSpec(match=nn.Module, q="wq")
    with pytest.raises(ValueError, match="`fused`"):
        AttentionSpec(match=nn.Module, qkv="qkv", fused="interleaved")
    with pytest.raises(ValueError, match="`pairing`"):
        AttentionSpec(match=nn.Module, q="wq", k="wk", pairing="random")
    with pytest.raises(ValueError, match="`num_heads`"):
        AttentionSpec(match=nn.Module, q="wq", k="wk", num_heads=0)
    with pytest.raises(ValueError, match="`scale`"):
        AttentionSpec(match=nn.Module, q="wq", k="wk", scale=-1.0)
    with pytest.raises(ValueError, match="AttentionSpec"):
        register_attention("wq")


def test_fused_row_orders_against_their_definitions():
    h, kv, d = 4, 2, 3
    q, k = fused_rows("heads", h, h, d)
    assert q.view(h, d)[1].tolist() == list(range(3 * d, 3 * d + d))  # head 1: rows [q k v] from 3d
    assert k.view(h, d)[1].tolist() == list(range(4 * d, 5 * d))
    q, k = fused_rows("groups", h, kv, d)
    r = h // kv  # group 1 starts at (r + 2) d; its queries come first, then its key
    assert q.view(h, d)[2].tolist() == list(range((r + 2) * d, (r + 2) * d + d))
    assert k.view(kv, d)[1].tolist() == list(range((r + 2) * d + r * d, (r + 2) * d + r * d + d))


def test_discovery_says_what_it_found_and_warns_about_attention_it_cannot_read(caplog):
    torch.manual_seed(0)
    model = Model(
        NanoAttention(),
        nn.TransformerEncoderLayer(D, 2, 32, dropout=0.0, batch_first=True),
        BlindAttention(),
    )
    with (
        caplog.at_level(logging.INFO, logger="qkmonitor"),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        Monitoring(model, [AttentionEntropy()])
    lines = [r.getMessage() for r in caplog.records if "measures" in r.getMessage()]
    assert (
        len(lines) == 1
        and "AttentionEntropy (qkmonitor) measures 2 attention layers: 1 " in lines[0]
    )
    assert "NanoAttention, 1 torch.nn.MultiheadAttention" in lines[0]
    unmeasured = [str(w.message) for w in caught if "looks like attention" in str(w.message)]
    assert (
        len(unmeasured) == 1 and "'blocks.2'" in unmeasured[0] and "BlindAttention" in unmeasured[0]
    )


def test_an_unprobed_step_installs_nothing_and_a_probed_one_removes_everything(leftovers):
    torch.manual_seed(0)
    model = Model(NanoAttention(), NanoAttention(flash=False))
    entropy, spectrum = AttentionEntropy(every_n_steps=2), QKSpectrum(every_n_steps=2)
    monitoring = Monitoring(
        model, [spectrum, entropy, EffectiveRank(every_n_steps=2)], writer=MemorySink()
    )
    tokens = torch.randint(0, 20, (2, T))
    installed = []
    for step in range(3):
        with monitoring.step(step):
            installed.append(list(leftovers(model)))
            model(tokens).sum().backward()
        assert leftovers(model) == []
    assert installed[0] and installed[1] == [] and installed[2]


def test_a_forward_that_raises_inside_a_probed_module_leaves_nothing_and_training_goes_on(
    leftovers,
):
    torch.manual_seed(0)
    model = Model(NanoAttention(), NanoAttention(flash=False))
    monitoring = Monitoring(
        model, [QKSpectrum(), AttentionEntropy()], writer=MemorySink(), every_n_steps=1
    )
    tokens = torch.randint(0, 20, (2, T))

    def fail(module, args, output):
        raise RuntimeError("boom")

    handle = model.blocks[1].c_proj.register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="boom"), monitoring.step(0):
        model(tokens)
    handle.remove()
    assert leftovers(model) == []
    with monitoring.step(1):
        model(tokens).sum().backward()
    assert leftovers(model) == []


@pytest.mark.parametrize("flash", [True, False], ids=["sdpa", "softmax"])
def test_a_keyboard_interrupt_inside_a_probed_forward_leaves_nothing_pushed_or_installed(
    flash, leftovers
):
    """A BaseException skips torch's always-call forward hooks, so the interception's mode stays
    entered until the probe closes: leaving ``monitoring.step`` must close it, and the next step
    measures as usual."""
    torch.manual_seed(0)
    model = Model(NanoAttention(flash), NanoAttention(flash))
    monitoring = Monitoring(
        model, [QKSpectrum(), AttentionEntropy()], writer=MemorySink(), every_n_steps=1
    )
    tokens = torch.randint(0, 20, (2, T))

    def interrupt(module, args, output):
        raise KeyboardInterrupt

    handle = model.blocks[0].c_proj.register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt), monitoring.step(0):
        model(tokens)
    handle.remove()
    assert leftovers(model) == []
    with monitoring.step(1):
        model(tokens).sum().backward()
    monitoring.close()
    assert leftovers(model) == []
    assert all(torch.isfinite(t).all() for t in monitoring.engines[1].latest["entropy_norm"])


def test_two_threads_in_one_probed_forward_keep_their_calls_apart(leftovers):
    """Replicas on threads (``nn.DataParallel`` shares a module's ``__dict__``, so its route): two
    threads run the same probed module at once. Thread 1 enters the module after thread 0 has
    projected its input and before thread 0 calls SDPA; each call keeps its own evidence, so the
    first probe's layout check (thread 0's SDPA against thread 0's projection input) holds, both
    calls are measured, and nothing is left entered on either thread."""
    import threading
    import warnings

    torch.manual_seed(0)
    model = Model(NanoAttention(flash=True))
    spectrum, entropy = QKSpectrum(), AttentionEntropy()
    monitoring = Monitoring(model, [spectrum, entropy], writer=MemorySink(), every_n_steps=1)
    projected, called = threading.Event(), threading.Event()

    def after_projection(module, args, output):
        if threading.current_thread().name == "replica-0":
            assert projected.wait(30)  # thread 1 entered and projected meanwhile
        else:
            projected.set()
            assert called.wait(30)  # thread 0's SDPA and output projection first

    def before_output(module, args):
        if threading.current_thread().name == "replica-0":
            called.set()

    handles = [
        model.blocks[0].c_attn.register_forward_hook(after_projection),
        model.blocks[0].c_proj.register_forward_pre_hook(before_output),
    ]
    tokens = [
        torch.randint(0, 20, (2, T), generator=torch.Generator().manual_seed(i)) for i in (1, 2)
    ]
    errors, left = [], []

    def forward(i):
        try:
            with torch.no_grad():
                model(tokens[i])
            left.append(torch._C._len_torch_function_stack())
        except BaseException as err:  # noqa: BLE001 -- reported below
            errors.append(err)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with monitoring.step(0):
            threads = [
                threading.Thread(target=forward, args=(i,), name=f"replica-{i}") for i in (0, 1)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        monitoring.close()
    for handle in handles:
        handle.remove()
    assert errors == [] and left == [0, 0]
    assert leftovers(model) == []
    assert not [w for w in caught if "layout" in str(w.message)], [str(w.message) for w in caught]
    assert torch.isfinite(spectrum.latest["kappa"][0]).all()
    shared = NanoAttention(flash=True)
    shared.load_state_dict(model.blocks[0].state_dict())
    with torch.no_grad():
        refs = []
        for x in (model.embed(tokens[0]), model.embed(tokens[1])):
            b, t, c = x.shape
            q, k, _ = (
                z.view(b, t, H, c // H).transpose(1, 2) for z in shared.c_attn(x).split(c, 2)
            )
            refs.append(entropy_reference(q, k)[0])
    norm = entropy.latest["entropy_norm"][0]
    assert torch.allclose(norm.double(), (refs[0] + refs[1]) / 2, atol=1e-5)  # both calls


def test_a_module_called_twice_within_one_probe_is_measured_over_both_calls(leftovers):
    """The same attention module applied twice in one forward (weight sharing, as in ALBERT or a
    looped transformer): each call's statistics are its own and the probe sees both, as the
    float64 reference of the two calls does."""
    torch.manual_seed(0)
    shared = NanoAttention(flash=True)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.attn, self.head = nn.Embedding(20, D), shared, nn.Linear(D, 20)

        def forward(self, tokens):
            x = self.embed(tokens)
            x = x + self.attn(x)
            x = x + self.attn(x)
            return self.head(x)

    model = Twice()
    entropy = AttentionEntropy()
    tokens = torch.randint(0, 20, (2, T))
    monitored_step(model, QKSpectrum(), entropy, tokens=tokens)
    assert leftovers(model) == []

    # the reference: both calls' q and k, from the model's own projections
    def qk(x):
        b, t, c = x.shape
        q, k, _ = (z.view(b, t, H, c // H).transpose(1, 2) for z in shared.c_attn(x).split(c, 2))
        return q, k

    with torch.no_grad():
        x0 = model.embed(tokens)
        x1 = x0 + shared(x0)
        (norm0, _), (norm1, _) = entropy_reference(*qk(x0)), entropy_reference(*qk(x1))
    expected = (norm0 + norm1) / 2  # (heads,): both calls' rows, as many each
    assert torch.allclose(entropy.latest["entropy_norm"][0].double(), expected, atol=1e-5)
    assert not torch.allclose(norm0, norm1, atol=1e-3)  # the two calls differ: both are counted


@pytest.mark.parametrize("flash", [True, False], ids=["sdpa", "softmax"])
def test_the_monitored_step_trains_bit_for_bit_as_its_unmonitored_twin(flash):
    import copy

    torch.manual_seed(0)
    model = sharpen(Model(NanoAttention(flash), ModuloGQA()))
    twin = copy.deepcopy(model)
    tokens = torch.randint(0, 20, (3, T))
    loss = monitored_step(model, QKSpectrum(), AttentionEntropy(), EffectiveRank(), tokens=tokens)
    twin_loss = F.cross_entropy(twin(tokens).flatten(0, 1), tokens.flatten())
    twin_loss.backward()
    assert torch.equal(loss, twin_loss.detach())
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_a_model_of_unknown_attention_is_an_error_that_names_the_public_ways_out():
    with pytest.raises(
        ValueError, match=r"No attention layers found in Model.*AttentionSpec.*layers="
    ):
        find_attention_layers(Model(Blind()))
    assert qkmonitor.AttentionSpec is AttentionSpec


class AnonymousHeads(NanoAttention):
    """No attribute names the head count: it is taken from the SDPA call."""

    def __init__(self) -> None:
        super().__init__()
        self._h = self.__dict__.pop("n_head")

    @property
    def n_head_(self):  # what forward reads, under a name no rule knows
        return self._h

    def forward(self, x):
        self.n_head = self._h  # forward needs it; discovery ran before and did not see it
        try:
            return super().forward(x)
        finally:
            del self.n_head


def test_heads_from_the_call_and_the_step0_spectrum_from_the_weights_before_the_update():
    import copy

    torch.manual_seed(0)
    model = sharpen(Model(AnonymousHeads(), NanoAttention(flash=False)))
    initial = copy.deepcopy(model)
    spectrum, entropy = QKSpectrum(per_head=True), AttentionEntropy(per_head=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    monitoring = Monitoring(model, [spectrum, entropy], writer=MemorySink(), every_n_steps=1)
    tokens = torch.randint(0, 20, (3, T))
    with monitoring.step(0):  # the update inside the window changes the weights before the check
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        optimizer.step()
    assert spectrum.schedule.latest_step == 0
    for i, block in enumerate(initial.blocks):
        w = block.c_attn.weight
        assert spectrum.latest["kappa"][i].shape == (H,)
        assert_close(
            spectrum.latest["kappa"][i].double(),
            kappa_reference(w[:D], w[D : 2 * D], list(range(H))),
            rtol=1e-5,
            atol=1e-7,
        )
    assert entropy.latest["entropy_norm"][0].shape == (H,)
    assert spectrum.layers[0].layout.num_heads == H


def test_a_monitor_measures_the_layers_it_can_and_warns_about_the_others():
    class WeightsOnly(nn.Module):  # implements only qk_weights(): no statistics
        def __init__(self):
            super().__init__()
            self.inner = nn.MultiheadAttention(D, 2, batch_first=True)

        def qk_weights(self):
            w = self.inner.in_proj_weight
            return qkmonitor.QKWeights(w[:D], w[D : 2 * D], 2, 2, (D // 2) ** -0.5)

        def forward(self, x):
            return self.inner(x, x, x, need_weights=False)[0]

    torch.manual_seed(0)
    model = Model(WeightsOnly(), NanoAttention())
    entropy = AttentionEntropy()
    with pytest.warns(RuntimeWarning, match=r"\['blocks.0'\] give no attention statistics"):
        monitored_step(model, entropy)
    assert torch.isnan(entropy.latest["entropy_norm"][0]).all()
    assert torch.isfinite(entropy.latest["entropy_norm"][1]).all()


def test_under_bf16_autocast_the_layout_check_passes_and_statistics_follow_the_bf16_call():
    torch.manual_seed(0)
    model = sharpen(Model(NanoAttention(), ModuloGQA()))
    spectrum, entropy = QKSpectrum(per_head=True), AttentionEntropy(per_head=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no layout warning
        monitoring = Monitoring(model, [spectrum, entropy], writer=MemorySink(), every_n_steps=1)
        tokens = torch.randint(0, 20, (3, T))
        with monitoring.step(0), torch.autocast("cpu", dtype=torch.bfloat16):
            model(tokens).float().sum().backward()
    block = model.blocks[1]
    expected = kappa_reference(block.wq.weight, block.wk.weight, [h % 2 for h in range(H)])
    assert_close(spectrum.latest["kappa"][1].double(), expected, rtol=1e-5, atol=1e-7)
    assert all(torch.isfinite(v).all() for v in entropy.latest["entropy_norm"])


class BiasedAttention(nn.Module):
    """SDPA with an additive float mask: an ALiBi-like bias, and padded keys at finfo.min."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.num_heads = nn.Linear(D, 3 * D), H
        self.padding = None

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)
        self.mask = (
            -(torch.arange(H)[:, None, None] + 1.0)
            * (torch.arange(t)[None] - torch.arange(t)[:, None]).abs()
        )
        self.mask = (
            self.mask[None]
            .expand(b, H, t, t)
            .masked_fill(~self.padding[:, None, None, :], torch.finfo(x.dtype).min)
        )
        self.q, self.k = q.detach(), k.detach()
        return (
            F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
            .transpose(1, 2)
            .reshape(b, t, D)
        )


def test_an_additive_float_mask_counts_its_finfo_min_keys_as_blocked():
    torch.manual_seed(0)
    block = BiasedAttention()
    model = Model(block)
    tokens = torch.randint(0, 20, (3, T))
    block.padding = torch.arange(T)[None] < torch.tensor([T, 5, 3])[:, None]
    entropy = AttentionEntropy(per_head=True)
    monitored_step(model, entropy, tokens=tokens)
    s = (
        block.q.double() @ block.k.double().transpose(-1, -2) / math.sqrt(D // H)
        + block.mask.double()
    )
    allowed = block.padding[:, None, None, :].expand_as(s)
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    ent = -(p * p.clamp_min(1e-300).log()).sum(-1)
    n = allowed.sum(-1).double()
    assert_close(
        entropy.latest["entropy_norm"][0].double(),
        (ent / n.log()).mean(dim=(0, 2)),
        rtol=0,
        atol=2e-6,
    )
    assert_close(
        entropy.latest["max_prob"][0].double(), p.amax(-1).mean(dim=(0, 2)), rtol=0, atol=2e-6
    )


def test_x_transformers_qk_norm_is_a_warning_and_nan_kappa_not_a_wrong_number():
    x_transformers = pytest.importorskip("x_transformers")
    torch.manual_seed(0)
    model = x_transformers.TransformerWrapper(
        num_tokens=20,
        max_seq_len=T,
        attn_layers=x_transformers.Decoder(dim=D, depth=1, heads=H, attn_qk_norm=True),
    )
    spectrum, entropy = QKSpectrum(), AttentionEntropy()
    monitoring = Monitoring(model, [spectrum, entropy], writer=MemorySink(), every_n_steps=1)
    tokens = torch.randint(0, 20, (2, T))
    with pytest.warns(RuntimeWarning, match=r"layer 'attn_layers.layers.0.1'.*relative.*NaN"):
        _train_step(monitoring, model, tokens)
    assert torch.isnan(spectrum.latest["kappa"][0]).all()
    assert torch.isfinite(
        entropy.latest["entropy_norm"][0]
    ).all()  # statistics come from the call itself


def _train_step(monitoring, model, tokens):
    with monitoring.step(0):
        model(tokens).sum().backward()

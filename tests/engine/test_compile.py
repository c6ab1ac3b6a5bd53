"""Monitoring a model under ``torch.compile``: the statistics are the uncompiled run's, probing
recompiles nothing once warm, and nothing stays on the model.

Every model trains twice from the same seed and batches, once as it is and once through
``torch.compile`` with a backend that counts the graphs dynamo hands it and their calls, and runs
them as they are, as the ``eager`` backend does (``counting_backend``, tests/conftest.py). Both ways
are covered: the monitors given the compiled module, and the monitors given the model while the loop
calls a compiled wrapper they cannot see.
"""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum
from qkmonitor.models import TransformerConfig
from qkmonitor.models.transformer import DecoderLM

D, H, T, VOCAB, STEPS, WARM = 32, 4, 12, 24, 12, 4


class NanoBlock(nn.Module):
    """A nanoGPT-style block: one fused ``c_attn``, ``n_head``, SDPA with ``is_causal=True``."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.attn = NanoAttention()

    def forward(self, x):
        return x + self.attn(self.ln(x))


class NanoAttention(nn.Module):
    fail = False  # set by a test: the forward raises inside the attention module

    def __init__(self) -> None:
        super().__init__()
        self.c_attn, self.c_proj, self.n_head = nn.Linear(D, 3 * D), nn.Linear(D, D), H

    def forward(self, x):
        if NanoAttention.fail:
            raise RuntimeError("a forward that raises inside attention")
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
            for z in self.c_attn(x).split(c, 2)
        )
        return self.c_proj(
            F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        )


class NanoGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([NanoBlock(), NanoBlock()])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Encoder(nn.Module):
    """``nn.TransformerEncoder`` (``nn.MultiheadAttention`` inside) over token embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        layer = nn.TransformerEncoderLayer(D, H, 2 * D, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


class Llama(nn.Module):
    """A tiny Hugging Face LLaMA (grouped-query attention, RoPE, SDPA dispatch)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=D,
            intermediate_size=2 * D,
            num_hidden_layers=2,
            num_attention_heads=H,
            num_key_value_heads=2,
            max_position_embeddings=2 * T,
        )
        config._attn_implementation = "sdpa"
        self.lm = LlamaForCausalLM(config)

    def forward(self, tokens):
        return self.lm(tokens).logits


class ViT(nn.Module):
    """timm's ``VisionTransformer`` (fused ``qkv``, SDPA) classifying 16 x 16 images of the tokens'
    seed."""

    def __init__(self) -> None:
        super().__init__()
        from timm.models.vision_transformer import VisionTransformer

        self.vit = VisionTransformer(
            img_size=16, patch_size=4, embed_dim=D, depth=2, num_heads=H, num_classes=VOCAB
        )

    def forward(self, tokens):
        images = torch.randn(
            tokens.shape[0], 3, 16, 16, generator=torch.Generator().manual_seed(int(tokens.sum()))
        )
        return self.vit(images)[:, None]  # (B, 1, VOCAB): one "token" per image


def vit() -> nn.Module:
    pytest.importorskip("timm")
    return ViT()


def bundled() -> nn.Module:
    return DecoderLM(
        TransformerConfig(vocab_size=VOCAB, d_model=D, n_heads=H, n_layers=2, max_seq_len=T)
    )


def llama() -> nn.Module:
    pytest.importorskip("transformers")
    return Llama()


MODELS = {
    "bundled": bundled,
    "nanogpt": NanoGPT,
    "multihead": Encoder,
    "llama": llama,
    "timm-vit": vit,
}


def engines() -> list:
    return [
        QKSpectrum(every_n_steps=2, per_head=True),
        AttentionEntropy(every_n_steps=2, per_head=True),
        EffectiveRank(every_n_steps=2, per_head=True, max_probe_tokens=8),
    ]


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, T), generator=torch.Generator().manual_seed(step))


def train(
    kind: str,
    *,
    backend=None,
    monitor_compiled: bool = True,
    fail_at: int = -1,
    fail_inside: bool = False,
    watched: list | None = None,
    autocast: bool = False,
):
    """Train ``kind`` for STEPS steps (the forward under bf16 autocast with ``autocast``); the step
    ``fail_at`` raises after its forward, or inside the attention modules with ``fail_inside``.
    Return (losses, values per probe, graph calls per step from WARM on, graphs compiled from WARM
    on, model)."""
    torch.manual_seed(0)
    model = MODELS[kind]()
    call = model if backend is None else torch.compile(model, backend=backend)
    counting = hasattr(backend, "graphs")  # the counting backend, not a backend's name
    watched = engines() if watched is None else watched
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, values, calls, warm_graphs = [], {}, [], None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Monitoring(call if monitor_compiled else model, watched) as monitoring:
            for step in range(STEPS):
                if step == WARM and counting:
                    warm_graphs = backend.graphs
                if step >= WARM and counting:
                    calls.append(backend.calls)
                try:
                    with monitoring.step(step):
                        NanoAttention.fail = fail_inside and step == fail_at
                        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                            logits = call(batch(step))
                        targets = batch(step + 100)[:, : logits.shape[1]]
                        loss = F.cross_entropy(
                            logits.float().reshape(-1, VOCAB), targets.reshape(-1)
                        )
                        if step == fail_at:
                            raise RuntimeError("a failing step")
                        loss.backward()
                        optimizer.step()
                        optimizer.zero_grad()
                except RuntimeError:
                    optimizer.zero_grad()
                    assert leftovers_after_a_failure(model) == [], step
                    continue
                finally:
                    NanoAttention.fail = False
                losses.append(loss.item())
                for engine in watched:
                    if engine.schedule.latest_step == step:
                        for metric, layers in engine.latest.items():
                            values[(step, metric)] = [t.clone() for t in layers]
    after_warm = backend.graphs - warm_graphs if counting else None
    per_step = [
        b - a for a, b in itertools.pairwise(calls)
    ]  # graph calls of steps WARM .. STEPS - 2
    return losses, values, per_step, after_warm, model


def assert_same_values(eager: dict, compiled: dict) -> None:
    assert eager.keys() == compiled.keys()
    for key, layers in eager.items():
        for a, b in zip(layers, compiled[key]):
            both_nan = torch.isnan(a) & torch.isnan(b)
            assert torch.equal(torch.where(both_nan, 0.0, a), torch.where(both_nan, 0.0, b)), (
                key,
                a,
                b,
            )


@pytest.mark.parametrize(
    "monitor_compiled",
    [True, False],
    ids=["monitors-hold-the-compiled-module", "loop-calls-a-compiled-wrapper"],
)
@pytest.mark.parametrize("kind", list(MODELS))
def test_compiled_training_logs_the_uncompiled_statistics_without_recompiling(
    kind, monitor_compiled, leftovers, counting_backend
):
    torch._dynamo.reset()
    eager_losses, eager_values, _, _, _ = train(kind)
    plain = (
        counting_backend()
    )  # the compiled model with no activation monitor: its unprobed steps' graphs
    _, _, plain_calls, _, _ = train(kind, backend=plain, watched=[QKSpectrum(every_n_steps=1000)])
    torch._dynamo.reset()
    backend = counting_backend()
    losses, values, calls, recompiled, model = train(
        kind, backend=backend, monitor_compiled=monitor_compiled
    )
    assert backend.graphs > 0  # it was compiled
    assert losses == eager_losses
    assert {step for step, _ in values} == set(range(0, STEPS, 2))
    assert not any(
        math.isnan(v)
        for (_, metric), layers in values.items()
        if metric == "entropy"
        for t in layers
        for v in t.tolist()
    )
    assert_same_values(eager_values, values)
    assert recompiled == 0, (
        f"{recompiled} graphs compiled after warm-up (steps {WARM}..{STEPS - 1})"
    )
    # an unprobed step (odd) runs the compiled model's own graphs, as many as without monitors
    assert calls[1::2] == plain_calls[1::2], (calls, plain_calls)
    assert leftovers(model) == []


def leftovers_after_a_failure(model: nn.Module) -> list[str]:
    """What a failed probed step could have left entered: a torch function mode, an observer."""
    left = (
        [f"{torch._C._len_torch_function_stack()} torch function mode(s)"]
        if torch._C._len_torch_function_stack()
        else []
    )
    return left + [
        f"observers on {name!r}"
        for name, m in model.named_modules()
        if getattr(m, "probing", False)
    ]


@pytest.mark.parametrize(
    ("kind", "inside"),
    [("bundled", False), ("nanogpt", False), ("nanogpt", True)],
    ids=["bundled-after-forward", "nanogpt-after-forward", "nanogpt-inside-attention"],
)
def test_a_failing_compiled_step_leaves_nothing_and_the_next_probes_measure(
    kind, inside, leftovers, counting_backend
):
    torch._dynamo.reset()
    _, eager_values, _, _, _ = train(kind, fail_at=4, fail_inside=inside)
    losses, values, _, recompiled, model = train(
        kind, backend=counting_backend(), fail_at=4, fail_inside=inside
    )
    assert len(losses) == STEPS - 1 and (4, "entropy") not in values and (6, "entropy") in values
    assert_same_values(eager_values, values)
    assert recompiled == 0
    assert leftovers(model) == []


def test_a_switched_module_copies_and_pickles_as_its_own_class():
    import copy
    import io

    from qkmonitor.attention.compiled import SwitchedForward

    model = NanoGPT()
    switch = SwitchedForward.attach(model.blocks[0].attn)
    assert type(model.blocks[0].attn) is not NanoAttention and isinstance(
        model.blocks[0].attn, NanoAttention
    )
    switch.add()
    copied = copy.deepcopy(model)
    assert (
        type(copied.blocks[0].attn) is NanoAttention
        and "_qkmonitor_switch" not in copied.blocks[0].attn.__dict__
    )
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded.blocks[0].attn) is NanoAttention
    tokens = batch(0)
    assert torch.equal(copied(tokens), model(tokens)) and torch.equal(loaded(tokens), model(tokens))
    switch.detach()
    assert (
        type(model.blocks[0].attn) is NanoAttention
        and "_qkmonitor_switch" not in model.blocks[0].attn.__dict__
    )


@pytest.mark.slow
def test_under_inductor_the_statistics_are_the_uncompiled_runs_to_rounding():
    """Inductor compiles the unprobed steps' arithmetic differently (fused, reordered), so the
    weights, and the statistics measured on them, agree with the uncompiled run to rounding."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    _, eager_values, _, _, _ = train("nanogpt")
    counters.clear()
    _, values, _, _, _ = train("nanogpt", backend="inductor")
    assert eager_values.keys() == values.keys()
    for key, layers in eager_values.items():
        for a, b in zip(layers, values[key]):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, equal_nan=True, msg=str(key))
    assert counters["stats"]["unique_graphs"] > 0


@pytest.mark.parametrize("kind", ["bundled", "nanogpt"])
def test_under_bf16_autocast_compiled_training_logs_the_uncompiled_statistics(
    kind, leftovers, counting_backend
):
    torch._dynamo.reset()
    eager_losses, eager_values, _, _, _ = train(kind, autocast=True)
    losses, values, _, recompiled, model = train(kind, backend=counting_backend(), autocast=True)
    assert losses == eager_losses
    assert_same_values(eager_values, values)
    assert all(
        t.dtype == torch.float32 and torch.isfinite(t).all()
        for (_, metric), layers in values.items()
        if metric in ("entropy", "max_prob", "kappa")
        for t in layers
    )
    assert recompiled == 0
    assert leftovers(model) == []

"""QK-Clip (QKClipEngine) in a plain loop: what it measures, what it scales, what it leaves alone,
and a run it rescues. The reference for S_h is AttentionEntropy's max_logit of the same forward
(itself checked against float64 elsewhere); for γ, its definition min(1, τ / S_h) in Python
floats."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import pytest
import torch
from torch.testing import assert_close

from qkmonitor.attention.adapters import find_attention_layers
from qkmonitor.attention.clip import QKRows, head_max_logits
from qkmonitor.attention.probes import ProbeRequest
from qkmonitor.engine import AttentionEntropy, Monitoring, QKClipEngine
from qkmonitor.models import DecoderLM, TransformerConfig
from qkmonitor.output.sinks import MemorySink


def sharp_model(**config) -> DecoderLM:
    """The bundled decoder, its query/key projections scaled up so that the heads differ."""
    torch.manual_seed(0)
    model = DecoderLM(
        TransformerConfig(
            vocab_size=20, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, **config
        )
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(torch.linspace(1.0, 6.0, p.shape[0]).view(-1, *[1] * (p.dim() - 1)))
    return model


TOKENS = torch.randint(0, 20, (3, 12), generator=torch.Generator().manual_seed(1))


def frozen_step(model, engines, steps: int = 1) -> Monitoring:
    """``steps`` steps on one batch with a learning rate of 0: only the clip changes the weights."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitoring = Monitoring(model, engines, writer=MemorySink(), every_n_steps=1)
    for step in range(steps):
        with monitoring.step(step):
            model(TOKENS).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    monitoring.close()
    return monitoring


def measured(model) -> list[torch.Tensor]:
    """Each layer's largest logit per head on TOKENS, probed."""
    layers = find_attention_layers(model)
    probes = [layer.open_probe(ProbeRequest()) for layer in layers]
    with torch.no_grad():
        model(TOKENS)
    # from the statistics' path, independent of the max-only one the clip reads
    return [head_max_logits([s.max_logit.amax(-1) for s in p.close().stats], 4) for p in probes]


@pytest.mark.parametrize("config", [{"bias": True}, {"n_kv_heads": 2}], ids=["mha-bias", "gqa"])
def test_clipped_heads_end_at_tau_and_the_others_are_untouched_bit_for_bit(config):
    model = sharp_model(**config)
    before = measured(model)
    tau = float(torch.cat(before).median())
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    entropy, clip = AttentionEntropy(every_n_steps=1, alerts=[]), QKClipEngine(tau=tau)
    frozen_step(model, [entropy, clip])
    after = measured(model)
    for layer, (s, s_after) in enumerate(zip(before, after)):
        assert_close(clip.latest["clip_max_logit"][layer], entropy.latest["max_logit"][layer])
        expected = [min(1.0, tau / x) for x in s.tolist()]
        assert clip.latest["clip_factor"][layer].tolist() == pytest.approx(expected, rel=1e-6)
        clipped = s > tau
        assert clip.clip_counts[layer].tolist() == clipped.long().tolist()
        if layer == 0:  # the first layer's input is the same after the clip: its logits compare
            assert clipped.any() and (~clipped).any()
            assert_close(
                s_after[clipped], torch.full_like(s_after[clipped], tau), rtol=2e-5, atol=0
            )
            assert torch.equal(s_after[~clipped], s[~clipped])
    untouched = [n for n in weights if "q_proj" not in n and "k_proj" not in n]
    assert all(torch.equal(weights[n], dict(model.named_parameters())[n]) for n in untouched)


def test_every_n_steps_and_the_counts_survive_a_resume():
    model = sharp_model()
    tau = float(torch.cat(measured(model)).median())
    clip = QKClipEngine(tau=tau, every_n_steps=2)
    frozen_step(model, [clip], steps=3)  # probes at steps 0 and 2
    assert clip.schedule.latest_step == 2
    counts = [c.tolist() for c in clip.clip_counts]
    assert sum(map(sum, counts)) > 0
    state = clip.state_dict()
    again = QKClipEngine(tau=tau, every_n_steps=2)
    again.load_state_dict(state)
    Monitoring(model, [again], writer=MemorySink()).close()
    assert [c.tolist() for c in again.clip_counts] == counts


def test_layers_with_qk_norm_are_left_alone_with_one_warning():
    model = sharp_model(qk_norm=True)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    clip = QKClipEngine(tau=1e-3)  # every head above it
    with pytest.warns(RuntimeWarning, match="has QK-norm and is not clipped") as record:
        frozen_step(model, [clip], steps=2)
    assert sum("QK-norm" in str(w.message) for w in record) == 2  # once per layer, not per step
    assert all(torch.equal(weights[n], p) for n, p in model.named_parameters())
    assert all(f.eq(1).all() for f in clip.latest["clip_factor"])


def test_a_nan_weight_gives_a_nan_value_and_a_warning_and_is_not_scaled():
    model = sharp_model()
    with torch.no_grad():
        model.blocks[0].attn.q_proj.weight[0, 0] = math.nan
    clip = QKClipEngine(tau=1e-3)
    with pytest.warns(RuntimeWarning, match="clip_max_logit"):
        frozen_step(model, [clip])
    s, gamma = clip.latest["clip_max_logit"][0], clip.latest["clip_factor"][0]
    assert torch.isnan(s[0]) and torch.isfinite(s[1:]).all()  # row 0 of W_Q is head 0's
    assert gamma[0] == 1 and gamma[1:].lt(1).all()  # no factor from a NaN: head 0 left alone
    assert torch.isnan(model.blocks[0].attn.q_proj.weight[0, 0])  # and not written


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"tau": 0}, "tau"),
        ({"tau": math.inf}, "tau"),
        ({"tau": "100"}, "tau"),
        ({"every_n_steps": 0}, "every_n_steps"),
    ],
)
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        QKClipEngine(**kwargs)


def recall_run(
    train_recall_miniature: Callable[..., list[float]],
    clip_tau: float | None,
    qk_norm: bool = False,
) -> tuple[float, float]:
    """The instability miniature (``train_recall_miniature``, the fixture; peak lr 0.1): (final
    loss, largest logit AttentionEntropy saw at its probes)."""
    entropy = AttentionEntropy(every_n_steps=10, alerts=[])
    engines = [entropy] + ([QKClipEngine(tau=clip_tau)] if clip_tau else [])
    largest = []

    def read(step: int) -> None:
        if entropy.schedule.latest_step == step:
            largest.extend(float(x.max()) for x in entropy.latest["max_logit"])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses = train_recall_miniature(engines, qk_norm=qk_norm, on_step=read)
    return sum(losses[-20:]) / 20, max(largest)


@pytest.mark.slow
def test_qk_clip_rescues_a_run_whose_logits_run_away(train_recall_miniature):
    """Without the clip the logits run away (hundreds) and the loss ends >= 1.2 x the QK-norm
    twin's; with QKClipEngine(tau=10) they stay near tau and the loss ends within 10 % of the
    twin's."""
    failing, failing_logit = recall_run(train_recall_miniature, None)
    twin, _ = recall_run(train_recall_miniature, None, qk_norm=True)
    clipped, clipped_logit = recall_run(train_recall_miniature, 10.0)
    assert failing >= 1.2 * twin and failing_logit > 100
    assert clipped <= 1.1 * twin
    assert clipped_logit < 2 * 10.0  # measured before the step's clip: the step's growth on top


def test_a_scaling_that_fails_is_warned_once_and_training_goes_on(monkeypatch):
    def broken(self, gamma):
        raise RuntimeError("boom")

    monkeypatch.setattr(QKRows, "scale_logits", broken)
    model = sharp_model()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    clip = QKClipEngine(tau=1e-3)
    with pytest.warns(
        RuntimeWarning, match=r"failed \(RuntimeError: boom\); not clipped"
    ) as record:
        frozen_step(model, [clip], steps=2)
    assert sum("boom" in str(w.message) for w in record) == 2  # once per layer
    assert all(torch.equal(weights[n], p) for n, p in model.named_parameters())
    assert all(f.eq(1).all() for f in clip.latest["clip_factor"])
    assert all(c.eq(0).all() for c in clip.clip_counts)


def test_a_step_that_raises_leaves_nothing_on_the_model_and_clips_nothing(leftovers):
    model = sharp_model()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    monitoring = Monitoring(model, [QKClipEngine(tau=1e-3)], writer=MemorySink(), every_n_steps=1)
    with pytest.raises(RuntimeError, match="the step fails"), monitoring.step(0):
        model(TOKENS)
        raise RuntimeError("the step fails")
    monitoring.close()
    assert leftovers(model) == []
    assert all(torch.equal(weights[n], p) for n, p in model.named_parameters())


def clipped_run(
    compiled_with=None, autocast: bool = False, every: int = 1, steps: int = 3
) -> tuple[QKClipEngine, dict]:
    """Frozen steps of QKClipEngine (every ``every`` steps) on ``sharp_model``, the loop calling a
    ``torch.compile``'d model (``compiled_with``: its backend) or the model, the forward under bf16
    autocast or not: (the engine, the weights after)."""
    model = sharp_model(bias=True, n_kv_heads=2)
    tau = float(torch.cat(measured(model)).median())
    run = torch.compile(model, backend=compiled_with) if compiled_with else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    clip = QKClipEngine(tau=tau, every_n_steps=every)
    monitoring = Monitoring(model, [clip], writer=MemorySink(), every_n_steps=every)
    for step in range(steps):
        with monitoring.step(step):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = run(TOKENS)
            out.float().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    monitoring.close()
    return clip, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_under_torch_compile_the_clip_is_the_uncompiled_one(counting_backend, leftovers):
    """A probed step runs uncompiled (qkmonitor.attention.compiled), so the clip is measured as in
    eager mode; the unprobed steps between run the compiled graphs."""
    torch._dynamo.reset()
    eager, eager_weights = clipped_run(every=2, steps=5)
    backend = counting_backend()
    compiled, weights = clipped_run(compiled_with=backend, every=2, steps=5)
    assert backend.graphs > 0 and backend.calls >= 2  # the unprobed steps 1 and 3 ran compiled
    assert [c.tolist() for c in compiled.clip_counts] == [c.tolist() for c in eager.clip_counts]
    assert sum(int(c.sum()) for c in eager.clip_counts) > 0
    for name, w in eager_weights.items():
        assert torch.equal(weights[name], w), name
    torch._dynamo.reset()


def test_under_bf16_autocast_the_max_logit_is_measured_in_float32_and_weights_stay_float32():
    clip, weights = clipped_run(autocast=True)
    assert all(v.dtype == torch.float32 for v in clip.latest["clip_max_logit"])
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert sum(int(c.sum()) for c in clip.clip_counts) > 0  # heads above the median were clipped
    assert all(torch.isfinite(v).all() for v in clip.latest["clip_factor"])

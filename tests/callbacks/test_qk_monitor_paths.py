"""QKMonitor on the paths a user's training takes: third-party attention (a nanoGPT-style module,
torch's MHA, Hugging Face LLaMA), bf16-mixed autocast, torch.compile, a NaN weight, a callback
reused for a second fit, and beside other monitors. Each is compared with what the three
callbacks measure on the same run, or with an eager or fresh run."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkmonitor.callbacks import (
    AttentionEntropyMonitor,
    EffectiveRankMonitor,
    QKClip,
    QKMonitor,
    QKSpectrumMonitor,
)

from .zoo import MODELS, VOCAB, Task


class NanoAttention(nn.Module):
    """A user's nanoGPT-style attention: one fused ``c_attn``, SDPA, nothing of qkmonitor."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.n_head, self.n_embd = heads, d

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
            for z in self.c_attn(x).split(self.n_embd, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class NanoGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(NanoAttention() for _ in range(2))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens):
        x = self.wte(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


KINDS = {"nanogpt-style": NanoGPT, "torch-mha": MODELS["torch-mha"], "hf-llama": MODELS["hf-llama"]}


def three():
    return [
        QKSpectrumMonitor(every_n_steps=2, per_head=True),
        AttentionEntropyMonitor(every_n_steps=2),
        EffectiveRankMonitor(every_n_steps=2, max_probe_tokens=4),
    ]


def one():
    return QKMonitor(every_n_steps=2, per_head=True, rank={"max_probe_tokens": 4})


def fit(model, callbacks, tmp_path, *, steps=4, precision="32-true", task=None):
    torch.manual_seed(0)
    task = Task(model) if task is None else task
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        precision=precision,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(task)
    return task


def latest(callbacks) -> dict[str, list[torch.Tensor]]:
    return {name: grid for cb in callbacks for name, grid in cb.latest.items()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for name, grid in a.items():
        for x, y in zip(grid, b[name]):
            assert torch.equal(x, y) or torch.allclose(x, y, rtol=0, atol=0, equal_nan=True), name


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_third_party_attention_measures_as_the_three_callbacks(
    kind, precision, tmp_path, leftovers
):
    build = KINDS[kind]
    torch.manual_seed(0)
    callbacks = three()
    fit(build(), callbacks, tmp_path / "three", precision=precision)
    torch.manual_seed(0)
    monitor = one()
    task = fit(build(), [monitor], tmp_path / "one", precision=precision)
    assert_same(monitor.latest, latest(callbacks))
    assert all(torch.isfinite(v).all() for grid in monitor.latest.values() for v in grid)
    assert monitor.latest_step == 4  # the spectrum after the last step
    assert leftovers(task) == []


def test_a_compiled_model_logs_the_eager_values(tmp_path, leftovers):
    torch.manual_seed(0)
    eager = one()
    fit(NanoGPT(), [eager], tmp_path / "eager")
    torch.manual_seed(0)
    model = NanoGPT()
    model.compile(backend="eager")
    compiled = one()
    task = fit(model, [compiled], tmp_path / "compiled")
    assert_same(compiled.latest, eager.latest)
    assert leftovers(task) == []


def test_a_nan_weight_gives_nan_metrics_and_one_warning_per_monitor_and_training_goes_on(
    tmp_path,
):
    class Poison(pl.Callback):  # after step 1's update, before the monitor reads the weights
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                with torch.no_grad():
                    pl_module.model.blocks[1].c_attn.weight[0, 0] = float("nan")

    monitor = one()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(NanoGPT(), [Poison(), monitor], tmp_path, steps=3)  # step 2's loss is NaN: no more
    nonfinite = [str(w.message) for w in caught if "non-finite values" in str(w.message)]
    owners = sorted(m.split(":")[0] for m in nonfinite)
    assert owners == ["AttentionEntropy", "EffectiveRank", "QKSpectrum"], nonfinite
    assert all("layer 1" in m for m in nonfinite)
    # step 2: W_Q's row 0 is head 0's, in the weights and in the forward of layer 1
    for name in ("kappa", "entropy", "attn_erank"):
        layers = monitor.latest[name]
        assert torch.isnan(layers[1][0]), name
        assert torch.isfinite(layers[1][1]) and torch.isfinite(layers[0]).all(), name


def test_a_callback_reused_for_a_second_fit_behaves_as_a_new_one(tmp_path):
    reused = one()
    fit(NanoGPT(), [reused], tmp_path / "first", steps=4)
    torch.manual_seed(1)
    model = NanoGPT()
    second_model = NanoGPT()
    second_model.load_state_dict(model.state_dict())
    fit(model, [reused], tmp_path / "second", steps=2)
    fresh = one()
    fit(second_model, [fresh], tmp_path / "fresh", steps=2)
    assert_same(reused.latest, fresh.latest)
    for engine, new in zip(reused.engines, fresh.engines):
        assert engine.schedule.latest_step == new.schedule.latest_step
        assert engine.alerting.loss_history() == new.alerting.loss_history()
        assert engine.alerting.tracker.counts == new.alerting.tracker.counts


def test_beside_other_monitors(tmp_path):
    with pytest.raises(ValueError, match="same `log_key_prefix` 'qkmonitor'"):
        fit(NanoGPT(), [one(), AttentionEntropyMonitor(every_n_steps=2)], tmp_path / "clash")
    # another prefix, and QK-Clip acting after each step: each measures what it would alone
    torch.manual_seed(0)
    alone = AttentionEntropyMonitor(every_n_steps=2, log_key_prefix="other")
    fit(NanoGPT(), [QKClip(tau=100.0), alone], tmp_path / "alone")
    torch.manual_seed(0)
    together = [
        one(),
        QKClip(tau=100.0),
        AttentionEntropyMonitor(every_n_steps=2, log_key_prefix="other"),
    ]
    fit(NanoGPT(), together, tmp_path / "together")
    assert_same(together[2].latest, alone.latest)
    assert together[0].entropy.schedule.latest_step == 2

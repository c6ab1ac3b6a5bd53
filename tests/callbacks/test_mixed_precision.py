"""bf16-mixed and 16-mixed on CPU (autocast, as on CUDA): training unchanged, statistics close to
float32 at the same weights, on qkmonitor's decoder, torch's MultiheadAttention and Hugging Face."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch

from qkmonitor.callbacks import AttentionEntropyMonitor, EffectiveRankMonitor, QKSpectrumMonitor
from qkmonitor.engine import AttentionEntropy, Monitoring

from .zoo import MODELS, SEQ, VOCAB, Task

KINDS = ["bundled", "torch-mha", "hf-llama"]


def fit(model, precision, monitors, tmp_path, steps=3):
    """Train ``model`` in place; return the losses of each step."""
    losses = []

    class Recorded(Task):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            losses.append(loss.detach().float().item())
            return loss

    pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=steps,
        precision=precision,
        callbacks=monitors,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        accelerator="cpu",
    ).fit(Recorded(model))
    return losses


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("kind", KINDS)
def test_monitors_leave_mixed_precision_training_unchanged_and_finite(tmp_path, kind, precision):
    torch.manual_seed(0)
    model = MODELS[kind]()
    twin = copy.deepcopy(model)
    monitors = [
        QKSpectrumMonitor(every_n_steps=1),
        AttentionEntropyMonitor(every_n_steps=1),
        EffectiveRankMonitor(every_n_steps=1, max_probe_tokens=4),
    ]
    watched = fit(model, precision, monitors, tmp_path)
    plain = fit(twin, precision, [], tmp_path)
    # the side measurements change nothing, and qkmonitor's own attention still takes its output
    # and gradients from SDPA on probe steps (the statistics from a no-grad pass): bit for bit
    assert watched == plain
    for monitor in monitors:
        for name, grid in monitor.latest.items():
            assert all(torch.isfinite(heads).all() for heads in grid), (kind, name)
            assert all(heads.dtype == torch.float32 for heads in grid)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_statistics_under_autocast_are_within_005_of_float32_at_the_same_weights(kind, dtype):
    torch.manual_seed(1)
    model = MODELS[kind]().eval()
    tokens = torch.randint(VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(2))
    try:  # the model alone, unmonitored, under the same autocast
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            model(tokens)
    except RuntimeError as err:  # torch 2.4's TransformerEncoderLayer fast path, for one
        pytest.skip(
            f"{kind} fails under CPU autocast without qkmonitor (torch {torch.__version__}): {err}"
        )

    def measure(autocast: bool):
        monitoring = Monitoring(model, [AttentionEntropy(every_n_steps=1, alerts=[])])
        with (
            monitoring.step(0),
            torch.no_grad(),
            torch.autocast("cpu", dtype=dtype, enabled=autocast),
        ):
            model(tokens)
        return monitoring.engines[0].latest

    full, mixed = measure(False), measure(True)
    for name in ("entropy_norm", "max_prob"):
        for layer, (a, b) in enumerate(zip(full[name], mixed[name])):
            assert torch.isfinite(b).all() and b.dtype == torch.float32
            assert (a - b).abs().max().item() <= 0.05, (kind, name, layer)

"""One callback, two models: ``trainer.fit(A)``, then ``trainer.validate(B)`` and ``fit(B)`` with
the same ``QKMonitor``. The monitor measures B there, against B's own float64 values: attention
entropy from the inputs its ``nn.MultiheadAttention`` layers saw, κ from their weights."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

from qkmonitor.callbacks import QKMonitor

from .zoo import SEQ, VOCAB, Encoder, Task

HEADS = 2  # zoo.Encoder: d_model 16, 2 heads, 2 layers


class ValTask(Task):
    """:class:`Task` with one validation batch."""

    def validation_step(self, batch, batch_idx):
        self(batch[0])

    def val_dataloader(self):
        tokens = torch.randint(VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(tokens), batch_size=4)


def trainer(monitor: QKMonitor) -> pl.Trainer:
    return pl.Trainer(
        max_steps=2,
        callbacks=[monitor],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        val_check_interval=2,
    )


def attention_layers(task: Task) -> list[nn.MultiheadAttention]:
    return [layer.self_attn for layer in task.model.encoder.layers]


def entropy_reference(task: Task) -> list[torch.Tensor]:
    """Each layer's per-head mean row entropy on the validation batch, in float64 from the inputs
    its attention saw (captured by the test's own pre-hooks)."""
    seen: list[torch.Tensor] = []
    hooks = [
        m.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().double()))
        for m in attention_layers(task)
    ]
    with torch.no_grad():
        task(next(iter(task.val_dataloader()))[0])
    for hook in hooks:
        hook.remove()
    out = []
    for x, attn in zip(seen, attention_layers(task)):
        w, b = attn.in_proj_weight.double(), attn.in_proj_bias.double()
        d = w.shape[1]
        q, k = (x @ w[:d].T + b[:d]), (x @ w[d : 2 * d].T + b[d : 2 * d])
        q = q.unflatten(-1, (HEADS, -1)).transpose(1, 2)
        k = k.unflatten(-1, (HEADS, -1)).transpose(1, 2)
        p = torch.softmax(q @ k.transpose(-1, -2) / (d // HEADS) ** 0.5, dim=-1)
        out.append((-(p * p.log()).sum(-1)).mean(dim=(0, 2)))
    return out


def kappa_reference(task: Task) -> list[torch.Tensor]:
    """κ of each head's W_Q^h W_K^hᵀ by a float64 SVD of the d × d product."""
    out = []
    for attn in attention_layers(task):
        w = attn.in_proj_weight.detach().double()
        d = w.shape[1]
        wq, wk = w[:d].reshape(HEADS, -1, d), w[d : 2 * d].reshape(HEADS, -1, d)
        sv = torch.linalg.svdvals(wq.transpose(1, 2) @ wk)  # (H, d, d)
        out.append(sv[:, 0] / sv.sum(-1))
    return out


def test_validate_and_fit_of_a_second_model_measure_that_model():
    torch.manual_seed(0)
    first = ValTask(Encoder())
    torch.manual_seed(1)
    second = ValTask(Encoder())
    monitor = QKMonitor(every_n_steps=1, probe_validation=True, rank=False)
    fit = trainer(monitor)
    fit.fit(first)
    fit.validate(second)
    for got, want in zip(monitor.latest_validation["entropy"], entropy_reference(second)):
        assert_close(got.double(), want, rtol=1e-5, atol=1e-6)

    trainer(monitor).fit(second)
    for got, want in zip(monitor.latest["kappa"], kappa_reference(second)):
        assert_close(got.double(), want, rtol=1e-4, atol=1e-6)
    fit.validate(second)  # the model it is bound to now: measured again, as it is after the fit
    for got, want in zip(monitor.latest_validation["entropy"], entropy_reference(second)):
        assert_close(got.double(), want, rtol=1e-5, atol=1e-6)

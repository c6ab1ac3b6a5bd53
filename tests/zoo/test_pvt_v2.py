"""timm's PVT-v2 with no code: a ``q`` projection and a fused ``kv`` (rows ``[k; v]``, heads in
order) over spatially reduced keys (N = 16 queries, M = 4 keys), placed by the layout rules.

A Lightning fit of a tiny PVT-v2 under ``QKMonitor(every_n_steps=1, per_head=True)``: κ per head
against a float64 SVD of ``W_Q^h W_K^hᵀ`` from the model's own weights, the attention statistics
against float64 softmaxes of the queries and keys its projections computed, and the losses an
unmonitored twin's bit for bit. And a model of our own whose query/key projections no rule places:
the monitor measures what it can (the statistics) and says once what it cannot, and how to fix it.
"""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

from qkmonitor.callbacks import QKMonitor

pvt_v2 = pytest.importorskip("timm.models.pvt_v2")

HEADS, DIM = 2, 16


def tiny_pvt() -> nn.Module:
    """One stage, one block: 16×16 images, a stride-4 stem (16 tokens), keys reduced 2×2 (4)."""
    torch.manual_seed(0)
    return pvt_v2.PyramidVisionTransformerV2(
        in_chans=3,
        num_classes=5,
        depths=(2,),
        embed_dims=(DIM,),
        num_heads=(HEADS,),
        sr_ratios=(2,),
        mlp_ratios=(2,),
    )


class Classify(pl.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self.model(images), labels)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        images, labels = torch.randn(8, 3, 16, 16, generator=g), torch.randint(5, (8,), generator=g)
        return DataLoader(TensorDataset(images, labels), batch_size=2)


def fit(task: pl.LightningModule, callbacks) -> None:
    pl.Trainer(
        max_steps=4,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    ).fit(task)


def attentions(model: nn.Module) -> list[nn.Module]:
    return [block.attn for block in model.stages[0].blocks]


def test_pvt_v2_kappa_and_statistics_are_exact_and_the_fit_trains_as_without_monitors():
    twin = Classify(tiny_pvt())
    fit(twin, [])

    task = Classify(tiny_pvt())
    seen: dict[int, dict[str, torch.Tensor]] = {}  # the last forward's projections, per layer
    for i, attn in enumerate(attentions(task.model)):
        for name in ("q", "kv"):
            module = getattr(attn, name)
            module.register_forward_hook(
                lambda m, args, out, i=i, name=name: seen.setdefault(i, {}).update(
                    {name: out.detach().double()}
                )
            )
    monitor = QKMonitor(every_n_steps=1, per_head=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(task, [monitor])
    engines = ("qkmonitor", "QKSpectrum", "AttentionEntropy", "EffectiveRank")
    ours = [str(w.message) for w in caught if str(w.message).startswith(engines)]
    assert [m for m in ours if "no logger" not in m] == []  # nothing about the model
    assert len(task.losses) == len(twin.losses) == 4
    for ours, theirs in zip(task.losses, twin.losses):
        assert torch.equal(ours, theirs)

    d_k = DIM // HEADS
    # κ after the last update (read at step 4), from the model's own weights
    assert monitor.spectrum.schedule.latest_step == 4
    for i, attn in enumerate(attentions(task.model)):
        w_q = attn.q.weight.detach().double().view(HEADS, d_k, DIM)
        w_k = attn.kv.weight.detach().double()[:DIM].view(HEADS, d_k, DIM)  # rows [k; v]
        sv = torch.linalg.svdvals(w_q.transpose(1, 2) @ w_k)  # (H, d, d): W_Q^h W_K^hᵀ
        assert_close(monitor.latest["kappa"][i].double(), sv[:, 0] / sv.sum(-1), rtol=1e-4, atol=0)

    # the statistics of step 3's forward (the last probed), from its own queries and keys
    assert monitor.entropy.schedule.latest_step == 3
    for i in range(2):
        q = seen[i]["q"].unflatten(-1, (HEADS, d_k)).transpose(1, 2)  # (B, H, 16, d_k)
        k = seen[i]["kv"][..., :DIM].unflatten(-1, (HEADS, d_k)).transpose(1, 2)  # (B, H, 4, d_k)
        assert q.shape[2] == 16 and k.shape[2] == 4
        logits = q @ k.transpose(-1, -2) * d_k**-0.5
        p = logits.softmax(-1)
        entropy = -(p * p.log()).sum(-1)  # (B, H, N)
        want = {
            "entropy": entropy.mean(dim=(0, 2)),
            "entropy_norm": (entropy / math.log(4)).mean(dim=(0, 2)),
            "max_prob": p.amax(-1).mean(dim=(0, 2)),
            "max_logit": logits.amax(dim=(0, 2, 3)),
        }
        for name, value in want.items():
            assert_close(monitor.latest[name][i].double(), value, rtol=1e-5, atol=1e-6)


class Unplaced(nn.Module):
    """Attention whose query/key projection has a name no rule knows (``to_scores``)."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.to_scores, self.to_values, self.groups = nn.Linear(d, 2 * d), nn.Linear(d, d), heads

    def forward(self, x):  # (B, N, d)
        b, n, d = x.shape
        q, k = self.to_scores(x).view(b, n, 2, self.groups, -1).permute(2, 0, 3, 1, 4)
        v = self.to_values(x).view(b, n, self.groups, -1).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)


class Mixed(nn.Module):
    """One block timm-like (``q``/``kv``, placed), one :class:`Unplaced`, or two unplaced."""

    def __init__(self, placed: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 16)
        first = pvt_v2.Attention(16, num_heads=2) if placed else Unplaced()
        self.blocks = nn.ModuleList([first, Unplaced()])
        self.head = nn.Linear(16, 5)
        self.placed = placed

    def forward(self, x):  # (B, 16, 4)
        h = self.embed(x)
        for block in self.blocks:
            h = h + (block(h, [4, 4]) if isinstance(block, pvt_v2.Attention) else block(h))
        return self.head(h.mean(1))


class MixedTask(Classify):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        inputs, labels = torch.randn(8, 16, 4, generator=g), torch.randint(5, (8,), generator=g)
        return DataLoader(TensorDataset(inputs, labels), batch_size=2)


@pytest.mark.parametrize("placed", [True, False], ids=["one-placed", "none-placed"])
def test_layers_whose_weights_no_rule_places_are_one_warning_and_the_rest_is_measured(placed):
    torch.manual_seed(0)
    twin = MixedTask(Mixed(placed))
    fit(twin, [])
    torch.manual_seed(0)
    task = MixedTask(Mixed(placed))
    monitor = QKMonitor(every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(task, [monitor])
    for ours, theirs in zip(task.losses, twin.losses, strict=True):
        assert torch.equal(ours, theirs)
    messages = [str(w.message) for w in caught if "not found" in str(w.message)]
    assert len(messages) == 1, messages
    unplaced = ["model.blocks.1"] if placed else ["model.blocks.0", "model.blocks.1"]
    assert str(unplaced) in messages[0] and "AttentionSpec" in messages[0]
    assert all(torch.isfinite(v).all() for v in monitor.latest["entropy"])  # every layer's
    if placed:  # the placed layer's κ is measured, the other's NaN
        kappa = monitor.latest["kappa"]
        assert torch.isfinite(kappa[0]).all() and kappa[1].isnan().all()
    else:  # the spectrum measures nothing; the others go on
        assert monitor.spectrum.layers == [] and "kappa" not in monitor.latest

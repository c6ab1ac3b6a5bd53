"""EffectiveRankMonitor: the residual stream's and the attention matrices' rank, and what the
papers say the monitor must see (Dong et al. 2021 rank collapse; benign vs malignant sparsity)."""

from __future__ import annotations

import copy
import math
import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from qkmonitor.alerts import MalignantCollapseWarning, RankCollapseWarning
from qkmonitor.callbacks import AttentionEntropyMonitor, EffectiveRankMonitor
from qkmonitor.models.rope import apply_rotary_pos_emb


def np_erank(s: np.ndarray) -> float:
    p = s / s.sum()
    p = p[p > 0]
    return float(np.exp(-(p * np.log(p)).sum()))


def test_logged_ranks_equal_naive_float64_on_the_probe_slice(tmp_path, make_task, scalars_of):
    task, data = make_task(n_kv_heads=2)
    data.setup()
    batch = next(iter(data.train_dataloader()))[0]
    initial = copy.deepcopy(task.model)
    outputs, inputs = {}, {}
    hooks = []
    for i, block in enumerate(initial.blocks):
        hooks.append(block.register_forward_hook(lambda m, a, o, i=i: outputs.__setitem__(i, o)))
        hooks.append(
            block.attn.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0]))
        )
    with torch.no_grad():
        initial(batch)
    for hook in hooks:
        hook.remove()

    monitor = EffectiveRankMonitor(
        every_n_steps=5, per_head=True, max_probe_sequences=3, max_probe_tokens=6
    )
    pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=1,
        logger=TensorBoardLogger(tmp_path, "run", 0),
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    ).fit(task, datamodule=data)
    scalars = scalars_of(tmp_path / "run" / "version_0")

    for layer, block in enumerate(initial.blocks):
        x = (
            outputs[layer][:3, :6].detach().double().numpy()
        )  # the capped slice: 3 sequences, 6 tokens
        erank = np.mean([np_erank(np.linalg.svd(xs, compute_uv=False)) for xs in x])
        collapse = np.mean([np.linalg.norm(xs - xs.mean(0)) / np.linalg.norm(xs) for xs in x])
        assert scalars[f"qkmonitor/hidden_erank/layer_{layer:02d}"][0] == (
            0,
            pytest.approx(erank, rel=1e-4),
        )
        assert scalars[f"qkmonitor/hidden_collapse/layer_{layer:02d}"][0] == (
            0,
            pytest.approx(collapse, rel=1e-4),
        )
        assert (
            f"qkmonitor/hidden_erank/layer_{layer:02d}_head_00" not in scalars
        )  # one value per layer

        attn, h_in = block.attn, inputs[layer].detach().double()
        n = h_in.shape[1]
        q = (h_in @ attn.q_proj.weight.detach().double().T).view(-1, n, 4, 8).transpose(1, 2)
        k = (
            (h_in @ attn.k_proj.weight.detach().double().T)
            .view(-1, n, 2, 8)
            .transpose(1, 2)
            .repeat_interleave(2, 1)
        )
        cos, sin = attn.rope.cos[:n].double(), attn.rope.sin[:n].double()
        q, k = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)
        s = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(
            ~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf
        )
        p = s.softmax(-1)[:3, :, :6].numpy()  # (3, H, 6 rows, all n keys)
        for head in range(4):
            ranks = [np_erank(np.linalg.svd(p[seq, head], compute_uv=False)) for seq in range(3)]
            got = scalars[f"qkmonitor/attn_erank/layer_{layer:02d}_head_{head:02d}"][0][1]
            assert got == pytest.approx(np.mean(ranks), rel=1e-4)
            norm = scalars[f"qkmonitor/attn_erank_norm/layer_{layer:02d}_head_{head:02d}"][0][1]
            assert norm == pytest.approx(np.mean(ranks) / 6, rel=1e-4)
            rows = p[:, head, 1:]  # rows with more than one key
            ent = -(rows * np.log(np.where(rows > 0, rows, 1.0))).sum(-1) / np.log(np.arange(2, 7))
            got = scalars[f"qkmonitor/attn_entropy_norm/layer_{layer:02d}_head_{head:02d}"][0][1]
            assert got == pytest.approx(ent.mean(), rel=1e-4)


class AttentionStack(pl.LightningModule):
    """Layers of nn.MultiheadAttention only (no MLP), with or without skip connections."""

    class Block(nn.Module):
        def __init__(self, d: int, heads: int, skip: bool):
            super().__init__()
            self.attn, self.skip = nn.MultiheadAttention(d, heads, batch_first=True), skip

        def forward(self, x):
            out = self.attn(x, x, x, need_weights=False)[0]
            return x + out if self.skip else out

    def __init__(
        self,
        skip: bool,
        depth: int = 6,
        d: int = 32,
        inputs: torch.Tensor | None = None,
        blocks: list[nn.Module] | None = None,
    ):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(blocks or [self.Block(d, 4, skip) for _ in range(depth)])
        self.inputs = torch.randn(8, 16, d) if inputs is None else inputs

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def training_step(self, batch, batch_idx):
        return self(batch[0]).square().mean()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(self.inputs), batch_size=8
        )

    def configure_optimizers(self):
        return torch.optim.SGD(
            self.parameters(), lr=0.0
        )  # frozen: the probes see the built weights


def fit_and_catch(model, monitor, tmp_path, steps=3):
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=steps,
        logger=False,
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    return caught


def test_pure_attention_collapses_to_rank_one_and_skips_prevent_it(tmp_path):
    """Dong et al. 2021: without skip connections, attention-only layers drive every token to the
    same vector (doubly exponentially in depth); the residual path keeps the rank."""
    pure, skip = EffectiveRankMonitor(every_n_steps=1), EffectiveRankMonitor(every_n_steps=1)
    caught_pure = fit_and_catch(AttentionStack(skip=False), pure, tmp_path)
    caught_skip = fit_and_catch(AttentionStack(skip=True), skip, tmp_path)
    collapse_pure = [v.item() for v in pure.latest["hidden_collapse"]]
    collapse_skip = [v.item() for v in skip.latest["hidden_collapse"]]
    assert collapse_pure[0] > 0.1 and collapse_pure[1] < 1e-3  # below 1e-3 by the second layer
    assert max(collapse_pure[2:]) < 1e-5  # and at float32's floor after that
    assert min(collapse_skip) > 0.5
    rank_alerts = [w for w in caught_pure if issubclass(w.category, RankCollapseWarning)]
    assert rank_alerts and "hidden_collapse" in str(rank_alerts[0].message)
    assert ", head" not in str(rank_alerts[0].message)  # a layer-level rule names no head
    assert not [w for w in caught_skip if issubclass(w.category, RankCollapseWarning)]


def designed_attention(pattern: str) -> tuple[list[nn.Module], torch.Tensor]:
    """One MHA layer whose attention is identity-like or sink-like by construction.

    Token i is ``e_i + e_15`` (i < 8) and token 0 also carries ``e_14``. Identity: W_Q = W_K = 10 I,
    so q_i . k_j is large only for i = j. Sink: W_Q maps the shared e_15 and W_K the marker e_14
    onto one direction, so every query scores key 0 highest: A = 1 e_0^T, rank one.
    """
    d, n = 16, 8
    x = torch.eye(d)[:n] + torch.eye(d)[15]
    x[0, 14] = 1.0
    block = AttentionStack.Block(d, 1, skip=False)
    mha = block.attn
    with torch.no_grad():
        mha.in_proj_bias.zero_()
        w_q, w_k = torch.zeros(d, d), torch.zeros(d, d)
        if pattern == "identity":
            w_q[:14, :14] = 10 * torch.eye(14)
            w_k[:14, :14] = 10 * torch.eye(14)
        else:
            w_q[0, 15] = 10.0  # every token's e_15 -> direction 0
            w_k[0, 14] = 10.0  # only token 0's marker -> direction 0
        mha.in_proj_weight[:d] = w_q
        mha.in_proj_weight[d : 2 * d] = w_k
    return [block], x.expand(4, n, d).clone()


@pytest.mark.parametrize("pattern", ["identity", "sink"])
def test_benign_identity_attention_and_malignant_sink_attention_are_told_apart(tmp_path, pattern):
    blocks, inputs = designed_attention(pattern)
    rank, entropy = EffectiveRankMonitor(every_n_steps=1), AttentionEntropyMonitor(every_n_steps=1)
    model = AttentionStack(skip=False, inputs=inputs, blocks=blocks)
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=3,
        logger=False,
        callbacks=[rank, entropy],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    # both are sparse: near one-hot rows
    assert entropy.latest["entropy_norm"][0].item() < 0.05
    malignant = [w for w in caught if issubclass(w.category, MalignantCollapseWarning)]
    erank_norm = rank.latest["attn_erank_norm"][0].item()
    if pattern == "identity":
        assert erank_norm > 0.9 and not malignant  # full rank: benign
    else:
        assert erank_norm < 0.2 and len(malignant) == 1  # rank one: malignant, once
        assert "attn_entropy_norm" in str(malignant[0].message) and "attn_erank <= 1.5" in str(
            malignant[0].message
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_probe_sequences": 0}, "`max_probe_sequences`"),
        ({"max_probe_tokens": 1.5}, "`max_probe_tokens`"),
    ],
)
def test_bad_probe_caps_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EffectiveRankMonitor(**kwargs)

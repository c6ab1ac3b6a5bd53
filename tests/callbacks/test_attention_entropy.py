"""AttentionEntropyMonitor against explicit float64 attention, on real Trainers."""

from __future__ import annotations

import copy
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from qkmonitor.alerts import ENTROPY_COLLAPSE_RULE, EntropyCollapseWarning
from qkmonitor.attention.adapters import find_attention_layers
from qkmonitor.attention.probes import ProbeRequest
from qkmonitor.callbacks import AttentionEntropyMonitor
from qkmonitor.models.rope import apply_rotary_pos_emb


def explicit_probs(attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 causal attention probabilities and scaled logits of a bundled MultiHeadAttention."""
    b, n, _ = x.shape
    x = x.double()
    h, g, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = (x @ attn.q_proj.weight.double().T).view(b, n, h, d).transpose(1, 2)
    k = (
        (x @ attn.k_proj.weight.double().T)
        .view(b, n, g, d)
        .transpose(1, 2)
        .repeat_interleave(h // g, dim=1)
    )
    cos, sin = attn.rope.cos[:n].double(), attn.rope.sin[:n].double()
    q, k = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)  # standard scale, written out
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1), scores


def reference_head_values(model, batch_tokens: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Per layer: entropy, entropy_norm, max_prob, max_logit per head, from explicit attention."""
    inputs = {}
    hooks = [
        block.attn.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0]))
        for i, block in enumerate(model.blocks)
    ]
    with torch.no_grad():
        model(batch_tokens)
    for hook in hooks:
        hook.remove()
    out = []
    for i, block in enumerate(model.blocks):
        p, s = explicit_probs(block.attn, inputs[i])
        n = torch.arange(1, p.shape[-1] + 1, dtype=torch.float64)  # keys row i may attend
        entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)  # (B, H, N)
        norm = entropy[..., 1:] / n[1:].log()  # rows with one key are left out
        out.append(
            {
                "entropy": entropy.mean(dim=(0, 2)),
                "entropy_norm": norm.mean(dim=(0, 2)),
                "max_prob": p.amax(-1).mean(dim=(0, 2)),
                "max_logit": s.amax(-1).amax(dim=(0, 2)),
                "sink_mass": p[..., :2].sum(-1).mean(dim=(0, 2)),  # mass on the first two keys
            }
        )
    return out


def test_logged_entropy_equals_explicit_attention_of_the_probed_batch(
    tmp_path, make_task, scalars_of
):
    task, data = make_task(n_kv_heads=2)
    data.setup()
    first_batch = next(iter(data.train_dataloader()))[0]
    initial = copy.deepcopy(task.model)
    expected = reference_head_values(initial, first_batch)

    monitor = AttentionEntropyMonitor(every_n_steps=2, per_head=True, sink_tokens=2)
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=3,
        logger=TensorBoardLogger(tmp_path, "run", 0),
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        log_every_n_steps=1,
    )
    trainer.fit(task, datamodule=data)
    scalars = scalars_of(tmp_path / "run" / "version_0")
    for layer, values in enumerate(expected):
        for metric, heads in values.items():
            tag = f"qkmonitor/{metric}/layer_{layer:02d}"
            assert [s for s, _ in scalars[tag]] == [0, 2], tag  # step 0 probes the first batch
            assert scalars[tag][0][1] == pytest.approx(heads.mean().item(), rel=1e-4, abs=1e-5), tag
            for head in range(4):
                got = scalars[f"{tag}_head_{head:02d}"][0][1]
                assert got == pytest.approx(heads[head].item(), rel=1e-4, abs=1e-5), (tag, head)
        assert scalars[f"qkmonitor/entropy_norm_min/layer_{layer:02d}"][0][1] == pytest.approx(
            values["entropy_norm"].min().item(), rel=1e-4
        )
        assert scalars[f"qkmonitor/max_logit_max/layer_{layer:02d}"][0][1] == pytest.approx(
            values["max_logit"].max().item(), rel=1e-4
        )
    # probing is off again after the probe, and validation-free training ran to the end
    assert trainer.global_step == 3 and not any(block.attn.probing for block in task.model.blocks)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masks", ["none", "padding", "causal", "causal+padding", "float-bias"])
def test_multihead_attention_statistics_match_its_own_attention_weights(batch_first, masks):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=batch_first)
    x = torch.randn(3, 6, 16)
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[1, 4:] = True  # True = ignore, as MHA has it
    padding[2, :] = True  # a fully padded sequence: no row may attend anything
    attn_mask = None
    if "causal" in masks:
        attn_mask = nn.Transformer.generate_square_subsequent_mask(6)
    elif masks == "float-bias":
        attn_mask = torch.randn(6, 6)  # an arbitrary additive bias: the explicit path
    key_padding_mask = padding if "padding" in masks else None
    inp = x if batch_first else x.transpose(0, 1)

    layer = find_attention_layers(mha)[0]
    probe = layer.open_probe(ProbeRequest(sink_tokens=1))
    with torch.no_grad():
        mha(
            inp,
            inp,
            inp,
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            need_weights=False,
        )
    stats = probe.close().stats[0]
    assert not mha._forward_pre_hooks  # the hook is gone

    with torch.no_grad():
        _, p = mha(
            inp,
            inp,
            inp,
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            need_weights=True,
            average_attn_weights=False,
        )  # (B, H, N, M), torch's own softmax
    p = torch.nan_to_num(p.double())  # torch gives NaN for fully masked rows
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    torch.testing.assert_close(stats.entropy.double(), entropy, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stats.max_prob.double(), p.amax(-1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stats.sink_mass.double(), p[..., 0], rtol=1e-4, atol=1e-5)
    live = p.sum(-1) > 0.5
    assert torch.equal(stats.attended > 0, live)


def test_entropy_monitor_on_a_user_transformer_encoder(tmp_path, scalars_of):
    class Encoder(pl.LightningModule):
        def __init__(self):
            super().__init__()
            layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

        def training_step(self, batch, batch_idx):
            mask = nn.Transformer.generate_square_subsequent_mask(5)
            return self.encoder(batch[0], mask=mask, is_causal=True).square().mean()

        def train_dataloader(self):
            x = torch.randn(16, 5, 16, generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Encoder()
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=2,
        logger=TensorBoardLogger(tmp_path, "run", 0),
        callbacks=[AttentionEntropyMonitor(every_n_steps=1)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
    )
    trainer.fit(model)
    scalars = scalars_of(tmp_path / "run" / "version_0")
    for layer in range(2):
        values = scalars[f"qkmonitor/entropy_norm/layer_{layer:02d}"]
        assert [s for s, _ in values] == [0, 1]
        assert all(0.0 < v <= 1.0 for _, v in values)
    assert not any(m._forward_pre_hooks for m in model.modules())  # nothing left behind


class GrowQueries(pl.Callback):
    """Multiplies every query projection by ``factor`` before each training batch: logits grow
    geometrically, as in attention-logit growth."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        with torch.no_grad():
            for block in pl_module.model.blocks:
                block.attn.q_proj.weight.mul_(self.factor)


@pytest.mark.parametrize(
    ("q_scale", "growth", "collapses"), [(30.0, 1.0, False), (0.1, 1.0, False), (30.0, 1.05, True)]
)
def test_entropy_collapse_needs_sharp_heads_whose_logits_keep_growing(
    tmp_path, make_task, q_scale, growth, collapses
):
    # 30x queries make every head near one-hot; at lr 0 with steady weights that is a sharp head,
    # not a collapse in progress (the rule also needs max_logit growing x2 per 30 steps). Queries
    # growing 5 % a step grow the logits x4.3 per 30 steps: the rule fires at the first probe 30
    # steps after another (probes every 10 steps: at step 30). The rule is opt-in (not a default):
    # passed here explicitly.
    task, data = make_task(lr=0.0)
    with torch.no_grad():
        for block in task.model.blocks:
            block.attn.q_proj.weight.mul_(q_scale)
    monitor = AttentionEntropyMonitor(every_n_steps=10, alerts=[ENTROPY_COLLAPSE_RULE])
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=31,
        logger=False,
        callbacks=[GrowQueries(growth), monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(task, datamodule=data)
    fired = [w for w in caught if issubclass(w.category, EntropyCollapseWarning)]
    assert bool(fired) == collapses
    worst = min(heads.min().item() for heads in monitor.latest["entropy_norm"])
    assert (worst <= ENTROPY_COLLAPSE_RULE.threshold) == (q_scale > 1)  # sharp either way
    if collapses:
        message = str(fired[0].message)
        assert "at step 30" in message and "max_logit = " in message and "Evidence:" in message


def test_layers_without_statistics_are_an_error_that_says_so(tmp_path, make_task):
    from qkmonitor.attention.adapters import AttentionLayer
    from qkmonitor.measures.layer_spectra import QKWeights

    class WeightsOnly(AttentionLayer):
        def qk_weights(self):
            return QKWeights(self.module.q_proj.weight, self.module.k_proj.weight, 4, 4, 0.25)

    task, data = make_task()
    monitor = AttentionEntropyMonitor(layers=lambda m: [WeightsOnly("a", m.model.blocks[0].attn)])
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=1,
        logger=False,
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with pytest.raises(ValueError, match="give no attention statistics"):
        trainer.fit(task, datamodule=data)

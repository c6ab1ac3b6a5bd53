"""Models whose parameters hold no data: on the meta device (built there, to be materialised later)
or lazy and not yet materialised. Such a model is not measured, with one warning that says why,
and the training loop goes on; a meta model is measured from the first probe after it is
materialised, and a lazy one once a forward ran before the monitors were bound."""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from qkmonitor.callbacks import AttentionEntropyMonitor, EffectiveRankMonitor, QKSpectrumMonitor
from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKClipEngine, QKSpectrum
from qkmonitor.engine.updates import UPDATE_METRICS

from ..callbacks.zoo import MODELS, SEQ, VOCAB


def engines():
    return [QKSpectrum(), AttentionEntropy(), EffectiveRank(max_probe_tokens=4)]


def no_data_warnings(caught) -> list[str]:
    return [
        str(w.message)
        for w in caught
        if "hold no data" in str(w.message) or "lazy" in str(w.message)
    ]


@pytest.mark.parametrize("kind", ["bundled", "torch-mha", "hf-llama"])
def test_a_meta_model_is_not_measured_with_one_warning_then_measured_once_materialised(kind):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = MODELS[kind]()
    monitored = engines()
    tokens = torch.randint(VOCAB, (2, SEQ))
    try:  # the model's own forward on the meta device, unmonitored
        model(tokens.to("meta"))
    except RuntimeError as err:  # transformers 4.48's rotary embedding enters autocast("meta")
        pytest.skip(f"{kind}'s bare forward does not run on the meta device here: {err}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        monitoring = Monitoring(model, monitored, every_n_steps=1)
        for step in range(3):  # the bare forward runs on the meta device
            with monitoring.step(step):
                out = model(tokens.to("meta"))
                assert getattr(out, "logits", out).is_meta
        assert all(
            engine.latest == {} and engine.schedule.latest_step is None for engine in monitored
        )
        (message,) = no_data_warnings(caught)
        assert (
            "hold no data" in message and "meta device" in message and "training goes on" in message
        )

        model.to_empty(device="cpu")  # materialised, then initialised: as a twin built on the CPU
        torch.manual_seed(0)
        twin = MODELS[kind]()
        sources = dict(twin.named_parameters(remove_duplicate=False)) | dict(twin.named_buffers())
        with torch.no_grad():
            for name, target in [*model.named_parameters(), *model.named_buffers()]:
                target.copy_(sources[name])
        with monitoring.step(3):
            model(tokens)
        monitoring.close()
    assert len(no_data_warnings(caught)) == 1
    for engine in monitored:
        assert engine.schedule.latest_step == 3
        values = [  # (the update metrics: no optimizer in this loop, undefined)
            v
            for name, layers in engine.latest.items()
            if name not in UPDATE_METRICS
            for heads in layers
            for v in heads.tolist()
        ]
        assert values and all(math.isfinite(v) for v in values), type(engine).__name__


class LazyAttention(nn.Module):
    """Self-attention whose projections are ``nn.LazyLinear`` (materialised at its first
    forward)."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj = nn.LazyLinear(d), nn.LazyLinear(d), nn.LazyLinear(d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (
            p(x).view(b, n, self.heads, -1).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        return (
            F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, d)
        )


class LazyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([LazyAttention(), LazyAttention()])

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def test_a_lazy_model_not_materialised_is_not_measured_and_trains_with_one_warning():
    torch.manual_seed(0)
    model = LazyModel()
    x = torch.randn(2, 8, 16)
    monitored = [*engines(), QKClipEngine(tau=100.0)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        with Monitoring(model, monitored, every_n_steps=1) as monitoring:
            optimizer = None
            for step in range(3):
                with monitoring.step(step):
                    loss = model(x).square().mean()
                    monitoring.observe_loss(loss)
                    loss.backward()
                optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1)
                optimizer.step()
    (message,) = no_data_warnings(caught)
    assert "'blocks.0.q_proj.weight' and 11 more" in message and "run one forward" in message
    assert all(engine.layers == [] and engine.latest == {} for engine in monitored)

    # as the warning says: one forward first, and the layers are found and measured
    monitored = engines()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fresh = LazyModel()
        fresh(x)
        with Monitoring(fresh, monitored, every_n_steps=1) as monitoring, monitoring.step(0):
            fresh(x)
    assert all(len(engine.layers) == 2 and engine.schedule.latest_step == 0 for engine in monitored)


class LazyTask(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = LazyModel()

    def training_step(self, batch, batch_idx):
        return self.model(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 8, 16)), batch_size=4)


def test_a_lazy_model_in_a_lightning_fit_trains_to_its_end_with_one_warning(tmp_path):
    monitors = [QKSpectrumMonitor(), AttentionEntropyMonitor(), EffectiveRankMonitor()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        trainer = pl.Trainer(
            default_root_dir=tmp_path,
            max_steps=4,
            callbacks=monitors,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.fit(LazyTask())
    assert trainer.global_step == 4
    assert len(no_data_warnings(caught)) == 1

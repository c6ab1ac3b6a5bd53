"""A Lightning fit on CUDA in bf16-mixed precision with all three monitors, on the bundled decoder.

The bundled attention runs the Triton kernel (``backend="auto"`` on CUDA) under autocast; every
monitor probes every step; every statistic they keep and log must be finite.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger

from qkmonitor.callbacks import AttentionEntropyMonitor, EffectiveRankMonitor, QKSpectrumMonitor
from qkmonitor.models import TransformerConfig
from qkmonitor.models.tasks import AssociativeRecallDataModule, CausalLMTask

pytestmark = pytest.mark.gpu


class RecordingLogger(Logger):
    """Keeps every logged scalar: ``metrics[key] = [(step, value), ...]``."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[str, list[tuple[int, float]]] = {}

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        for key, value in metrics.items():
            self.metrics.setdefault(key, []).append((step, float(value)))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


class DeviceSeen(pl.Callback):
    """The device the model's parameters are on at each training step (Lightning moves the model
    back to the CPU when a fit ends)."""

    def __init__(self) -> None:
        self.devices: set[str] = set()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.devices.add(next(pl_module.parameters()).device.type)


def test_bf16_mixed_fit_with_all_monitors(tmp_path):
    data = AssociativeRecallDataModule(num_pairs=4, num_queries=4, num_keys=16, num_values=16,
                                       batch_size=16, train_size=256, val_size=32,
                                       seed=0)  # fmt: skip
    config = TransformerConfig(
        vocab_size=data.vocab_size, d_model=128, n_layers=2, n_heads=2, max_seq_len=data.seq_len
    )  # fmt: skip  (head dim 64)
    monitors = [QKSpectrumMonitor(every_n_steps=1), AttentionEntropyMonitor(every_n_steps=1),
                EffectiveRankMonitor(every_n_steps=1)]  # fmt: skip
    logger = RecordingLogger()
    # a new list: the Trainer appends its own callbacks to the list it is given
    trainer = pl.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=6,
                         log_every_n_steps=1, default_root_dir=tmp_path, logger=logger,
                         callbacks=[*monitors, seen := DeviceSeen()], enable_progress_bar=False,
                         enable_checkpointing=False, limit_val_batches=0)  # fmt: skip
    task = CausalLMTask(config, lr=3e-3, warmup_steps=0)
    trainer.fit(task, datamodule=data)
    assert trainer.global_step == 6
    assert seen.devices == {"cuda"}
    for monitor in monitors:
        assert monitor.latest, type(monitor).__name__
        for metric, per_layer in monitor.latest.items():
            assert len(per_layer) == config.n_layers, metric
            for layer, values in enumerate(per_layer):
                assert torch.isfinite(values).all(), (type(monitor).__name__, metric, layer)
    logged = {key: values for key, values in logger.metrics.items() if key.startswith("qkmonitor/")}
    assert logged
    for family in ("entropy", "kappa", "hidden_erank"):
        assert any(f"/{family}/" in key for key in logged), family
    # NaN by definition (docs/metrics.md): the update metrics before the first optimizer step
    undefined_at_first_probe = ("update_ratio", "grad_norm")
    bad = {
        key: values
        for key, values in logged.items()
        if not all(
            math.isfinite(v)
            for step, v in values
            if not (step == 0 and any(name in key for name in undefined_at_first_probe))
        )
    }
    assert not bad, bad
    assert any("update_ratio" in key for key in logged)

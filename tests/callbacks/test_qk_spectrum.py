"""QKSpectrumMonitor on a real Trainer, read back with TensorBoard's EventAccumulator."""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import nn

from qkmonitor import OverLocalizationWarning
from qkmonitor.alerts import KAPPA_RULE
from qkmonitor.callbacks import QKSpectrumMonitor

#: kappa as a level (the default rule is a trend, which a constant kappa never fires): the old rule
LEVEL_KAPPA = KAPPA_RULE.replace(
    threshold=0.8, growth=None, window=None, patience=2, skip_qk_norm=False
)
METRICS = ("kappa", "kappa_eig", "eig_mean", "eig_var", "qk_erank", "qk_spectral_norm")
WORST = {"kappa": "max", "kappa_eig": "max", "qk_erank": "min", "qk_spectral_norm": "max"}


def trainer_for(tmp_path, monitor, max_steps=4, logger=True, **kwargs):
    if logger is True:
        logger = TensorBoardLogger(tmp_path, name="run", version=0)
    return pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=max_steps,
        logger=logger,
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
        limit_val_batches=0,
        accelerator="cpu",
        **kwargs,
    )


def naive_head_metrics(
    w_q: torch.Tensor, w_k: torch.Tensor, num_heads: int, num_kv_heads: int, scale: float
):
    """kappa, kappa_eig, qk_erank, spectral norm per head from the dense d x d W_QK in float64."""
    d_k = w_q.shape[0] // num_heads
    out = {
        m: [] for m in ("kappa", "kappa_eig", "eig_mean", "eig_var", "qk_erank", "qk_spectral_norm")
    }
    for h in range(num_heads):
        g = h // (num_heads // num_kv_heads)
        w_qk = (
            w_q[h * d_k : (h + 1) * d_k].double().numpy().T
            @ w_k[g * d_k : (g + 1) * d_k].double().numpy()
        )
        s = np.linalg.svd(w_qk, compute_uv=False)
        lam = np.linalg.eigvals(w_qk)
        lam = lam[np.argsort(-np.abs(lam))][:d_k]
        p = s / s.sum()
        p = p[p > 0]
        out["kappa"].append(s[0] / s.sum())
        out["kappa_eig"].append(np.abs(lam).max() / np.abs(lam).sum())
        out["eig_mean"].append(np.trace(w_qk) / d_k)
        out["eig_var"].append(np.mean(np.abs(lam - lam.mean()) ** 2))
        out["qk_erank"].append(math.exp(-(p * np.log(p)).sum()))
        out["qk_spectral_norm"].append(s[0] * scale)
    return {m: np.array(v) for m, v in out.items()}


def test_logged_spectrum_matches_naive_svd_of_the_trained_weights(tmp_path, make_task, scalars_of):
    task, data = make_task(n_kv_heads=2)
    monitor = QKSpectrumMonitor(every_n_steps=2, per_head=True)
    trainer_for(tmp_path, monitor).fit(task, datamodule=data)
    scalars = scalars_of(tmp_path / "run" / "version_0")

    for layer, block in enumerate(task.model.blocks):
        attn = block.attn
        expected = naive_head_metrics(
            attn.q_proj.weight.detach(),
            attn.k_proj.weight.detach(),
            4,
            2,
            1 / math.sqrt(attn.head_dim),
        )
        for metric in METRICS:
            tag = f"qkmonitor/{metric}/layer_{layer:02d}"
            assert [step for step, _ in scalars[tag]] == [0, 2, 4], tag  # start, then every 2 steps
            assert scalars[tag][-1][1] == pytest.approx(
                expected[metric].mean(), rel=1e-4, abs=1e-5
            ), tag
            for head in range(4):
                value = scalars[f"{tag}_head_{head:02d}"][-1][1]
                assert value == pytest.approx(expected[metric][head], rel=1e-4, abs=1e-5), (
                    tag,
                    head,
                )
            if metric in WORST:
                worst = expected[metric].max() if WORST[metric] == "max" else expected[metric].min()
                worst_tag = f"qkmonitor/{metric}_{WORST[metric]}/layer_{layer:02d}"
                assert scalars[worst_tag][-1][1] == pytest.approx(worst, rel=1e-4)
    assert "qkmonitor/alerts/kappa" not in scalars  # no alert: no counter series
    assert monitor.latest_step == 4


def test_user_transformer_encoder_is_monitored_with_its_own_prefix(tmp_path, scalars_of):
    class EncoderModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

        def training_step(self, batch, batch_idx):
            return self.encoder(batch[0]).square().mean()

        def train_dataloader(self):
            x = torch.randn(16, 5, 16, generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = EncoderModule()
    trainer_for(
        tmp_path, QKSpectrumMonitor(every_n_steps=1, log_key_prefix="enc"), max_steps=2
    ).fit(model)
    scalars = scalars_of(tmp_path / "run" / "version_0")
    for layer in range(2):
        w = model.encoder.layers[layer].self_attn.in_proj_weight.detach()
        expected = naive_head_metrics(w[:16], w[16:32], 2, 2, 1 / math.sqrt(8))
        assert scalars[f"enc/kappa/layer_{layer:02d}"][-1][1] == pytest.approx(
            expected["kappa"].mean(), rel=1e-4
        )
    assert not any(tag.startswith("qkmonitor/") for tag in scalars)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_n_steps": 0}, "`every_n_steps` to be a positive int or None, got 0"),
        ({"every_n_steps": 2.5}, "`every_n_steps`"),
        ({"per_head": "yes"}, "`per_head` to be a bool"),
        ({"log_key_prefix": ""}, "`log_key_prefix`"),
        ({"log_key_prefix": "a/"}, "`log_key_prefix`"),
        ({"alert_action": "explode"}, "`alert_action` to be one of"),
        ({"alerts": [0.8]}, r"`alerts\[0\]` to be an AlertRule, got float"),
        ({"alerts": [KAPPA_RULE, KAPPA_RULE]}, "unique rule names"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QKSpectrumMonitor(**kwargs)


def test_bad_rule_fields_name_the_field():
    with pytest.raises(ValueError, match="`patience`"):
        KAPPA_RULE.replace(patience=0)
    with pytest.raises(ValueError, match="`margin`"):
        KAPPA_RULE.replace(margin=-0.1)


def test_model_without_attention_fails_at_setup_with_what_was_looked_for(tmp_path):
    class NoAttention(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).mean()

        def train_dataloader(self):
            return torch.utils.data.DataLoader(
                torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4
            )

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(ValueError, match="No attention layers found in NoAttention: looked for"):
        trainer_for(tmp_path, QKSpectrumMonitor()).fit(NoAttention())


def test_nan_weight_gives_nan_metric_one_warning_and_training_goes_on(
    tmp_path, make_task, scalars_of
):
    task, data = make_task()
    with torch.no_grad():
        task.model.blocks[1].attn.q_proj.weight[0, 0] = float("nan")  # head 0 of layer 1
    monitor = QKSpectrumMonitor(every_n_steps=1, per_head=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = trainer_for(tmp_path, monitor)
        trainer.fit(task, datamodule=data)
    assert trainer.global_step == 4
    nonfinite = [str(w.message) for w in caught if "non-finite values" in str(w.message)]
    # one warning when layer 1 goes bad (naming the head), one more when the NaN reaches layer 0
    assert len(nonfinite) == 2
    assert "at step 0 in layer 1 (model.blocks.1.attn): kappa heads [0]" in nonfinite[0]
    assert "at step 1 in layer 0 (model.blocks.0.attn)" in nonfinite[1]
    scalars = scalars_of(tmp_path / "run" / "version_0")
    # The probe at step 0 comes before any update: only the poisoned head is NaN.
    assert scalars["qkmonitor/kappa/layer_01_head_00"][0][0] == 0
    assert math.isnan(scalars["qkmonitor/kappa/layer_01_head_00"][0][1])
    assert math.isnan(scalars["qkmonitor/kappa/layer_01"][0][1])
    assert math.isnan(scalars["qkmonitor/kappa_max/layer_01"][0][1])
    assert math.isfinite(scalars["qkmonitor/kappa/layer_01_head_01"][0][1])
    assert math.isfinite(scalars["qkmonitor/kappa/layer_00"][0][1])
    # The NaN loss then spreads to every weight; the metrics follow, warned once more for layer 0.
    assert [step for step, _ in scalars["qkmonitor/kappa/layer_00"]] == [0, 1, 2, 3, 4]
    assert math.isnan(scalars["qkmonitor/kappa/layer_00"][-1][1])


def make_rank_one(task) -> None:
    """Every head's W_QK of rank one: kappa = 1 in all heads."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for block in task.model.blocks:
            w = block.attn.q_proj.weight
            w.copy_(
                torch.randn(w.shape[0], 1, generator=gen)
                @ torch.randn(1, w.shape[1], generator=gen)
            )


def test_kappa_alert_fires_once_per_head_after_patience(tmp_path, make_task, scalars_of):
    task, data = make_task(lr=0.0)
    make_rank_one(task)
    monitor = QKSpectrumMonitor(every_n_steps=1, alerts=[LEVEL_KAPPA.replace(patience=3)])
    with pytest.warns(OverLocalizationWarning) as record:
        trainer_for(tmp_path, monitor, max_steps=5).fit(task, datamodule=data)
    alerts = [w for w in record if issubclass(w.category, OverLocalizationWarning)]
    assert len(alerts) == 2 * 4  # every (layer, head) once, though kappa stays at 1 for 6 probes
    message = str(alerts[0].message)
    assert "layer 0 (model.blocks.0.attn), head 0: kappa = 1" in message
    assert "threshold kappa >= 0.8" in message and "at step 2" in message  # probes 0, 1, 2
    assert "learning rate 0" in message and "QK-norm" in message
    counts = scalars_of(tmp_path / "run" / "version_0")["qkmonitor/alerts/kappa"]
    assert counts == [(2, 8.0), (3, 8.0), (4, 8.0), (5, 8.0)]  # from the first alert on


def test_alert_action_stop_ends_training_and_raise_raises(tmp_path, make_task):
    task, data = make_task(lr=0.0)
    make_rank_one(task)
    trainer = trainer_for(
        tmp_path,
        QKSpectrumMonitor(every_n_steps=1, alert_action="stop", alerts=[LEVEL_KAPPA]),
        max_steps=10,
    )
    with pytest.warns(OverLocalizationWarning):
        trainer.fit(task, datamodule=data)
    assert trainer.global_step < 10
    with pytest.raises(OverLocalizationWarning, match="kappa = 1"):
        trainer_for(
            tmp_path,
            QKSpectrumMonitor(every_n_steps=1, alert_action="raise", alerts=[LEVEL_KAPPA]),
            max_steps=10,
        ).fit(task, datamodule=data)


def test_without_tensorboard_scalars_still_reach_csv_logger(tmp_path, make_task):
    task, data = make_task()
    logger = CSVLogger(tmp_path, name="csv", version=0)
    trainer_for(tmp_path, QKSpectrumMonitor(every_n_steps=2), logger=logger).fit(
        task, datamodule=data
    )
    header = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    assert "qkmonitor/kappa/layer_00" in header
    assert "qkmonitor/alerts/kappa" not in header  # no alert fired: no counter


def test_every_n_steps_defaults_to_log_every_n_steps_and_counts_optimizer_steps(
    tmp_path, make_task, scalars_of
):
    task, data = make_task()
    monitor = QKSpectrumMonitor()
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=6,
        logger=TensorBoardLogger(tmp_path, "run", 0),
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=3,
        accumulate_grad_batches=2,
        limit_val_batches=0,
    )
    trainer.fit(task, datamodule=data)
    assert monitor.engine.schedule.every_n_steps == 3
    steps = [s for s, _ in scalars_of(tmp_path / "run" / "version_0")["qkmonitor/kappa/layer_00"]]
    assert steps == [0, 3, 6]  # optimizer steps, each once although two batches end on each


def test_resume_keeps_alert_state_and_does_not_repeat_alerts_or_steps(
    tmp_path, make_task, scalars_of
):
    task, data = make_task(lr=0.0)
    make_rank_one(task)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=3)
    first = QKSpectrumMonitor(every_n_steps=1, alerts=[LEVEL_KAPPA])
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=3,
        logger=TensorBoardLogger(tmp_path, "run", 0),
        callbacks=[first, checkpoint],
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        limit_val_batches=0,
    )
    with pytest.warns(OverLocalizationWarning):
        trainer.fit(task, datamodule=data)
    assert first.engine.alerting.tracker.counts["kappa"] == 8

    second = QKSpectrumMonitor(every_n_steps=1, alerts=[LEVEL_KAPPA])
    resumed = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=6,
        logger=TensorBoardLogger(tmp_path, "run", 1),
        callbacks=[second, ModelCheckpoint(dirpath=tmp_path / "ckpt2")],
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        limit_val_batches=0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.fit(task, datamodule=data, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert not [w for w in caught if issubclass(w.category, OverLocalizationWarning)]
    assert second.engine.alerting.tracker.counts["kappa"] == 8  # restored, not refired
    steps = [s for s, _ in scalars_of(tmp_path / "run" / "version_1")["qkmonitor/kappa/layer_00"]]
    assert steps == [4, 5, 6]  # no second probe of step 3, no step 0


def test_on_alert_gets_the_trainer_and_can_lower_the_learning_rate(tmp_path, make_task):
    # what docs/alerts.md suggests wiring up: halve the peak learning rate once per step that
    # alerts.
    # The task's LambdaLR scheduler recomputes lr = base_lr * factor(step) every step, so the base
    # rate is what must change, and the optimizer's current rate with it.
    task, data = make_task(lr=1e-3)
    make_rank_one(task)  # kappa ~ 1 from the start: the level rule fires at step 0 on all 8 heads
    calls: list[tuple[object, str, int]] = []

    def halve_lr(trainer: pl.Trainer, alert) -> None:
        calls.append((trainer, alert.rule.name, alert.step))
        if [step for _, _, step in calls].count(alert.step) > 1:
            return  # once per step, however many heads fired
        for config in trainer.lr_scheduler_configs:
            config.scheduler.base_lrs = [lr / 2 for lr in config.scheduler.base_lrs]
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] /= 2

    trainer = trainer_for(
        tmp_path,
        QKSpectrumMonitor(
            every_n_steps=1, alerts=[LEVEL_KAPPA.replace(patience=1)], on_alert=halve_lr
        ),
        max_steps=4,
    )
    with pytest.warns(OverLocalizationWarning):
        trainer.fit(task, datamodule=data)
    assert {id(owner) for owner, _, _ in calls} == {id(trainer)}
    alert_steps = sorted({step for _, _, step in calls})
    assert [name for _, name, _ in calls] == ["kappa"] * len(calls) and len(calls) == 8 * len(
        alert_steps
    )
    # warmup_steps=0 in the tiny task: the rate is the base rate, halved once per alerting step
    expected = 1e-3 / 2 ** len(alert_steps)
    assert trainer.lr_scheduler_configs[0].scheduler.base_lrs == [pytest.approx(expected)] * 2
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(expected)

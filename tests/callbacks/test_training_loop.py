"""The activation monitors inside Lightning's loop: accumulation, validation, resume."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from qkmonitor.callbacks import AttentionEntropyMonitor, EffectiveRankMonitor


class CountingProbes(AttentionEntropyMonitor):
    """Records every forward of a probed layer, and whether validation was running then."""

    def on_fit_start(self, trainer, pl_module):
        super().on_fit_start(trainer, pl_module)
        self.probed_forwards = []
        self.engine.layers[0].module.register_forward_hook(
            lambda m, a, o: self.probed_forwards.append(trainer.validating) if m.probing else None
        )


def test_probes_follow_optimizer_steps_under_accumulation_and_skip_validation(
    tmp_path, make_task, scalars_of
):
    task, data = make_task()
    monitor = CountingProbes(every_n_steps=2)
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=5,
        logger=TensorBoardLogger(tmp_path, "run", 0),
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        accumulate_grad_batches=2,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        num_sanity_val_steps=0,
    )
    trainer.fit(task, datamodule=data)
    steps = [s for s, _ in scalars_of(tmp_path / "run" / "version_0")["qkmonitor/entropy/layer_00"]]
    assert steps == [0, 2, 4]  # optimizer steps, each probed once although two batches make a step
    assert monitor.probed_forwards == [
        False,
        False,
        False,
    ]  # one probed forward each, none in validation


def test_resumed_activation_monitor_continues_without_repeating_steps(
    tmp_path, make_task, scalars_of
):
    task, data = make_task()
    common = dict(
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        log_every_n_steps=1,
    )
    first = EffectiveRankMonitor(every_n_steps=2)
    pl.Trainer(
        max_steps=4,
        logger=TensorBoardLogger(tmp_path, "run", 0),
        **common,
        callbacks=[first, ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)],
    ).fit(task, datamodule=data)
    assert first.latest_step == 2  # batches start at steps 0..3: probes at 0 and 2
    second = EffectiveRankMonitor(every_n_steps=2)
    pl.Trainer(
        max_steps=8,
        logger=TensorBoardLogger(tmp_path, "run", 1),
        **common,
        callbacks=[second, ModelCheckpoint(dirpath=tmp_path / "ckpt2")],
    ).fit(task, datamodule=data, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    steps = [
        s
        for s, _ in scalars_of(tmp_path / "run" / "version_1")["qkmonitor/hidden_collapse/layer_00"]
    ]
    assert steps == [4, 6]  # continues at 4; 2 is not measured again, 8 is never a batch start


@pytest.mark.parametrize("monitor_cls", [AttentionEntropyMonitor, EffectiveRankMonitor])
def test_monitors_leave_no_probe_on_after_training(tmp_path, make_task, monitor_cls):
    task, data = make_task()
    monitor = monitor_cls(every_n_steps=1)
    pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=2,
        logger=False,
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    ).fit(task, datamodule=data)
    assert not any(block.attn.probing for block in task.model.blocks)
    assert not any(block._forward_hooks for block in task.model.blocks)


def test_validation_is_probed_only_when_asked_and_logged_apart(tmp_path, make_task, scalars_of):
    task, data = make_task()
    monitor = AttentionEntropyMonitor(every_n_steps=10, probe_validation=True)
    pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=4,
        logger=TensorBoardLogger(tmp_path, "run", 0),
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
    ).fit(task, datamodule=data)
    scalars = scalars_of(tmp_path / "run" / "version_0")
    # after the updates of steps 1 and 3, written where Lightning writes val_loss: at those steps
    assert [s for s, _ in scalars["qkmonitor/val/entropy/layer_01"]] == [1, 3]
    assert [s for s, _ in scalars["qkmonitor/entropy/layer_01"]] == [0]  # training: every 10 steps
    assert "qkmonitor/val/alerts/entropy_collapse" not in scalars
    assert monitor.latest_validation["entropy"][1].shape == (4,)
    with pytest.raises(ValueError, match="`probe_validation`"):
        AttentionEntropyMonitor(probe_validation="yes")


def test_a_callback_reused_for_a_second_fit_starts_as_a_new_one(tmp_path, make_task):
    """Notebooks and sweeps call ``fit`` again with the same callback: alert state and counts, the
    latest values and the loss history start over, as they would with a new instance."""
    from qkmonitor.alerts import KAPPA_RULE
    from qkmonitor.callbacks import QKSpectrumMonitor

    def always():
        # fires once per head and then stays active (hysteresis): its count is the head count
        return KAPPA_RULE.replace(
            name="any_kappa",
            threshold=0.0,
            margin=0.0,
            growth=None,
            window=None,
            also=(),
            learning_drop=None,
            learning_window=None,
            solved_fraction=None,
        )

    def fit(monitor, version):
        task, data = make_task()
        pl.Trainer(
            default_root_dir=tmp_path,
            max_steps=3,
            logger=TensorBoardLogger(tmp_path, "run", version),
            callbacks=[monitor],
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            limit_val_batches=0,
        ).fit(task, datamodule=data)

    fresh = QKSpectrumMonitor(every_n_steps=2, alerts=[always()])
    fit(fresh, 0)
    reused = QKSpectrumMonitor(every_n_steps=2, alerts=[always()])
    fit(reused, 1)
    with pytest.warns(
        UserWarning
    ):  # each fit warns its alerts again: the first fit's state is gone
        fit(reused, 2)
    heads = 2 * 4
    assert fresh.engine.alerting.tracker.counts["any_kappa"] == heads
    assert (
        reused.engine.alerting.tracker.counts["any_kappa"]
        == fresh.engine.alerting.tracker.counts["any_kappa"]
    )
    assert reused.latest_step == fresh.latest_step == 2
    assert reused.engine.schedule.every_n_steps == 2


def test_two_optimizers_probe_at_the_first_step_at_or_after_each_multiple(
    tmp_path, make_task, scalars_of
):
    """Manual optimization with two optimizers steps each once per batch, so Lightning's
    ``global_step`` advances by 2: ``every_n_steps=5`` probes at 0, 6, 10, 16, 20 (every multiple of
    5 met or passed once), not only at the multiples of 10 that happen to be batch starts."""
    import torch

    from qkmonitor.callbacks import QKSpectrumMonitor

    task, data = make_task()

    class TwoOptimizers(type(task)):
        def __init__(self, config):
            super().__init__(config, lr=3e-3, warmup_steps=0)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            first, second = self.optimizers()
            loss = self._step(batch, "train")
            self.manual_backward(loss)
            first.step()
            second.step()
            first.zero_grad()
            second.zero_grad()
            return loss

        def configure_optimizers(self):
            params = list(self.model.parameters())
            return torch.optim.SGD(params[: len(params) // 2], lr=1e-2), torch.optim.SGD(
                params[len(params) // 2 :], lr=1e-2
            )

    model = TwoOptimizers(task.config)
    monitors = [QKSpectrumMonitor(every_n_steps=5), AttentionEntropyMonitor(every_n_steps=5)]
    pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=22,
        logger=TensorBoardLogger(tmp_path, "run", 0),
        callbacks=monitors,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    ).fit(model, datamodule=data)
    scalars = scalars_of(tmp_path / "run" / "version_0")
    assert [s for s, _ in scalars["qkmonitor/entropy/layer_00"]] == [0, 6, 10, 16, 20]
    assert [s for s, _ in scalars["qkmonitor/kappa/layer_00"]] == [0, 6, 10, 16, 20]

"""The Lightning callbacks skip work in the batches between two probes
(`MonitorEngine.steps_after`) and log exactly what callbacks that never skip log."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from qkmonitor.callbacks import AttentionEntropyMonitor, EffectiveRankMonitor, QKSpectrumMonitor
from qkmonitor.engine import AttentionEntropy, MonitorEngine, QKSpectrum


def never_skip(engine: MonitorEngine, step: int) -> tuple[range, range]:
    return range(step + 1, step + 1), range(step + 1, step + 1)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_lightning_run_logs_the_same_as_one_that_never_skips(
    tmp_path, make_task, scalars_of, monkeypatch, accumulate
):
    """The three monitors at every 25 steps over 80 steps (with the default rules, which read
    the loss): the same values at the same steps, the same losses kept."""

    def fit(name: str) -> list[pl.Callback]:
        pl.seed_everything(0, verbose=False)  # the same weights and batches in both runs
        task, data = make_task()
        monitors = [
            QKSpectrumMonitor(every_n_steps=25),
            AttentionEntropyMonitor(every_n_steps=25),
            EffectiveRankMonitor(every_n_steps=25),
        ]
        pl.Trainer(
            max_steps=80,
            accumulate_grad_batches=accumulate,
            logger=TensorBoardLogger(tmp_path, name, 0),
            callbacks=monitors,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            limit_val_batches=0,
            log_every_n_steps=1,
        ).fit(task, datamodule=data)
        return monitors

    counted = {"open": 0}
    opened = AttentionEntropy.open

    def counting_open(self, step, **kwargs):
        counted["open"] += 1
        return opened(self, step, **kwargs)

    monkeypatch.setattr(AttentionEntropy, "open", counting_open)
    skipping = fit("skipping")
    skipping_opens = counted["open"]
    with monkeypatch.context() as patch:
        patch.setattr(MonitorEngine, "steps_after", never_skip)
        patch.setattr(QKSpectrum, "steps_after", never_skip)
        always = fit("always")
    assert skipping_opens < counted["open"] - skipping_opens  # batches were skipped
    ours, theirs = (
        scalars_of(tmp_path / "skipping" / "version_0"),
        scalars_of(tmp_path / "always" / "version_0"),
    )
    tags = [tag for tag in theirs if tag.startswith("qkmonitor/")]
    assert tags and [tag for tag in ours if tag.startswith("qkmonitor/")] == tags
    for tag in tags:
        assert [s for s, _ in ours[tag]] == [s for s, _ in theirs[tag]], tag
        assert [v for _, v in ours[tag]] == pytest.approx(
            [v for _, v in theirs[tag]], abs=1e-6, nan_ok=True
        )
    assert [s for s, _ in ours["qkmonitor/entropy/layer_00"]] == [0, 25, 50, 75]
    for mine, reference in zip(skipping, always):
        kept, expected = (
            mine.engine.alerting.loss_history(),
            reference.engine.alerting.loss_history(),
        )
        assert [step for step, _ in kept] == [step for step, _ in expected]
        assert [loss for _, loss in kept] == pytest.approx([loss for _, loss in expected])

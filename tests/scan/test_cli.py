"""``qkmonitor scan``: a series of checkpoints written as one TensorBoard run at their steps, with
the live monitor's tags and dashboards, read back by ``qkmonitor report``; Lightning checkpoints of
a bundled model and through ``--model``."""

from __future__ import annotations

import lightning
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.testing import assert_close

import qkmonitor
from qkmonitor.cli import main
from qkmonitor.engine import Monitoring, QKSpectrum
from qkmonitor.output.report import build_report

pytest.importorskip("transformers")


def events(run_dir) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_a_series_of_trainer_checkpoints_lands_at_their_steps(tmp_path, llama_saver, capsys):
    for step, seed in ((10, 1), (2, 0)):
        llama_saver(tmp_path / "out" / f"checkpoint-{step}", seed=seed)
    assert (
        main(["scan", str(tmp_path / "out"), "--log-dir", str(tmp_path / "run"), "--per-head"]) == 0
    )
    printed = capsys.readouterr().out
    assert printed.index("step 2:") < printed.index("step 10:")
    assert "model.layers.1.self_attn" in printed
    acc = events(tmp_path / "run")
    tags = acc.Tags()
    for step in (2, 10):
        expected = qkmonitor.scan(tmp_path / "out" / f"checkpoint-{step}")
        for i, layer in enumerate(expected):
            for metric in ("kappa", "kappa_eig", "eig_mean", "eig_var", "qk_erank"):
                logged = {e.step: e.value for e in acc.Scalars(f"qkmonitor/{metric}/layer_{i:02d}")}
                assert_close(
                    torch.tensor(logged[step]), layer.metrics[metric].mean(), rtol=1e-5, atol=1e-9
                )
            head = acc.Scalars(f"qkmonitor/kappa/layer_{i:02d}_head_07")
            assert [e.step for e in head] == [2, 10]
    assert [e.step for e in acc.Scalars("qkmonitor/kappa/layer_00")] == [2, 10]
    assert not any("update_ratio" in t or "grad_norm" in t for t in tags["scalars"])
    assert "qkmonitor/qk_singular_values/layer_01" in tags["histograms"]
    assert any("kappa" in t for t in tags["images"])  # the layer x head heatmap
    assert acc.summary_metadata  # the custom-scalars layout and hparams are plugin data


def test_paths_without_steps_are_written_at_their_positions(tmp_path, llama_saver):
    llama_saver(tmp_path / "base", seed=0)
    llama_saver(tmp_path / "tuned", seed=1)
    paths = [str(tmp_path / "base"), str(tmp_path / "tuned")]
    assert main(["scan", *paths, "--log-dir", str(tmp_path / "run")]) == 0
    assert [e.step for e in events(tmp_path / "run").Scalars("qkmonitor/kappa/layer_00")] == [0, 1]


def test_report_compares_a_base_model_scan_and_its_fine_tune(tmp_path, llama_saver, capsys):
    llama_saver(tmp_path / "base", seed=0)
    llama_saver(tmp_path / "tuned", seed=1)
    for name in ("base", "tuned"):
        assert (
            main(["scan", str(tmp_path / name), "--log-dir", str(tmp_path / "scans" / name)]) == 0
        )
    report = build_report([tmp_path / "scans" / "base", tmp_path / "scans" / "tuned"], plots=False)
    text = report.text
    assert "comparing 2 runs" in text and "scans/base" in text and "scans/tuned" in text
    assert "kappa" in text


def bundled_checkpoint(path, step: int = 7):
    """A Lightning checkpoint of a bundled task, as ``Trainer.save_checkpoint`` lays it out."""
    from qkmonitor.models import TransformerConfig
    from qkmonitor.models.tasks import CausalLMTask

    torch.manual_seed(0)
    task = CausalLMTask(TransformerConfig(vocab_size=16, d_model=32, n_heads=4, n_kv_heads=2))
    torch.save(
        {
            "state_dict": task.state_dict(),
            "global_step": step,
            "epoch": 0,
            "pytorch-lightning_version": lightning.__version__,
            "hyper_parameters": dict(task.hparams),
        },
        path,
    )
    return task


@pytest.mark.parametrize("model", [None, "qkmonitor.models.tasks:CausalLMTask"])
def test_a_lightning_checkpoint_is_written_at_its_global_step(tmp_path, model):
    task = bundled_checkpoint(tmp_path / "last.ckpt")
    spectrum = QKSpectrum(every_n_steps=1)
    monitoring = Monitoring(task.model, [spectrum])
    monitoring.observe_weights(0)
    monitoring.close()
    args = ["scan", str(tmp_path / "last.ckpt"), "--log-dir", str(tmp_path / "run")]
    assert main(args + (["--model", model] if model else [])) == 0
    scanned = qkmonitor.scan(tmp_path / "last.ckpt", model=model)
    for layer, kappa in zip(scanned, spectrum.latest["kappa"], strict=True):
        assert_close(layer.metrics["kappa"], kappa, rtol=1e-6, atol=1e-8)
    assert [e.step for e in events(tmp_path / "run").Scalars("qkmonitor/kappa/layer_01")] == [7]


#: a user's LightningModule in a module of the folder the command runs in
USER_MODULE = """
import lightning.pytorch as pl
from torch import nn


class Mixer(pl.LightningModule):
    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
"""


def test_model_is_imported_from_the_current_folder_without_pythonpath(tmp_path):
    """Issue 59, item 9: ``--model mine:Mixer`` with ``mine.py`` in the folder the command runs in
    (the console script, no ``PYTHONPATH``) imports it, as ``python -m`` would."""
    from .test_bad_input import scan_in

    (tmp_path / "mine.py").write_text(USER_MODULE)
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    torch.save(
        {
            "state_dict": {f"attn.{k}": v for k, v in attention.state_dict().items()},
            "global_step": 5,
            "pytorch-lightning_version": lightning.__version__,
            "hyper_parameters": {"width": 16, "heads": 2},
        },
        tmp_path / "mixer.ckpt",
    )
    done = scan_in(tmp_path, "mixer.ckpt", "--log-dir", "run", "--model", "mine:Mixer")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 5: mixer.ckpt (1 attention layers)" in done.stdout, done.stdout
    assert [e.step for e in events(tmp_path / "run").Scalars("qkmonitor/kappa/layer_00")] == [5]

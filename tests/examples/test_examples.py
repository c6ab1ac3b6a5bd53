"""Every script in examples/ runs, on CPU, and shows what it claims."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
#: What Lightning prints that the examples turn down (``qkmonitor.cli.quiet_lightning``, as
#: ``qkmonitor train`` does): the device report, its tips, a pytree deprecation, why fit stopped.
LIGHTNING_CHATTER = ("GPU available", "TPU available", "Tip:", "LeafSpec", "`Trainer.fit` stopped")


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_has_a_test():
    tested = {
        "own_encoder",
        "hf_llama",
        "rank_collapse",
        "entropy_vs_length",
        "bundled_tasks",
        "plain_pytorch_loop",
    }
    assert {p.stem for p in EXAMPLES.glob("*.py")} <= tested


@pytest.mark.slow
def test_rank_collapse_example_collapses_only_without_skips(tmp_path):
    results = load("rank_collapse").main(["--depth", "6", "--log-dir", str(tmp_path)])
    (no_skip, fired_no_skip), (skip, fired_skip) = results["no_skip"], results["skip"]
    assert no_skip[-1] < 1e-3 and fired_no_skip > 0
    assert min(skip) > 0.5 and fired_skip == 0


@pytest.mark.slow
def test_entropy_vs_length_example_log_n_keeps_entropy_from_growing_like_log_n():
    results = load("entropy_vs_length").main(["--lengths", "64", "256", "1024"])
    standard, log_n = results["standard"], results["log_n"]
    assert standard[0][1] == pytest.approx(
        log_n[0][1]
    )  # same weights: equal up to the training length
    assert standard[-1][1] > standard[0][1]  # a fixed temperature flattens with n
    assert log_n[-1][2] < standard[-1][2]  # log-n scaling keeps attention sharper at long range


@pytest.mark.slow
def test_bundled_tasks_example_runs_every_task_with_the_monitors(tmp_path, capsys):
    codes = load("bundled_tasks").main(["--steps", "10", "--log-dir", str(tmp_path)])
    assert codes == {task: 0 for task in ("recall", "copy", "reverse", "charlm", "modular", "grid")}
    out = capsys.readouterr().out
    assert out.count("qkmonitor summary after step 10 (") == 6
    assert out.count("kappa, qk_erank: the weights after step 10\n") == 6
    assert out.count("the last probed batch, at step 0\n") == 6
    assert out.count("columns: a layer's mean over its heads") == 1  # the legend, once
    assert {p.name for p in tmp_path.iterdir()} == set(codes)


def run_example(name: str, *args: str, cwd) -> subprocess.CompletedProcess:
    """``python examples/{name}.py ARGS`` in a fresh interpreter, as a user runs it."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def chatter(result: subprocess.CompletedProcess) -> list[str]:
    return [c for c in LIGHTNING_CHATTER if c in result.stdout or c in result.stderr]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "args", "shown"),
    [
        ("own_encoder", ["--steps", "20"], "layers: encoder.layers.0.self_attn (torch.nn.Multi"),
        ("rank_collapse", ["--depth", "4"], "rank-collapse warnings: 0"),
    ],
)
def test_lightning_examples_print_no_lightning_chatter(tmp_path, name, args, shown):
    result = run_example(name, *args, "--log-dir", str(tmp_path), cwd=tmp_path)
    assert chatter(result) == []
    assert "DeprecationWarning" not in result.stderr  # an example uses what is current
    assert shown in result.stdout
    assert list(tmp_path.glob("**/events.out.tfevents.*"))  # and it logged
    # it ends with the commands that show its run, each naming a folder it wrote
    tensorboard, report = result.stdout.strip().splitlines()[-2:]
    assert tensorboard == f"tensorboard --logdir {tmp_path}"
    assert report.startswith("qkmonitor report ")
    for run in report.split()[2:]:
        assert list(Path(run).glob("events.out.tfevents.*")), run


@pytest.mark.slow
def test_hf_llama_default_run_is_quiet_fires_no_alert_and_learns(tmp_path):
    pytest.importorskip("transformers")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = run_example("hf_llama", "--log-dir", str(tmp_path), cwd=tmp_path)
    assert chatter(result) == []
    assert "DeprecationWarning" not in result.stderr  # an example uses what is current
    assert "[qkmonitor:" not in result.stderr  # healthy defaults, no alert (the docstring says why)
    assert "(transformers.LlamaAttention)" in result.stdout  # the layers it found
    (run,) = (tmp_path / "hf_llama").iterdir()
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    losses = [e.value for e in acc.Scalars("train_loss")]  # what `qkmonitor report` plots
    for layer in (0, 1):  # every monitor measured both layers
        assert acc.Scalars(f"qkmonitor/kappa/layer_{layer:02d}")
        assert all(
            math.isfinite(e.value) for e in acc.Scalars(f"qkmonitor/entropy_norm/layer_{layer:02d}")
        )
    final = float(re.search(r"train_loss \(last batch\): ([\d.]+)", result.stdout)[1])
    assert final == pytest.approx(losses[-1], abs=5e-4)
    # it learns: below where it was, and below a uniform guess among the 24 values recalled
    assert final < losses[0] and final < math.log(24)


def test_plain_pytorch_loop_prints_the_loss_it_logs(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = run_example(
        "plain_pytorch_loop", "--steps", "60", "--log-dir", str(tmp_path), cwd=tmp_path
    )
    printed = [
        (int(step), float(loss))
        for step, loss in re.findall(r"^step +(\d+)  loss ([\d.]+)$", result.stdout, re.MULTILINE)
    ]
    acc = EventAccumulator(str(tmp_path / "plain_pytorch_loop"), size_guidance={"scalars": 0})
    acc.Reload()
    logged = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert [step for step, _ in printed] == [0, 25, 50, 59]
    previous = -1
    for step, loss in printed:  # each line: the mean since the line before
        window = [logged[s] for s in range(previous + 1, step + 1)]
        assert loss == pytest.approx(sum(window) / len(window), abs=5e-5), step
        previous = step
    assert printed[-1][1] < 0.8 * printed[0][1]  # it learns


def run_tags(run_dir) -> dict[str, object]:
    """What a run shows in TensorBoard: qkmonitor's scalar, image and histogram tags, the layout,
    the hparams keys, and every scalar's series."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(
        str(run_dir), size_guidance={"scalars": 0, "images": 0, "histograms": 0, "tensors": 0}
    )
    acc.Reload()
    tags = acc.Tags()
    own = lambda names: sorted(t for t in names if t.startswith("qkmonitor/"))
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    return {
        "scalars": own(tags["scalars"]),
        "images": own(tags["images"]),
        "histograms": own(tags["histograms"]),
        "layout": acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0],
        "thresholds": sorted(k for k in hparams if k.startswith("qkmonitor/")),
        "series": {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in own(tags["scalars"])},
    }


def test_plain_pytorch_loop_logs_the_same_tags_and_dashboards_as_the_lightning_callbacks(tmp_path):
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.tensorboard import SummaryWriter

    from qkmonitor.callbacks import AttentionEntropyMonitor, EffectiveRankMonitor, QKSpectrumMonitor

    example = load("plain_pytorch_loop")
    steps, every = 6, 2

    model, tokens, targets = example.build()
    writer = SummaryWriter(str(tmp_path / "plain"))
    example.train(model, tokens, targets, steps, writer, every_n_steps=every)
    writer.close()

    class Task(pl.LightningModule):  # the same model, data, order and optimizer under Lightning
        def __init__(self):
            super().__init__()
            self.model, _, _ = example.build()

        def training_step(self, batch, batch_idx):
            logits = self.model(batch[0])
            return nn.functional.cross_entropy(
                logits.flatten(0, 1), batch[1].flatten(), ignore_index=-100
            )

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

        def train_dataloader(self):
            return DataLoader(TensorDataset(tokens, targets), batch_size=64)

    callbacks = [
        QKSpectrumMonitor(every_n_steps=every),
        AttentionEntropyMonitor(every_n_steps=every),
        EffectiveRankMonitor(every_n_steps=every, max_probe_tokens=32),
    ]
    pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=steps,
        callbacks=callbacks,
        enable_progress_bar=False,
        logger=TensorBoardLogger(tmp_path, "lightning", 0),
        enable_model_summary=False,
        enable_checkpointing=False,
    ).fit(Task())

    plain, lightning = run_tags(tmp_path / "plain"), run_tags(tmp_path / "lightning" / "version_0")
    for key in ("scalars", "images", "histograms", "layout", "thresholds"):
        assert plain[key] == lightning[key], key
    assert len(plain["scalars"]) > 50 and plain["images"] and plain["histograms"]
    # the same numbers at the steps both read the same weights and batches (0, 2, 4; the
    # Lightning spectrum also reads the final weights at step 6)
    for tag, series in plain["series"].items():
        other = dict(lightning["series"][tag])
        for step, value in series:
            assert other[step] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), (tag, step)

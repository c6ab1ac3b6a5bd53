"""`qkmonitor train --task X`: every task runs end to end and prints its summary (not learning)."""

from __future__ import annotations

import math
import re

import pytest

from qkmonitor.cli import main
from qkmonitor.cli.summary import summary_columns
from qkmonitor.models.tasks.registry import TASKS

# The attention layers the summary must list, per task: every self- and cross-attention.
LAYERS = {
    "recall": ["model.blocks.0.attn", "model.blocks.1.attn"],
    "modular": ["model.blocks.0.attn"],
    "copy": ["model.encoder.0.attn", "model.decoder.0.attn", "model.decoder.0.cross_attn"],
    "reverse": ["model.encoder.0.attn", "model.decoder.0.attn", "model.decoder.0.cross_attn"],
    "grid": ["model.blocks.0.attn"],
    "charlm": ["model.blocks.0.attn"],
}
# The line before the bar: words of the task, and the kind of model.
WORDS = {
    "recall": ("associative recall (6 key-value pairs", "decoder"),
    "modular": ("addition mod 23", "decoder"),
    "copy": ("copying strings of up to 10", "encoder-decoder"),
    "reverse": ("reversing strings of up to 10", "encoder-decoder"),
    "grid": ("8x8 grid", "vision encoder"),
    "charlm": ("Python's own source (20,000 characters)", "decoder"),
}
METRICS = {
    "recall": ["val_acc", "val_loss"],
    "modular": ["val_acc", "val_loss"],
    "copy": ["val_acc", "val_loss", "val_seq_acc"],
    "reverse": ["val_acc", "val_loss", "val_seq_acc"],
    "grid": ["val_acc", "val_loss"],
    "charlm": ["val_acc", "val_bpc", "val_loss"],
}


@pytest.mark.parametrize("task", list(LAYERS))
def test_every_task_trains_end_to_end_and_prints_the_summary(task, tmp_path, capsys):
    argv = [
        "train",
        "--task",
        task,
        "--steps",
        "4",
        "--every-n-steps",
        "2",
        "--layers",
        "1",
        "--chars",
        "20000",
        "--log-dir",
        str(tmp_path / "runs"),
        "--no-progress-bar",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    what, model = WORDS[task]
    assert out.startswith("qkmonitor train: ") and what in out.splitlines()[0]
    assert out.splitlines()[1].startswith(f"  model: {model}, 1 layer")
    assert f"4 steps on cpu, the monitors probing every 2; logs: {tmp_path / 'runs' / task}" in out
    assert "qkmonitor summary after step 4 (" in out
    assert "\n  kappa, qk_erank: the weights after step 4\n" in out
    assert "hidden_collapse, attn_erank: the last probed batch, at step 2\n" in out
    for i, name in enumerate(LAYERS[task] if task != "recall" else LAYERS[task][:1]):
        columns = len(summary_columns())  # derived from the metric catalogue
        row = re.search(
            rf"^\s+{i}\s+{re.escape(name)}((\s+[-0-9.e+]+){{{columns}}})$", out, re.MULTILINE
        )
        assert row, name
        assert all(math.isfinite(float(v)) for v in row.group(1).split()), name
    final = re.search(r"^final validation: (.*)$", out, re.MULTILINE).group(1)
    assert re.findall(r"(\w+) [0-9.]+", final) == METRICS[task]
    assert (tmp_path / "runs" / task / "version_0").is_dir()


def test_tasks_are_the_documented_ones_with_recall_the_default():
    assert set(TASKS) == set(LAYERS) and next(iter(TASKS)) == "recall"
    assert all(set(t.defaults) == set(TASKS["recall"].defaults) for t in TASKS.values())

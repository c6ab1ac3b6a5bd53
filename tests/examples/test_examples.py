"""Every script in examples/ runs, on CPU, and shows what it claims."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_has_a_test():
    tested = {"own_encoder", "hf_llama", "rank_collapse", "entropy_vs_length", "bundled_tasks"}
    assert {p.stem for p in EXAMPLES.glob("*.py")} <= tested


@pytest.mark.slow
def test_own_encoder_example_logs_every_monitor(tmp_path):
    metrics = load("own_encoder").main(["--steps", "40", "--log-dir", str(tmp_path)])
    assert "train_acc" in metrics
    assert list((tmp_path / "own_encoder").glob("version_0/events.out.tfevents.*"))


@pytest.mark.slow
def test_hf_llama_example_monitors_the_transformers_model(tmp_path):
    pytest.importorskip("transformers")
    latest = load("hf_llama").main(["--steps", "20", "--log-dir", str(tmp_path)])
    assert len(latest["kappa"]) == 2 and all(math.isfinite(v.mean()) for v in latest["entropy_norm"])


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
    assert standard[0][1] == pytest.approx(log_n[0][1])  # same weights: equal up to the training length
    assert standard[-1][1] > standard[0][1]  # a fixed temperature flattens with n
    assert log_n[-1][2] < standard[-1][2]  # log-n scaling keeps attention sharper at long range


@pytest.mark.slow
def test_bundled_tasks_example_runs_every_task_with_the_monitors(tmp_path, capsys):
    codes = load("bundled_tasks").main(["--steps", "10", "--log-dir", str(tmp_path)])
    assert codes == {task: 0 for task in ("recall", "copy", "reverse", "charlm", "modular", "grid")}
    out = capsys.readouterr().out
    assert out.count("qkmonitor summary (spectrum at step 10, entropy at step 0") == 6
    assert {p.name for p in tmp_path.iterdir()} == set(codes)

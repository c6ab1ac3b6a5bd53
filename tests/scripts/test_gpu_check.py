"""``scripts/gpu_check.sh`` without a GPU: its dry run, and the report table from known numbers.

The GPU run itself needs CUDA (it is what the script is for); here the CPU-side logic is checked:
argument handling of both benchmarks (``--dry-run``), collection of the gpu tests, and the one
markdown table the script ends with.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEADER = "| measurement | setting | baseline | ours | ours / baseline |"


def load_report_module():
    spec = importlib.util.spec_from_file_location("gpu_report", ROOT / "scripts" / "gpu_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_report_rows_from_known_measurements():
    report = load_report_module()
    attention = [{"n": 1024, "d": 64, "causal": True, "batch": 16, "heads": 32, "pass": "fwd",
                  "flops": 3e12, "t_flash": 0.01, "t_triton": 0.02, "t_stats": 0.03,
                  "mem_flash": None, "mem_stats": None}]  # fmt: skip
    rows = report.attention_rows(attention)
    # 3e12 FLOP in 10, 20, 30 ms: 300, 150, 100 TFLOP/s
    assert rows[0][2:] == ["SDPA flash 300.0", "150.0", "0.50"]
    assert rows[1][2:] == ["SDPA flash 300.0", "100.0", "0.33"]
    overhead = {"model": "gpt2-small", "precision": "bf16-mixed",
                "steps_per_s": {"no monitor": 20.0, "every 50": 19.0,
                                "every step": 5.0}}  # fmt: skip
    rows = report.overhead_rows(overhead)
    assert [row[3:] for row in rows] == [["19.0", "0.95"], ["5.0", "0.25"]]
    assert report.markdown(rows).splitlines()[0] == HEADER


@pytest.mark.slow
def test_dry_run_prints_one_table(tmp_path):
    env = {**os.environ, "GPU_CHECK_OUT": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = run.stdout.rstrip().splitlines()
    table = [line for line in lines if line.startswith("|")]
    assert table[0] == HEADER and lines[-len(table) :] == table  # one table, at the end
    rows = [row.split(" | ") for row in table[2:]]
    assert rows[0][3] == "passed"  # the gpu tests were collected
    lengths, head_dims, passes, variants = 5, 2, 2, 2
    attention = [row for row in rows if row[0].startswith("| attention")]
    assert len(attention) == lengths * head_dims * passes * variants
    assert (
        len([row for row in rows if row[0] == "| training steps/s"]) == 3
    )  # three monitored configurations
    assert all(row[3] == "n/a" for row in rows[1:])  # a dry run measures nothing
    assert (tmp_path / "attention.json").is_file() and (tmp_path / "overhead.json").is_file()

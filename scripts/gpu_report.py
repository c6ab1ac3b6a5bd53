"""The one markdown table that ``scripts/gpu_check.sh`` ends with, from the benchmarks' JSON.

Rows: the GPU tests' outcome; Triton attention (without and with statistics) against SDPA's
flash backend, TFLOP/s, forward and forward+backward, per (N, D, causal); training steps per
second of the GPT-2-small-sized model with the monitors against none. Columns: what was
measured, its setting, the baseline, ours, and ours / baseline (for throughput, ≥ 1 means ours is
faster; for steps per second, 1 − ratio is the monitors' overhead). A missing or NaN measurement
(a stage that failed, timed out or ran as ``--dry-run``) reads "n/a".

Usage::

    python scripts/gpu_report.py --tests-rc 0 --attention attention.json --overhead overhead.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

HEADER = ["measurement", "setting", "baseline", "ours", "ours / baseline"]


def _number(x: float | None, digits: int = 1) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:,.{digits}f}"


def _ratio(ours: float | None, base: float | None) -> str:
    if (
        ours is None
        or base is None
        or not (math.isfinite(ours) and math.isfinite(base))
        or not base
    ):
        return "n/a"
    return f"{ours / base:.2f}"


def attention_rows(results: list[dict]) -> list[list[str]]:
    """Two rows per (N, D, causal, pass): Triton and Triton with statistics, against SDPA-flash."""
    rows = []
    for r in results:

        def tflops(seconds, r=r):
            return None if seconds is None or not seconds > 0 else r["flops"] / seconds / 1e12

        flash = tflops(r["t_flash"])
        mask = "causal" if r["causal"] else "full"
        setting = f"N={r['n']} D={r['d']} {mask}, B={r['batch']} H={r['heads']}, bf16"
        for name, seconds in (("Triton", r["t_triton"]), ("Triton + stats", r["t_stats"])):
            ours = tflops(seconds)
            rows.append([
                f"attention {r['pass']} TFLOP/s, {name}", setting,
                f"SDPA flash {_number(flash)}", _number(ours), _ratio(ours, flash),
            ])  # fmt: skip
    return rows


def overhead_rows(result: dict) -> list[list[str]]:
    rates = result["steps_per_s"]
    base = rates.get("no monitor")
    model = {"gpt2-small": "GPT-2 small (12×768, 12 heads), N=1024, B=8"}.get(
        result["model"], result["model"]
    )
    rows = []
    for name, rate in rates.items():
        if name == "no monitor":
            continue
        rows.append([
            "training steps/s", f"{model}, {result['precision']}, {name}",
            f"no monitor {_number(base)}", _number(rate), _ratio(rate, base),
        ])  # fmt: skip
    return rows


def markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _load(path: Path | None):
    if path is None or not path.is_file():
        return None
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests-rc", type=int, help="exit status of pytest -m gpu")
    parser.add_argument("--tests-label", default="pytest -m gpu")
    parser.add_argument("--attention", type=Path, help="benchmarks/attention.py --json output")
    parser.add_argument("--overhead", type=Path, help="benchmarks/overhead.py --json output")
    args = parser.parse_args(argv)
    outcome = {None: "not run", 0: "passed", 5: "no tests collected"}.get(
        args.tests_rc, f"FAILED (exit {args.tests_rc})"
    )
    rows = [[args.tests_label, "tests/ marked gpu", "—", outcome, "—"]]
    attention = _load(args.attention)
    rows += attention_rows(attention) if attention else [["attention", "—", "—", "n/a", "n/a"]]
    overhead = _load(args.overhead)
    rows += overhead_rows(overhead) if overhead else [["training steps/s", "—", "—", "n/a", "n/a"]]
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

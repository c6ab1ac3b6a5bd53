"""docs/alerts.md's summary of the alert figures (the block the README held before it linked
there) is the one ``benchmarks/instability.py`` wrote to ``docs/instability.json``, and its
figures of round 2's rerun on another CPU are ``docs/instability_rerun.json``'s, not numbers
pasted from an earlier run."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def block() -> str:
    text = (ROOT / "docs" / "alerts.md").read_text()
    start, end = "<!-- alert-figures:start -->", "<!-- alert-figures:end -->"
    return " ".join(text[text.index(start) + len(start) : text.index(end)].split())


def test_the_alert_figures_summary_is_the_sweeps():
    summary = json.loads((ROOT / "docs" / "instability.json").read_text())["summary"]
    val, cal = summary["validation"], summary["calibration"]
    text = block()
    assert f"validation, {val['runs']} runs" in text
    assert f"**{val['healthy_alerted']} of {val['healthy']} healthy runs alerted**" in text
    assert f"**{val['early_in_time']} of {val['early_separating']}** failures" in text
    late = val["late_in_time"] / val["late_separating"]
    assert f"**{val['late_in_time']} of {val['late_separating']}** later failures" in text
    assert f"{round(100 * late)} %" in text
    assert f"On the {cal['runs']} calibration runs: {cal['healthy_alerted']} healthy run" in text
    seeds = [summary[f"validation, seed {seed}"] for seed in (5, 6)]
    assert (
        f"(seed 5: {seeds[0]['healthy_alerted']} of {seeds[0]['healthy']}, seed 6: "
        f"{seeds[1]['healthy_alerted']} of {seeds[1]['healthy']})"
    ) in text
    assert (
        f"({seeds[0]['early_in_time']} of {seeds[0]['early_separating']}, "
        f"{seeds[1]['early_in_time']} of {seeds[1]['early_separating']})"
    ) in text
    assert (
        f"({seeds[0]['late_in_time']} of {seeds[0]['late_separating']}, "
        f"{seeds[1]['late_in_time']} of {seeds[1]['late_separating']})"
    ) in text
    assert f"{round(100 * (0.8 - late))} points short of the 80 % target" in text
    assert re.search(
        rf"{cal['early_in_time']} of {cal['early_separating']} and "
        rf"{cal['late_in_time']} of {cal['late_separating']}\.",
        text,
    )


def test_the_rerun_figures_in_the_alert_docs_are_the_reruns():
    val = json.loads((ROOT / "docs" / "instability_rerun.json").read_text())["summary"][
        "validation"
    ]
    text = " ".join((ROOT / "docs" / "alerts.md").read_text().split())
    expected = (
        f"out {val['late_in_time']} of {val['late_separating']}, {val['early_in_time']} of "
        f"{val['early_separating']} and {val['healthy_alerted']} of {val['healthy']} healthy runs "
        "alerted"
    )
    assert expected in text

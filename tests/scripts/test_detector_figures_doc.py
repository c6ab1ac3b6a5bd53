"""docs/alerts.md's "Figures a user can read as a detector" and "Margins" (issue 61, items 3 and 4)
give what the JSON files hold: the detector tables rendered from ``docs/instability.json`` and
``docs/instability_faults.json``, and the margins table from ``docs/alert_margins.json``, row for
row; and the JSON's intervals are the Wilson intervals of its own counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def modules(benchmark_module):
    return benchmark_module("instability"), benchmark_module("margins")


def section(title: str) -> str:
    text = (ROOT / "docs" / "alerts.md").read_text()
    start = text.index(title)
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_the_detector_tables_are_the_jsons(modules):
    instability, _ = modules
    docs = section("## Figures a user can read as a detector")
    sweep = json.loads((ROOT / "docs" / "instability.json").read_text())["summary"]
    faults = json.loads((ROOT / "docs" / "instability_faults.json").read_text())["summary"]
    rows = instability.figures_table(sweep).splitlines()
    rows += instability.fault_figures_table(faults).splitlines()
    assert len(rows) > 10
    for row in rows:
        assert row in docs, row


def test_the_intervals_are_wilsons_of_the_counts(benchmark_module):
    intervals = benchmark_module("intervals")
    sweep = json.loads((ROOT / "docs" / "instability.json").read_text())["summary"]
    faults = json.loads((ROOT / "docs" / "instability_faults.json").read_text())["summary"]
    blocks = [sweep["validation"]["intervals"], sweep["calibration"]["intervals"]]
    blocks += [g for f in faults["families"].values() for g in f["faults"].values()]
    shares = [v for b in blocks for v in b.values() if isinstance(v, dict) and "wilson95" in v]
    assert len(shares) > 20
    for s in shares:
        if s["n"]:
            expected = [round(x, 4) for x in intervals.wilson(s["k"], s["n"])]
            assert s["wilson95"] == expected, s
    v = sweep["validation"]["intervals"]
    assert (v["late_in_time"]["k"], v["late_in_time"]["n"]) == (
        sweep["validation"]["late_in_time"],
        sweep["validation"]["late_separating"],
    )


def test_the_margins_table_is_the_jsons(modules):
    _, margins = modules
    docs = section("## Margins between the rules and healthy runs")
    stats = json.loads((ROOT / "docs" / "alert_margins.json").read_text())
    rows = margins.margin_table(stats).splitlines()
    assert len(rows) > 10
    for row in rows:
        assert row in docs, row
    for group in stats["groups"].values():
        assert set(group["rules"]) == {r.name for r in margins.DEFAULT_RULES}

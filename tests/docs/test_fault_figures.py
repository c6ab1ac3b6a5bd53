"""docs/alerts.md's "Faults the rules never saw" gives the figures ``benchmarks/instability.py
--families numfault lrjump`` wrote to ``docs/instability_faults.json``, not numbers pasted from
another run: its table of the fault families' arms, row for row, and the twins' count."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cell(value) -> str:
    return "—" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


def test_the_fault_families_table_is_the_sweeps():
    summary = json.loads((ROOT / "docs" / "instability_faults.json").read_text())["summary"]
    text = (ROOT / "docs" / "alerts.md").read_text()
    section = text[text.index("## Faults the rules never saw") :]
    for family, stats in summary["families"].items():
        assert stats["arms"], family
        for arm, a in stats["arms"].items():
            row = [family, arm, a["runs"], a["failed"], a["failed_flagged"], a["in_time"]]
            row += [a["by_next_probe"], a["halfway"], a["median_lead"], a["alerted"]]
            assert "| " + " | ".join(cell(v) for v in row) + " |" in section, (family, arm)
    twins = [r for r in summary["runs"] if r["fault"] is None]
    alerted = sum(r["first_alert"] is not None for r in twins)
    assert f"**Healthy twins: {alerted} of {len(twins)} alerted.**" in section

"""Every default rule's ``evidence`` quotes figures that docs/ holds (issue 62, item 5): the failed
runs it flagged in time alone, the healthy runs it fired on (round 4's calibration set,
``docs/instability.json``) and its margin over healthy runs at safe settings
(``docs/alert_margins.json``, the groups held to the 20 % margin)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from qkmonitor.alerts import DEFAULT_RULES

ROOT = Path(__file__).resolve().parents[2]
FIGURES = re.compile(
    r"alone it flagged (\d+) of (\d+) failed runs in time and fired on (\d+) of (\d+) healthy "
    r"runs.*?; healthy runs at safe settings stayed (\d+) % or more short of firing it"
)
#: groups of docs/alert_margins.json not held to the margin: healthy seeds beside failed ones
BESIDE = "healthy beside failures"


@pytest.fixture(scope="module")
def calibration():
    return json.loads((ROOT / "docs" / "instability.json").read_text())["summary"]["calibration"]


@pytest.fixture(scope="module")
def margins():
    return json.loads((ROOT / "docs" / "alert_margins.json").read_text())["groups"]


@pytest.mark.parametrize("rule", DEFAULT_RULES, ids=lambda r: r.name)
def test_the_evidence_quotes_the_calibration_set(rule, calibration):
    found = FIGURES.search(rule.evidence)
    assert found, f"{rule.name}: its evidence does not open with the calibration figures"
    in_time, failed, healthy_fired, healthy = map(int, found.groups()[:4])
    stats = calibration["per_rule"][rule.name]
    assert (in_time, failed) == (stats["failed_in_time"], calibration["failed"]), rule.name
    assert (healthy_fired, healthy) == (stats["healthy_fired"], calibration["healthy"]), rule.name


@pytest.mark.parametrize("rule", DEFAULT_RULES, ids=lambda r: r.name)
def test_the_evidence_quotes_the_margin_and_it_holds(rule, margins):
    quoted = int(FIGURES.search(rule.evidence).group(5))
    held = [
        group["rules"][rule.name]["closest"]["margin"]
        for name, group in margins.items()
        if BESIDE not in name
    ]
    assert quoted == math.floor(100 * min(held)), rule.name
    assert quoted >= 20, f"{rule.name}: a healthy run at a safe setting within 20 % of firing it"

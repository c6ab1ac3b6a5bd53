"""The metric catalogue is the one list of metrics: everything else derives from it."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from qkmonitor.engine import AttentionEntropy, EffectiveRank, QKSpectrum
from qkmonitor.measures.catalogue import (
    CATALOGUE,
    FAMILIES,
    MONITORS,
    markdown_table,
    metric,
    metrics_of,
    names_of,
)
from qkmonitor.output.runs import KNOWN_METRICS

METRICS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def test_the_docs_metric_table_is_the_catalogue():
    text = METRICS_PAGE.read_text()
    block = re.search(r"<!-- catalogue:start -->\n(.*?)\n<!-- catalogue:end -->", text, re.DOTALL)
    assert block, "docs/metrics.md lost its catalogue markers"
    assert block.group(1) == markdown_table()


def test_every_row_of_the_table_has_its_eight_cells():
    """A ``|`` in a meaning (``|lambda|``, ``||X||_F``) is escaped, so it does not split its
    cell."""
    for line in markdown_table().splitlines():
        cells = re.split(r"(?<!\\)\|", line)[1:-1]
        assert len(cells) == 8, line


def test_every_entry_is_complete_and_names_are_unique():
    assert len({spec.name for spec in CATALOGUE}) == len(CATALOGUE)
    for spec in CATALOGUE:
        assert spec.monitor in MONITORS and spec.unit and spec.meaning and spec.family in FAMILIES
        lo, hi = spec.range
        assert lo < hi and not math.isnan(lo) and not math.isnan(hi)
        assert spec.worse in ("high", "low", "")
        assert spec.heatmap is None or spec.heatmap[0] < spec.heatmap[1]


def test_engines_report_and_families_derive_from_it():
    assert QKSpectrum().metric_names == names_of("QKSpectrumMonitor")
    assert EffectiveRank().metric_names == names_of("EffectiveRankMonitor")
    assert AttentionEntropy().metric_names == names_of("AttentionEntropyMonitor")
    assert AttentionEntropy(sink_tokens=2).metric_names == (
        *names_of("AttentionEntropyMonitor"),
        "sink_mass",
    )
    assert KNOWN_METRICS == tuple(spec.name for spec in CATALOGUE)
    assert [m for names in FAMILIES.values() for m in names] == list(KNOWN_METRICS)
    assert {s.name for s in metrics_of("EffectiveRankMonitor") if not s.per_head} == {
        "hidden_erank",
        "hidden_collapse",
    }


def test_undefined_by_definition_is_documented_where_it_happens():
    assert "not square" in metric("kappa_eig").undefined and "0/0" in metric("kappa").undefined
    # sigma_1 of a zero matrix is 0, not NaN: only a scale the forward does not tell is undefined
    assert "0/0" not in metric("qk_spectral_norm").undefined
    assert "logit scale" in metric("qk_spectral_norm").undefined
    with pytest.raises(KeyError, match="Unknown metric 'kapa'; the catalogue has kappa"):
        metric("kapa")

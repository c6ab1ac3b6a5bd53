"""The tracker steps only the cells a probe can change (``AlertTracker._cells_to_step``: those past
every level of a rule, and those holding a streak or an active alert). Checked against a tracker
that steps every cell, as the tracker did before: the same alerts, counts and state at every
probe, on values that cross, recover and are NaN, on layers of different head counts, with
QK-norm layers and with probes where the loss says the run is learning."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from qkmonitor.alerts import DEFAULT_RULES, ENTROPY_COLLAPSE_RULE, AlertTracker


class EveryCell(AlertTracker):
    """The reference: every (layer, head) cell of every rule stepped at every probe."""

    def _cells_to_step(self, rule, grids, learning, qk_norm_layers):
        columns = [grids[m].rows for m in rule.metrics]
        out = []
        for layer, rows in enumerate(zip(*columns)):
            if rule.skip_qk_norm and layer in qk_norm_layers:
                continue
            for head, cell in enumerate(zip(*(row.tolist() for row in rows))):
                out.append((layer, head, cell))
        return out


RULES = [*DEFAULT_RULES, ENTROPY_COLLAPSE_RULE]
METRICS = sorted({m for rule in RULES for m in rule.metrics})


def probe(gen: torch.Generator, heads: list[int], step: int) -> dict:
    """Values around every rule's levels (log-uniform over four decades, growing with the step so
    that trends fire), with about 5 % NaN; layer l has heads[l] heads."""
    out = {}
    for metric in METRICS:
        layers = []
        for count in heads:
            v = 10 ** (torch.rand(count, generator=gen) * 4 - 2) * (1 + step / 40)
            v[torch.rand(count, generator=gen) < 0.05] = float("nan")
            layers.append(v)
        out[metric] = layers
    return out


def fired(alerts) -> list:
    return [dataclasses.astuple(dataclasses.replace(a, rule=None)) + (a.rule.name,) for a in alerts]


@pytest.mark.parametrize("heads", [[4, 4, 4], [3, 5, 1]], ids=["uniform", "ragged"])
def test_stepping_the_changeable_cells_equals_stepping_every_cell(heads):
    gen = torch.Generator().manual_seed(0)
    fast, reference = AlertTracker(RULES), EveryCell(RULES)
    names = [f"layer{i}" for i in range(len(heads))]
    total = 0
    losses = []
    for i in range(60):
        step = 10 * i
        losses.append((step, 2.0 - 0.02 * i if i % 20 < 10 else 1.0))  # learning, then stalled
        values = probe(gen, heads, step)
        kwargs = dict(qk_norm_layers=(1,), losses=losses[-12:], first_loss=2.0)
        got = fast.update(values, step, names, **kwargs)
        want = reference.update(values, step, names, **kwargs)
        assert fired(got) == fired(want), step
        assert fast.state_dict() == reference.state_dict(), step
        total += len(got)
    assert total > 20  # the rules fired, recovered and fired again
    assert fast.counts == reference.counts


def test_the_remembered_values_are_each_cells_recent_finite_ones():
    """The trend history (``state_dict``'s "history" and "start"), against its definition: per
    (metric, layer, head) of a trend metric, the finite values fed (NaN and inf left out; a step
    fed again replaces that step's value), kept from the newest one at least the longest window
    older than the cell's last finite value; and the cell's first finite value."""
    trends = [t for rule in RULES for t in rule.tests if t.growth is not None]
    horizon = max(t.window for t in trends if t.window is not None)
    gen = torch.Generator().manual_seed(1)
    heads = [3, 5, 1]
    tracker = AlertTracker(RULES)
    fed: dict[str, dict[int, float]] = {}  # cell -> step -> its value
    first: dict[str, list] = {}  # cell -> [step, value] of its first finite value
    for i in range(40):
        step = 10 * (i - i // 7)  # every 7th probe is at the step before it again
        values = probe(gen, heads, step)
        for metric in values:
            for layer in values[metric]:
                layer[torch.rand(layer.shape, generator=gen) < 0.03] = float("inf")
        tracker.update(values, step, [f"layer{i}" for i in range(len(heads))])
        for metric in {t.metric for t in trends}:
            for layer, row in enumerate(values[metric]):
                for head, value in enumerate(row.tolist()):
                    if math.isfinite(value):
                        key = f"{metric}/{layer}/{head}"
                        fed.setdefault(key, {})[step] = value
                        first.setdefault(key, [step, value])
    want = {}
    for key, by_step in fed.items():
        entries = sorted(by_step.items())
        old = [j for j, (s, _) in enumerate(entries) if s <= entries[-1][0] - horizon]
        want[key] = [list(e) for e in entries[old[-1] if old else 0 :]]
    assert any(len(v) > 1 for v in want.values()) and any(v[0][0] > 0 for v in want.values())
    state = tracker.state_dict()
    assert state["history"] == want
    assert state["start"] == first

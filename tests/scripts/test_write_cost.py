"""benchmarks/write_cost.py writes the scalars a probe of the three monitors writes."""

from __future__ import annotations

from qkmonitor.measures.catalogue import ENTROPY, RANK, SPECTRUM, metrics_of


def test_write_cost_times_every_scalar_of_a_per_head_probe(benchmark_module):
    write_cost = benchmark_module("write_cost")
    layers, heads = 3, 5
    figures = write_cost.measure(layers, heads, probes=2)
    # per layer: a per-head metric's mean, lowest and highest head and each head; else one value
    expected = layers * sum(
        3 + heads if spec.per_head else 1
        for monitor in (SPECTRUM, ENTROPY, RANK)
        for spec in metrics_of(monitor)
    )
    assert figures["scalars"] == expected
    assert all(figures[part] > 0 for part in ("tags", "tensorboard", "flush", "csv", "save"))

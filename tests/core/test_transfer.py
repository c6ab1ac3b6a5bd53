"""measures.transfer.to_python: one transfer per device and dtype gives each tensor's values as
reading it alone does (the reference: ``t.reshape(-1).tolist()`` of each), in order."""

from __future__ import annotations

import math

import torch

from qkmonitor.engine.publishing import as_rows
from qkmonitor.measures.transfer import to_python


def mixed() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(4, generator=gen),
        torch.randn(2, 3, generator=gen, dtype=torch.float64),
        torch.tensor(float("nan")),
        torch.empty(0),
        torch.tensor([True, False]),
        torch.arange(5),
        torch.randn(3, generator=gen).to(torch.bfloat16),
        torch.randn(1, generator=gen),
    ]


def test_each_tensors_values_as_reading_it_alone():
    tensors = mixed()
    got = to_python(tensors)
    want = [t.reshape(-1).tolist() for t in tensors]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert [type(x) for x in g] == [type(x) for x in w]
        assert all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(g, w, strict=True))


def test_as_rows_reads_tensors_and_keeps_lists():
    values = {"kappa": [torch.tensor([0.5, 0.25]), [0.1, 0.2]], "x": [torch.tensor([1.0])]}
    assert as_rows(values) == {"kappa": [[0.5, 0.25], [0.1, 0.2]], "x": [[1.0]]}
    assert to_python([]) == []

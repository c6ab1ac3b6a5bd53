"""Parameters partitioned by their owner (DeepSpeed ZeRO-3: between forwards a rank holds none of a
weight's ``ds_numel`` entries, its ``.data`` empty) are read through the owner's gather API where it
is installed, else refused by name: never a κ of an empty or partial tensor (issue 42, item 4).

ZeRO-3 is played here by hooks that give the attention its weights for its forward and take them
away after, as DeepSpeed's do; DeepSpeed itself is not installed on the test machine, so its
``GatheredParameters`` is a stand-in of the same contract (the parameters whole inside the block,
partitioned again after it)."""

from __future__ import annotations

import contextlib
import math
import sys
import types
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from qkmonitor.engine import AttentionEntropy, Monitoring, QKSpectrum
from qkmonitor.measures.spectra import spectral_concentration

D, H, HEAD_DIM, T = 16, 2, 8, 6


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(D, H * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(D, H * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(D, H * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(H * HEAD_DIM, D, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, -1, HEAD_DIM).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Attention(), Attention()])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


class ZeroThree:
    """Partitions every weight between steps, as ZeRO-3 does between forwards: ``ds_numel`` and
    ``ds_shape`` stated, ``.data`` empty; each layer's forward gets its weights back (kept through
    the backward and the optimizer's step, partitioned again after it)."""

    def __init__(self, model: nn.Module) -> None:
        self.full = {p: p.data for p in model.parameters()}
        for p in self.full:
            p.ds_numel, p.ds_shape = p.numel(), tuple(p.shape)
        for layer in model.layers:
            layer.register_forward_pre_hook(lambda m, args: self.gather(m.parameters()))
        self.params = list(self.full)
        self.partition(self.params)

    def gather(self, params) -> None:
        for p in params:
            p.data = self.full[p]

    def partition(self, params) -> None:
        for p in params:
            self.full[p] = p.data
            p.data = torch.empty(0)


def _train(model: nn.Module, steps: int = 2, zero: ZeroThree | None = None):
    torch.manual_seed(1)
    x = torch.randn(3, T, D)
    spectrum, entropy = QKSpectrum(per_head=True), AttentionEntropy(per_head=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitoring = Monitoring(model, [spectrum, entropy], every_n_steps=1, optimizer=optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for step in range(steps):
                with monitoring.step(step):
                    model(x).square().mean().backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    if zero is not None:
                        zero.partition(zero.params)
        finally:
            monitoring.close()
    return spectrum, entropy, [str(w.message) for w in caught]


def _model() -> Model:
    torch.manual_seed(0)
    return Model()


def test_partitioned_weights_are_refused_by_name_without_their_gather_api(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # not importable, even where installed
    model = _model()
    spectrum, entropy, said = _train(model, zero=ZeroThree(model))
    for values in spectrum.latest["kappa"]:  # never a κ of an empty tensor
        assert values.shape == (H,) and torch.isnan(values).all()
    for values in entropy.latest["entropy_norm"]:  # the forward computes with whole weights
        assert torch.isfinite(values).all()
    refusals = [w for w in said if "partitioned across ranks" in w]
    for name in ("layers.0", "layers.1"):
        told = [w for w in refusals if f"layer {name!r}" in w and "spectrum metrics are NaN" in w]
        assert len(told) == 1, refusals
        assert "DeepSpeed ZeRO-3" in told[0] and "GatheredParameters" in told[0]
    assert not [w for w in said if "please report" in w], said


def test_partitioned_weights_are_read_through_their_gather_api(monkeypatch):
    reference = _model()
    model = _model()
    zero = ZeroThree(model)

    @contextlib.contextmanager
    def gathered_parameters(params, modifier_rank=None):
        assert modifier_rank is None  # read-only
        params = list(params)
        zero.gather(params)
        try:
            yield
        finally:
            zero.partition(params)

    fake = types.ModuleType("deepspeed")
    fake.zero = types.SimpleNamespace(GatheredParameters=gathered_parameters)
    monkeypatch.setitem(sys.modules, "deepspeed", fake)
    monkeypatch.setitem(sys.modules, "deepspeed.zero", fake.zero)
    spectrum, _, said = _train(model, zero=zero)
    want_spectrum, _, _ = _train(reference)
    assert not [w for w in said if "spectrum metrics are NaN" in w or "please report" in w], said
    # the update metrics compare the rows before and after a step, which ZeRO-3 releases between
    # forwards: refused by name, once per layer
    updates = [w for w in said if "update and gradient metrics" in w and "ZeRO-3" in w]
    assert len(updates) == 2 and all("for the whole run" in w for w in updates), updates
    for got, want in zip(spectrum.latest["kappa"], want_spectrum.latest["kappa"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    # and step 0's (read before the first forward, from a copy) against float64 SVDs of the
    # initial weights
    model = _model()
    zero = ZeroThree(model)
    spectrum, _, _ = _train(model, steps=1, zero=zero)
    assert spectrum.schedule.latest_step == 0
    for layer, got in zip(_model().layers, spectrum.latest["kappa"]):
        w_q = layer.q_proj.weight.detach().double().view(H, HEAD_DIM, D)
        w_k = layer.k_proj.weight.detach().double().view(H, HEAD_DIM, D)
        want = spectral_concentration(torch.linalg.svdvals(w_q.mT @ w_k))  # W_Q^h W_K^hᵀ, d x d
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(got.tolist(), want.tolist()))


def test_partitioned_names_a_parameter_its_owner_partitions():
    from qkmonitor.measures.sharding import partitioned, stated_shape

    full = torch.randn(4, 4)
    assert partitioned(full) is None and stated_shape(full) == (4, 4)
    part = torch.empty(0)
    part.ds_numel, part.ds_shape = 16, (4, 4)
    assert "16 entries" in partitioned(part) and "ZeRO-3" in partitioned(part)
    assert stated_shape(part) == (4, 4)

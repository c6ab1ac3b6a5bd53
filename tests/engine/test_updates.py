"""The optimizer's view of W_Q and W_K (``q_update_ratio``, ``k_update_ratio``, ``q_grad_norm``,
``k_grad_norm``): against each head's rows copied by the test before the update and compared in
float64 after it, with AdamW, SGD and Muon, in a plain loop, in a Lightning fit and through
nn.MultiheadAttention's packed projection; NaN (and one line saying why) where no update was seen;
the optimizer hook removed by ``close``."""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.testing import assert_close

from qkmonitor.engine import Monitoring, QKSpectrum
from qkmonitor.output.sinks import MemorySink

from .tiny import TOKENS, TinyTask, decoder

METRICS = ("q_update_ratio", "k_update_ratio", "q_grad_norm", "k_grad_norm")


def projections(model: nn.Module) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """Each layer's (W_Q, W_K) parameters of the bundled decoder."""
    weights = dict(model.named_parameters())
    names = sorted(n for n in weights if n.endswith("q_proj.weight"))
    return [(weights[n], weights[n.replace("q_proj", "k_proj")]) for n in names]


def expected(before, after, grads, heads: int, kv_heads: int) -> dict[str, list[torch.Tensor]]:
    """The four metrics from the test's own copies: per head, float64 norms of its rows."""

    def per_head(x: torch.Tensor, count: int) -> torch.Tensor:
        return x.double().reshape(count, -1).norm(dim=1)

    group = heads // kv_heads
    out: dict[str, list[torch.Tensor]] = {m: [] for m in METRICS}
    for (q0, k0), (q1, k1), (gq, gk) in zip(before, after, grads):
        out["q_update_ratio"].append(per_head(q1 - q0, heads) / per_head(q0, heads))
        k_ratio = per_head(k1 - k0, kv_heads) / per_head(k0, kv_heads)
        out["k_update_ratio"].append(k_ratio.repeat_interleave(group))
        out["q_grad_norm"].append(per_head(gq, heads))
        out["k_grad_norm"].append(per_head(gk, kv_heads).repeat_interleave(group))
    return out


def train(model, optimizer, steps: int, every: int):
    """A plain loop that copies W_Q/W_K and their gradients before every update, and the
    weights after it; returns the Monitoring, its engine and ``{step: expected metrics}`` for
    the reads after each update."""
    engine = QKSpectrum(per_head=True)
    monitoring = Monitoring(
        model, [engine], writer=MemorySink(), every_n_steps=every, optimizer=optimizer
    )
    truth = {}
    for step in range(steps):
        with monitoring.step(step):
            model(TOKENS).logsumexp(-1).mean().backward()
            pairs = projections(model)
            before = [(q.detach().clone(), k.detach().clone()) for q, k in pairs]
            grads = [(q.grad.clone(), k.grad.clone()) for q, k in pairs]
            optimizer.step()
            optimizer.zero_grad()
            after = [(q.detach().clone(), k.detach().clone()) for q, k in pairs]
        config = model.config
        kv = config.n_kv_heads or config.n_heads
        truth[step + 1] = expected(before, after, grads, config.n_heads, kv)
    monitoring.observe_weights(steps)  # a plain loop reads the weights at a window's start
    return monitoring, engine, truth


@pytest.mark.parametrize(
    ("optimizer_name", "n_kv_heads"),
    [("adamw", None), ("sgd", None), ("adamw", 2), ("muon", None)],
)
def test_update_metrics_are_each_heads_rows_before_and_after_the_update(optimizer_name, n_kv_heads):
    model = decoder(n_kv_heads)
    if optimizer_name == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    elif optimizer_name == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    else:  # Muon takes 2-D weights only: the projections (and every other matrix), no vectors
        if not hasattr(torch.optim, "Muon"):
            pytest.skip(f"torch {torch.__version__} has no torch.optim.Muon (2.8 has not either)")
        matrices = [p for p in model.parameters() if p.dim() == 2]
        optimizer = torch.optim.Muon(matrices, lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no layer is left out, nothing broken
        monitoring, engine, truth = train(model, optimizer, steps=4, every=2)
    values = engine.latest  # the last read: after 4 updates, against the 4th update
    assert engine.schedule.latest_step == 4
    for name in METRICS:
        for got, want in zip(values[name], truth[4][name]):
            assert_close(got.double(), want.float().double(), rtol=1e-5, atol=0)
    assert all(torch.isfinite(v).all() for name in METRICS for v in values[name])
    monitoring.close()
    assert not optimizer._optimizer_step_pre_hooks  # the hook went with close


def test_each_read_compares_the_update_just_before_it():
    """Reads at every other step: the metrics logged at step 2 are those of the second update
    (not the first, nor a sum of both)."""
    model = decoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    engine = QKSpectrum(per_head=True)
    sink = MemorySink()
    monitoring = Monitoring(model, [engine], writer=sink, every_n_steps=2, optimizer=optimizer)
    logged = {}
    for step in range(3):
        with monitoring.step(step):
            model(TOKENS).logsumexp(-1).mean().backward()
            q = projections(model)[0][0]
            before = q.detach().clone()
            optimizer.step()
            optimizer.zero_grad()
            logged[step + 1] = (q.detach().double() - before.double()).reshape(4, -1).norm(
                dim=1
            ) / before.double().reshape(4, -1).norm(dim=1)
        if engine.schedule.latest_step == step:
            assert step in (0, 2)
            got = engine.latest["q_update_ratio"][0].double()
            if step == 0:
                assert got.isnan().all()  # no update before the initialization's read
            else:
                assert_close(got, logged[2].float().double(), rtol=1e-5, atol=0)
    monitoring.close()


def test_without_an_optimizer_the_metrics_are_nan_and_one_line_says_how_to_get_them(caplog):
    model = decoder()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = QKSpectrum()
    with warnings.catch_warnings(), caplog.at_level("INFO", logger="qkmonitor"):
        warnings.simplefilter("error")  # undefined, not broken: no warning
        with Monitoring(model, [engine], writer=MemorySink(), every_n_steps=1) as monitoring:
            for step in range(3):
                with monitoring.step(step):
                    model(TOKENS).sum().backward()
                    optimizer.step()
                    optimizer.zero_grad()
    lines = [
        r.getMessage() for r in caplog.records if "Monitoring(optimizer=...)" in r.getMessage()
    ]
    assert len(lines) == 1
    for name in METRICS:
        assert all(v.isnan().all() for v in engine.latest[name])
    assert all(torch.isfinite(v).all() for v in engine.latest["kappa"])  # the rest as before


def test_nan_weights_give_nan_ratios_and_training_goes_on():
    model = decoder()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitoring = Monitoring(
            model, [QKSpectrum()], writer=MemorySink(), every_n_steps=1, optimizer=optimizer
        )
        engine = monitoring.engines[0]
        for step in range(2):
            with monitoring.step(step):
                model(TOKENS).sum().backward()
                if step == 1:
                    with torch.no_grad():
                        projections(model)[0][0][0, 0] = math.nan  # layer 0's head 0, mid-step
                optimizer.step()
                optimizer.zero_grad()
        monitoring.observe_weights(2)
        monitoring.close()
    ratio = engine.latest["q_update_ratio"]
    assert ratio[0][0].isnan() and torch.isfinite(ratio[1]).all()
    assert any("non-finite" in str(w.message) for w in caught)


def test_a_failing_step_leaves_the_hook_until_close_and_close_removes_it():
    model = decoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    monitoring = Monitoring(
        model, [QKSpectrum()], writer=MemorySink(), every_n_steps=1, optimizer=optimizer
    )
    with pytest.raises(RuntimeError, match="boom"), monitoring.step(0):
        model(TOKENS).sum().backward()
        optimizer.step()
        raise RuntimeError("boom")
    assert len(optimizer._optimizer_step_pre_hooks) == 1
    monitoring.close()
    assert not optimizer._optimizer_step_pre_hooks
    optimizer.step()  # an optimizer of a closed Monitoring steps as before


def test_packed_multihead_attention_rows_are_read_through_the_packed_weight():
    """nn.MultiheadAttention keeps W_Q and W_K in one packed in_proj_weight: each head's rows and
    their gradient come out of it."""
    torch.manual_seed(0)
    model = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0), num_layers=1,
        enable_nested_tensor=False,
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    engine = QKSpectrum(per_head=True)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2))
    with Monitoring(
        model, [engine], writer=MemorySink(), every_n_steps=1, optimizer=optimizer
    ) as m:
        with m.step(0):
            model(x).square().mean().backward()
            packed = model.layers[0].self_attn.in_proj_weight
            before, grad = packed.detach().clone(), packed.grad.clone()
            optimizer.step()
            optimizer.zero_grad()
        m.observe_weights(1)
    after = packed.detach()

    def heads(w: torch.Tensor, part: int) -> torch.Tensor:
        return w[part * 16 : (part + 1) * 16].double().reshape(2, -1).norm(dim=1)

    change = after.double() - before.double()
    for part, name in ((0, "q"), (1, "k")):
        ratio = heads(change, part) / heads(before, part)
        got = {m: engine.latest[f"{name}_{m}"][0].double() for m in ("update_ratio", "grad_norm")}
        assert_close(got["update_ratio"], ratio.float().double(), rtol=1e-5, atol=0)
        assert_close(got["grad_norm"], heads(grad, part).float().double(), rtol=1e-5, atol=0)


class _Copies(pl.Callback):
    """Copies W_Q/W_K and their gradients before each update and the weights after it."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        pairs = projections(pl_module.model)
        self.before = [(q.detach().clone(), k.detach().clone()) for q, k in pairs]
        self.grads = [(q.grad.clone(), k.grad.clone()) for q, k in pairs]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        after = [(q.detach().clone(), k.detach().clone()) for q, k in projections(pl_module.model)]
        pl_module.copies[trainer.global_step] = expected(self.before, after, self.grads, 4, 4)


def test_lightning_fit_reads_the_update_before_each_probe(tmp_path):
    from qkmonitor.callbacks import QKSpectrumMonitor

    task = TinyTask()
    task.copies = {}
    monitor = QKSpectrumMonitor(every_n_steps=2, per_head=True)
    trainer = pl.Trainer(
        max_steps=4, logger=False, callbacks=[_Copies(), monitor], enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(task)
    engine = monitor.engine
    assert engine.schedule.latest_step == 4
    for name in METRICS:
        for got, want in zip(engine.latest[name], task.copies[4][name]):
            assert_close(got.double(), want.float().double(), rtol=1e-5, atol=0)


def test_a_comparison_that_fails_warns_once_and_training_goes_on(monkeypatch):
    import qkmonitor.engine.optimizer_view as view_module

    def broken(snapshot, heads):
        raise RuntimeError("unreadable")

    monkeypatch.setattr(view_module, "update_metrics", broken)
    model = decoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    engine = QKSpectrum()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Monitoring(
            model, [engine], writer=MemorySink(), every_n_steps=1, optimizer=optimizer
        ) as monitoring:
            for step in range(3):
                with monitoring.step(step):
                    model(TOKENS).sum().backward()
                    optimizer.step()
                    optimizer.zero_grad()
    messages = [str(w.message) for w in caught]
    assert sum("could not be read (RuntimeError: unreadable)" in m for m in messages) == 1
    assert engine.schedule.latest_step == 2
    assert all(v.isnan().all() for name in METRICS for v in engine.latest[name])
    assert all(torch.isfinite(v).all() for v in engine.latest["kappa"])
    assert not optimizer._optimizer_step_pre_hooks

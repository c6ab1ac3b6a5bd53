"""The output logits' channel of AttentionEntropy (``output_lse_rms``, ``output_logit_max`` under
``{prefix}/run/``): against float64 math on the logits the test's own forward returned, in a plain
loop (the model's output) and in a Lightning fit (a LightningModule whose ``training_step`` calls a
child); a rule reading them; NaN logits warned once; nothing logged, with one line, where no
output logits exist."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from qkmonitor.alerts import AlertRule, Condition, LogitGrowthWarning
from qkmonitor.engine import AttentionEntropy, Monitoring
from qkmonitor.engine.entropy import logits_of
from qkmonitor.output.sinks import MemorySink

from .tiny import TOKENS, decoder


def expected(logits: torch.Tensor) -> dict[str, float]:
    x = logits.detach().double()
    return {
        "output_lse_rms": float(torch.logsumexp(x, -1).square().mean().sqrt()),
        "output_logit_max": float(x.abs().max()),
    }


def test_the_models_output_logits_in_a_plain_loop():
    model = decoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    engine = AttentionEntropy()
    sink = MemorySink()
    seen = {}
    with Monitoring(model, [engine], writer=sink, every_n_steps=2, optimizer=optimizer) as m:
        for step in range(3):
            with m.step(step):
                logits = model(TOKENS)
                seen[step] = expected(logits)
                logits.logsumexp(-1).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
    assert engine.schedule.latest_step == 2
    assert engine.latest_run == pytest.approx(seen[2], rel=1e-6)
    written = {(tag, step): value for tag, value, step in sink.scalars}
    for name, value in seen[0].items():
        assert written[(f"qkmonitor/run/{name}", 0)] == pytest.approx(value, rel=1e-6)


class _Task(pl.LightningModule):
    """``training_step`` calls the child model: the LightningModule's own forward never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.model = decoder()
        self.criterion = nn.CrossEntropyLoss()  # a child whose output (a scalar) is no logits
        self.seen: dict[int, dict[str, float]] = {}

    def training_step(self, batch, batch_idx):
        logits = self.model(batch[:, :-1])
        self.seen[self.global_step] = expected(logits)
        return self.criterion(logits.flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader([TOKENS[0]] * 8, batch_size=2)


def test_a_lightning_modules_child_gives_the_logits(tmp_path):
    from qkmonitor.callbacks import AttentionEntropyMonitor

    task = _Task()
    monitor = AttentionEntropyMonitor(every_n_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        pl.Trainer(
            max_steps=3, logger=False, callbacks=[monitor], enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
        ).fit(task)  # fmt: skip
    assert monitor.engine.schedule.latest_step == 2
    assert monitor.engine.latest_run == pytest.approx(task.seen[2], rel=1e-6)


def test_a_rule_reads_the_output_logits_as_a_run_signal():
    rule = AlertRule(
        name="outputs", metric="max_logit", threshold=-1e9, above=True, patience=1, margin=0.0,
        warning=LogitGrowthWarning, meaning="test", advice="test",
        also=(Condition("output_logit_max", 0.0, above=True),),
    )  # fmt: skip
    fired = []
    model = decoder()
    engine = AttentionEntropy(alerts=[rule], on_alert=lambda owner, a: fired.append(a))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        m = Monitoring(model, [engine], writer=MemorySink(), every_n_steps=1)
        with m.step(0):
            logits = model(TOKENS)
        m.close()
    assert fired and all(a.step == 0 for a in fired)
    assert fired[0].also_values == (pytest.approx(expected(logits)["output_logit_max"]),)
    assert "output_logit_max = " in fired[0].message()


def test_nan_logits_are_logged_as_nan_with_one_warning_and_training_goes_on():
    model = decoder()
    with torch.no_grad():
        model.head.weight[0, 0] = math.nan  # one output logit per position: NaN
    engine = AttentionEntropy(alerts=[])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Monitoring(model, [engine], writer=MemorySink(), every_n_steps=1) as m:
            for step in range(2):
                with m.step(step):
                    model(TOKENS)
    assert math.isnan(engine.latest_run["output_lse_rms"])
    assert sum("output_lse_rms is nan" in str(w.message) for w in caught) == 1


class _Hidden(nn.Module):
    """A model whose output is a scalar and whose children give none either."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x)[0].sum()


def test_without_output_logits_nothing_is_logged_and_one_line_says_so(caplog):
    model = _Hidden()
    engine = AttentionEntropy(alerts=[])
    sink = MemorySink()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(), caplog.at_level("INFO", logger="qkmonitor"):
        warnings.simplefilter("error")
        with Monitoring(model, [engine], writer=sink, every_n_steps=1) as m:
            for step in range(2):
                with m.step(step):
                    model(x)
    assert engine.latest_run == {}
    assert not [tag for tag, _, _ in sink.scalars if "/run/" in tag]
    assert sum("no output logits" in r.getMessage() for r in caplog.records) == 1


def test_logits_of_reads_the_usual_output_forms():
    x = torch.randn(2, 3, 5)
    assert logits_of(x) is x
    assert logits_of((x, torch.tensor(1.0))) is x  # nanoGPT's (logits, loss)
    assert logits_of({"logits": x, "loss": 1.0}) is x
    assert logits_of(SimpleNamespace(logits=x)) is x
    assert logits_of(torch.tensor(1.0)) is None  # a loss
    assert logits_of(torch.randn(4, 1)) is None  # one class: no partition to speak of
    assert logits_of(torch.arange(6).view(2, 3)) is None  # integers (token ids)
    assert logits_of(None) is None


def test_a_failing_step_leaves_no_output_hook_and_the_next_probe_reads_the_logits(leftovers):
    model = decoder()
    engine = AttentionEntropy(alerts=[])
    with Monitoring(model, [engine], writer=MemorySink(), every_n_steps=1) as m:
        with pytest.raises(RuntimeError, match="boom"), m.step(0):
            model(TOKENS)
            raise RuntimeError("boom")
        assert leftovers(model) == []  # the hooks on the model and its children are gone
        with m.step(1):
            logits = model(TOKENS)
    assert engine.schedule.latest_step == 1
    assert engine.latest_run == pytest.approx(expected(logits), rel=1e-6)  # nothing of step 0
    assert leftovers(model) == []


def test_logits_that_cannot_be_read_warn_once_and_training_goes_on(monkeypatch):
    import qkmonitor.engine.entropy as entropy_module

    def broken(logits):
        raise RuntimeError("unreadable")

    monkeypatch.setattr(entropy_module, "logit_sums", broken)
    model = decoder()
    engine = AttentionEntropy(alerts=[])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Monitoring(model, [engine], writer=MemorySink(), every_n_steps=1) as m:
            for step in range(3):
                with m.step(step):
                    model(TOKENS).sum().backward()
    messages = [str(w.message) for w in caught]
    assert (
        sum("output logits could not be read (RuntimeError: unreadable)" in x for x in messages)
        == 1
    )
    assert engine.schedule.latest_step == 2 and torch.isfinite(engine.latest["entropy"][0]).all()


def test_bf16_autocast_logits_are_read_in_float32():
    model = decoder()
    engine = AttentionEntropy(alerts=[])
    m = Monitoring(model, [engine], writer=MemorySink(), every_n_steps=1)
    with m.step(0), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(TOKENS)
    m.close()
    assert logits.dtype == torch.bfloat16
    assert engine.latest_run == pytest.approx(expected(logits), rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "last positions", "positions first"])
def test_logit_sums_in_parts_equal_float64_and_make_no_temporary_beyond_a_part(
    monkeypatch, dtype, layout
):
    """The logits are read a few positions at a time (a part of 3 x 64 here): the sums equal
    float64 math on the whole (in float32 for half-precision logits), whatever their strides (a
    slice of the last positions, positions before the batch), and no operation makes a tensor
    larger than a part of float32 logits: the hook never holds a copy of the whole logits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from qkmonitor.measures import metrics

    gen = torch.Generator().manual_seed(5)
    full = (4 * torch.randn(3, 9, 64, generator=gen)).to(dtype)
    logits = {
        "contiguous": full,
        "last positions": full[:, -5:],  # rows of each sequence, not one block
        "positions first": full.transpose(0, 1),  # (9, 3, 64): positions then batch
    }[layout]
    part = 3 * 64
    monkeypatch.setattr(metrics, "LOGITS_PER_PART", part)
    made: list[int] = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else [out]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() != (
                    full.untyped_storage().data_ptr()
                ):
                    made.append(t.untyped_storage().nbytes())
            return out

    with Sizes():
        square_sum, positions, largest = metrics.logit_sums(logits)
    x = logits.double()
    lse = torch.logsumexp(x, -1)
    assert positions.item() == lse.numel()
    assert square_sum.item() == pytest.approx(float(lse.square().sum()), rel=1e-6)
    assert largest.item() == float(x.abs().max())
    assert made and max(made) <= part * 4


def test_logit_sums_carry_nan_and_inf_from_any_part(monkeypatch):
    """A NaN in one part makes the sum NaN; an infinite logit makes the largest infinite."""
    from qkmonitor.measures import metrics

    monkeypatch.setattr(metrics, "LOGITS_PER_PART", 2 * 16)
    logits = torch.randn(2, 6, 16)
    broken = logits.clone()
    broken[1, 4, 3] = float("nan")
    assert math.isnan(metrics.logit_sums(broken)[0].item())
    broken = logits.clone()
    broken[0, 5, 0] = float("-inf")
    assert metrics.logit_sums(broken)[2].item() == math.inf

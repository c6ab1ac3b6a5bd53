"""A probe leaves nothing for Python's cyclic collector: what it made for a step (the channels, each
forward's capture and the tensors it kept: the projections' inputs, the operands of the latest
matmul of 4-D tensors) is freed by reference counting, as a step without the monitor frees its own.

A forward's capture and its interceptor once held each other. The pair, ~40 objects a layer and
the tensors the capture kept, then lived until the collector next ran: for an explicit softmax
(``softmax(q @ kᵀ) @ v``) that was each layer's attention probabilities (B, H, N, M) and the
storages of its values and input, 24 MiB a layer at B 8, 8 heads, N 256, held past the step
(under ``no_grad`` too, where nothing else holds them; on a GPU, memory the next step's peak could
not reuse).

The reference is the collector itself: with it disabled, ``gc.collect()`` after the probe counts
the unreachable objects. A probe leaves none of qkmonitor's and no tensor, and none at all where
the model's own step leaves none (all but flex_attention, whose eager path leaves torch's pytree
helpers in cycles at every call, also where qkmonitor calls it)."""

from __future__ import annotations

import gc
import warnings
from collections import Counter
from contextlib import contextmanager
from functools import partial
from types import FunctionType

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger

from qkmonitor import QKMonitor
from qkmonitor.engine import (
    AttentionEntropy,
    EffectiveRank,
    Monitoring,
    QKClipEngine,
    QKSpectrum,
)
from qkmonitor.output.sinks import MemorySink
from tests.core.test_intercept import Model, ModuloGQA, NanoAttention, T
from tests.engine.tiny import decoder


@contextmanager
def collector_off():
    """The cyclic collector disabled, what exists now frozen out of its walks (a collection then
    looks only at what was made since: fast in a process holding torch and transformers), and
    both put back after."""
    enabled = gc.isenabled()
    gc.disable()
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.unfreeze()
        if enabled:
            gc.enable()


def unreachable_after(run) -> Counter:
    """What ``run()`` left unreachable in reference cycles (collector off), by type (by module and
    name for a function: a closure says whose it is)."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    run()
    gc.collect()
    found = Counter(
        f"function {o.__module__}.{o.__qualname__}"
        if type(o) is FunctionType  # (type: a dead weak proxy raises on isinstance)
        else f"{type(o).__module__}.{type(o).__qualname__}"
        for o in gc.garbage
    )
    gc.garbage.clear()
    gc.set_debug(0)
    return found


def ours(found: Counter) -> Counter:
    """Of what :func:`unreachable_after` found, qkmonitor's objects and functions, and tensors."""
    return Counter(
        {
            kind: n
            for kind, n in found.items()
            if "qkmonitor." in kind or kind in ("torch.Tensor", "torch.nn.parameter.Parameter")
        }
    )


def engines():
    return [
        QKSpectrum(every_n_steps=1),
        AttentionEntropy(every_n_steps=1, per_head=True),
        EffectiveRank(),
        QKClipEngine(tau=1.0),  # clips every step: its rows are scaled at each probe
    ]


def _token_model(build):
    """A model of tokens, its batch, and its loss (next-token cross entropy)."""
    tokens = torch.randint(0, 20, (2, T), generator=torch.Generator().manual_seed(0))
    model = build()
    return model, tokens, lambda out: F.cross_entropy(out.flatten(0, 1), tokens.flatten())


def _flex_model():
    """Two blocks of ``flex_attention`` with a score_mod and a block mask, on float inputs
    (flex_attention has no backward on CPU: forward only)."""
    pytest.importorskip("torch.nn.attention.flex_attention")  # torch 2.5 on
    kernels = pytest.importorskip("tests.core.test_other_kernels")
    torch.manual_seed(0)
    block = partial(kernels.FlexAttention, kernels.soft_cap, kernels.causal_window)
    x = torch.randn(2, T, kernels.D, generator=torch.Generator().manual_seed(0))
    return kernels.Model(block(), block()), x, None


MODELS = {
    "sdpa and explicit softmax": lambda: _token_model(
        lambda: Model(NanoAttention(), NanoAttention(flash=False))
    ),
    "GQA with RoPE": lambda: _token_model(lambda: Model(ModuloGQA(), ModuloGQA())),
    "bundled decoder": lambda: _token_model(decoder),
    "flex_attention": _flex_model,
}


@pytest.mark.parametrize("training", [True, False], ids=["training", "no_grad"])
@pytest.mark.parametrize("name", MODELS)
def test_a_probe_leaves_no_reference_cycle(name, training):
    """A probed training step, and a probed forward under ``no_grad`` (a validation probe, where
    nothing else holds the forward's tensors), leave the collector nothing to find."""
    model, batch, loss = MODELS[name]()
    if training and loss is None:
        pytest.skip(f"{name}: no backward on this device")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitoring = Monitoring(
        model, engines(), writer=MemorySink(), every_n_steps=1, optimizer=optimizer
    )
    step = iter(range(100))

    def run():
        if training:
            loss(model(batch)).backward()
            optimizer.step()
            optimizer.zero_grad()
        else:
            with torch.no_grad():
                model(batch)

    def probed():
        with monitoring.step(next(step)):
            run()

    with collector_off(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        run()
        probed()  # first-step work (discovery, warnings given once, compilations) apart
        own = unreachable_after(run)
        for _ in range(2):
            found = unreachable_after(probed)
            assert ours(found) == Counter()
            if not own:  # torch's flex_attention leaves cycles of its own (its pytree helpers)
                assert found == Counter()
    monitoring.close()


def _nanogpt_pair():
    torch.manual_seed(0)
    return Model(NanoAttention(), NanoAttention(flash=False))


def _fail(module, args):
    raise RuntimeError("the user's step failed")


@pytest.mark.parametrize("how", ["raises mid-probe", "bf16 autocast", "torch.compile"])
def test_a_failing_autocast_or_compiled_probe_leaves_no_reference_cycle(how):
    """The failure path and the other ways a step runs: a step whose forward raises inside a probed
    layer (caught by the user's loop), a step under bf16 autocast, a ``torch.compile``d model:
    each leaves in cycles exactly what the same step leaves unprobed (nothing, on a CPU build)."""
    model = _nanogpt_pair()
    tokens = torch.randint(0, 20, (2, T), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitoring = Monitoring(
        model, engines(), writer=MemorySink(), every_n_steps=1, optimizer=optimizer
    )
    forward = torch.compile(model, backend="eager") if how == "torch.compile" else model
    steps = iter(range(100))
    raised = []

    def run():
        handle = None
        if how == "raises mid-probe":  # the second block's output projection raises
            handle = model.blocks[1].c_proj.register_forward_pre_hook(_fail)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "bf16 autocast")
        try:
            with autocast:
                logits = forward(tokens).float()
                F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        except RuntimeError as err:
            assert how == "raises mid-probe" and "the user's step failed" in str(err)
            raised.append(err)
        finally:
            if handle is not None:
                handle.remove()

    def probed():
        with monitoring.step(next(steps)):
            run()

    with collector_off(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the failed step's warning; the logit floor's
        for _ in range(3):  # first-steps work apart: discovery; dynamo's (re)compilations
            probed()
        # The step's own leftovers: none on torch 2.13; on 2.4 and 2.8 a CUDA build of torch on a
        # machine without a GPU leaves NVML's ctypes function types at each torch.autocast(...).
        # (Unprobed, the compiled model would recompile: its step is held to none at all.)
        own = Counter() if how == "torch.compile" else unreachable_after(run)
        for _ in range(2):
            assert unreachable_after(probed) == own
    assert len(raised) == (6 if how == "raises mid-probe" else 0)
    monitoring.close()


class _Census(pl.Callback):
    """After each training batch from the second on: what the batch left in reference cycles
    (the collector off for the fit), of qkmonitor's or tensors (:func:`ours`)."""

    def __init__(self) -> None:
        self.left: list[Counter] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        gc.collect()  # what came before this batch (the fit's start, the first probe's binding)
        gc.set_debug(gc.DEBUG_SAVEALL)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        gc.collect()
        found = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
        gc.garbage.clear()
        gc.set_debug(0)
        if batch_idx > 0:
            self.left.append(ours(found))


class _Intercepted(pl.LightningModule):
    """The SDPA and explicit-softmax blocks in a LightningModule, with a validation loop."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Model(NanoAttention(), NanoAttention(flash=False))
        self.tokens = torch.randint(0, 20, (16, T), generator=torch.Generator().manual_seed(0))

    def _loss(self, batch):
        return F.cross_entropy(self.model(batch).flatten(0, 1), batch.flatten())

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self._loss(batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.tokens, batch_size=2)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.tokens[:4], batch_size=2)


def test_a_lightning_fit_with_qkmonitor_leaves_no_reference_cycle_of_its_own(tmp_path):
    """The README's callback in a real Trainer (TensorBoard logger, validation between epochs):
    from the second batch on, no probed or unprobed batch leaves qkmonitor's objects or tensors
    in cycles."""
    census = _Census()
    trainer = pl.Trainer(
        max_epochs=2,
        callbacks=[QKMonitor(every_n_steps=2, per_head=True), census],
        logger=TensorBoardLogger(tmp_path),
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    with collector_off(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fit's own (its dataloader workers, the logit floor)
        trainer.fit(_Intercepted())
    assert len(census.left) == 14 and not any(census.left), census.left

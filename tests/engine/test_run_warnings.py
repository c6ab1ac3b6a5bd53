"""Warnings a run gives once, and values never NaN without a word.

- A model without data (meta, or lazy and not materialised) is one warning a run for a driver of
  three engines (``QKMonitor``, a ``Monitoring``), counted with every warning shown
  (``simplefilter("always")``), not Python's once-per-place filter.
- Sequences of one token: entropy_norm, attn_entropy_norm and hidden_collapse are undefined by
  definition (docs/metrics.md): NaN, marked undefined (no alert, no non-finite warning), and one
  warning per metric names the layers; the metrics that are defined are the float64 truth.
"""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import torch
from torch import nn

from qkmonitor.callbacks import QKMonitor
from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum
from qkmonitor.output.sinks import MemorySink

from ..callbacks.zoo import MODELS, SEQ, VOCAB, Encoder, Task


def engines():
    return [QKSpectrum(), AttentionEntropy(), EffectiveRank(max_probe_tokens=4)]


def caught_in(run) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught]


def test_a_meta_model_under_a_monitoring_of_three_engines_is_one_warning():
    with torch.device("meta"):
        model = MODELS["bundled"]()
    tokens = torch.randint(VOCAB, (2, SEQ), device="meta")

    def run():
        with Monitoring(model, engines(), every_n_steps=1) as monitoring:
            for step in range(3):
                with monitoring.step(step):
                    model(tokens)

    messages = caught_in(run)
    assert sum("hold no data" in m for m in messages) == 1, messages


def test_a_lazy_model_under_qkmonitor_is_one_warning(tmp_path):
    torch.manual_seed(0)
    model = Encoder()
    model.head = nn.LazyLinear(VOCAB)  # materialised by the first training forward
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=3,
        callbacks=[QKMonitor(every_n_steps=1)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    messages = caught_in(lambda: trainer.fit(Task(model)))
    assert sum("lazy parameters are not materialised" in m for m in messages) == 1, messages


def test_one_token_sequences_are_undefined_with_one_warning_per_metric():
    torch.manual_seed(0)
    model = MODELS["bundled"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(VOCAB, (3, 1), generator=torch.Generator().manual_seed(0))
    spectrum, entropy, rank = engines()

    def run():
        with Monitoring(
            model, [spectrum, entropy, rank], writer=MemorySink(), every_n_steps=1,
            optimizer=optimizer,
        ) as monitoring:  # fmt: skip
            for step in range(3):
                with monitoring.step(step):
                    model(tokens).logsumexp(-1).mean().backward()
                    optimizer.step()
                    optimizer.zero_grad()

    messages = caught_in(run)
    for name, engine in (
        ("entropy_norm", entropy),
        ("attn_entropy_norm", rank),
        ("hidden_collapse", rank),
    ):
        said = [
            m for m in messages if m.startswith(f"{type(engine).__name__}: {name} is undefined")
        ]
        assert len(said) == 1 and "'blocks.0.attn', 'blocks.1.attn'" in said[0], messages
        assert all(v.isnan().all() for v in engine.latest[name])
    assert not [m for m in messages if "not finite" in m or "non-finite" in m], messages
    # one key per row: entropy 0 and max_prob 1 exactly (the float64 truth of a softmax over one
    # logit), the largest logit finite
    for layer in range(2):
        assert entropy.latest["entropy"][layer].abs().max() == 0
        assert (entropy.latest["max_prob"][layer] == 1).all()
        assert all(math.isfinite(v) for v in entropy.latest["max_logit"][layer].tolist())

"""Issue 59's layouts, beyond what ``test_zoo.py`` checks of every entry.

- timm NesT's ``(B, H, T, N, d)`` queries (the heads before the image blocks): each head's
  max_logit equals the largest float64 scaled logit of the model's own call for that head (the
  entries ``timm-nest-*`` check κ, qk_spectral_norm, entropy_norm and max_prob);
- timm EfficientFormerV2's ``Attention2d`` mixes its heads by a 1×1 convolution (``talking_head1``)
  over ``(q @ k) * scale + bias`` before its softmax: refused by name at the first probe (NaN, one
  warning naming the layer), while the same model's ``Attention2dDownsample``, which mixes
  nothing, is measured against the float64 reference of its own logits; the monitored step trains
  as the unmonitored one.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

from qkmonitor.engine import AttentionEntropy, Monitoring
from qkmonitor.output.sinks import MemorySink

from .test_zoo import Capture, assert_refused, build, monitored_step, reference_statistics


def max_logits(records, heads_at: int) -> torch.Tensor:
    """Per head, the largest scaled logit of a module's recorded calls, in float64 (SDPA's
    ``scale · q·kᵀ``, or the logits a softmax got), the heads at ``heads_at`` of the calls."""
    out = []
    for kind, arguments, _ in records:
        if kind == "sdpa":
            q, k = arguments["query"].double(), arguments["key"].double()
            scale = arguments.get("scale") or 1.0 / math.sqrt(q.shape[-1])
            logits = scale * (q @ k.transpose(-1, -2))
        else:
            logits = arguments["logits"].double()
        logits = logits.movedim(heads_at, -3)
        out.append(logits.reshape(-1, *logits.shape[-3:]).amax(dim=(0, 2, 3)))
    return torch.stack(out).amax(0)


@pytest.mark.parametrize("name", ["timm-nest-sdpa", "timm-nest-softmax"])
def test_nest_max_logit_per_head_is_its_own_calls_largest_logit(name, monkeypatch):
    """Before issue 59 the heads were read from dim -3 (the blocks): a 2-head level logged 16
    "heads", the 1-block level one; each head's max_logit is now its own."""
    built = build(name)
    model = built.model
    twin = copy.deepcopy(model)
    _, entropy, _ = monitored_step(model, built)
    layers = [layer.name for layer in entropy.layers]
    capture = Capture(twin, layers)
    try:
        with capture:
            built.loss(twin)
    finally:
        capture.close()
    counts = []
    for i, layer in enumerate(layers):
        expected = max_logits(capture.records[layer], built.heads_at)
        got = entropy.latest["max_logit"][i].double()
        counts.append(got.numel())
        torch.testing.assert_close(
            got, expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=layer: n + m
        )
    assert counts == [2, 4, 4]  # the heads of each level (its blocks: 16, 4, 1)


def _efficientformer_v2():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(
        "efficientformerv2_s0",
        pretrained=False,
        img_size=64,
        depths=(1, 1, 2, 2),
        embed_dims=(8, 16, 24, 32),
        mlp_ratios=2,
        num_classes=5,
        distillation=False,
    )
    images = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    return model.train(), lambda m: m(images).square().mean()


def test_efficientformer_v2_talking_heads_are_refused_by_name_and_its_plain_attention_measured():
    pytest.importorskip("timm")  # a test extra (.ci/zoo_requirements.txt), absent at the minimums
    from timm.models.efficientformer_v2 import Attention2d, Attention2dDownsample

    model, loss = _efficientformer_v2()
    twin = copy.deepcopy(model)
    talking = [n for n, m in model.named_modules() if type(m) is Attention2d]
    plain = [n for n, m in model.named_modules() if type(m) is Attention2dDownsample]
    assert len(talking) == 4 and len(plain) == 1

    entropy = AttentionEntropy(per_head=True)
    monitoring = Monitoring(model, [entropy], writer=MemorySink(), every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with monitoring.step(0):
                monitored = loss(model)
                monitored.backward()
        finally:
            monitoring.close()
    said = [str(w.message) for w in caught]
    assert torch.equal(monitored.detach(), loss(twin).detach())

    index = {layer.name: i for i, layer in enumerate(entropy.layers)}
    assert sorted(index) == sorted(talking + plain)
    for name in talking:  # refused at the first probe: NaN, one warning naming the layer
        for metric in ("entropy_norm", "max_prob", "max_logit"):
            values = entropy.latest[metric][index[name]]
            assert_refused(said, name, r"talking heads: a convolution over the 8 heads", values)
        assert len([m for m in said if repr(name) in m]) == 1, said

    capture = Capture(twin, plain)
    try:
        with capture:
            loss(twin)
    finally:
        capture.close()
    (name,) = plain
    reference, problems = reference_statistics(capture.records[name])
    assert not problems, problems
    assert 0.2 < reference["entropy_norm"].mean() < 0.9, reference
    for metric in ("entropy_norm", "max_prob"):
        torch.testing.assert_close(
            entropy.latest[metric][index[name]].double(), reference[metric], rtol=0, atol=2e-6
        )
    torch.testing.assert_close(
        entropy.latest["max_logit"][index[name]].double(),
        max_logits(capture.records[name], -3),
        rtol=1e-5,
        atol=1e-6,
    )

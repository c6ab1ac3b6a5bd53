"""Third-party attention, found and measured with no user code, against float64 references.

For every model of the zoo (``models.py``), one monitored step (no optimizer step) must give:

1. κ per head equal to ``σ₁/Σσ`` of ``W_Q^h (W_K^{g(h)})ᵀ`` built here, in float64, from the
   model's weights by this file's reading of the library's layout;
2. entropy_norm and max_prob per head equal to those of float64 probabilities computed from the
   model's *own* queries, keys and masks in the same forward: an unmonitored deepcopy runs the
   batch under a test-local ``TorchFunctionMode`` that records every
   ``F.scaled_dot_product_attention`` (q, k, v, mask, causal flag, scale), every 4-D softmax over
   the last dim (its logits: scale, masks, position biases and ALiBi already in) and every
   ``F.multi_head_attention_forward`` made inside an attention module; each reference is checked
   against the model's own output there (``P @ V`` = SDPA's output, ``P`` = the softmax's output);
3. a loss bit-for-bit equal to the unmonitored twin's on the same batch.

And a step that raises inside an attention module leaves nothing on the model.
"""

from __future__ import annotations

import copy
import inspect
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import qkmonitor
from qkmonitor.engine import AttentionEntropy, Monitoring, QKSpectrum
from qkmonitor.output.sinks import MemorySink

from .models import ZOO, Built

# --------------------------------------------------------------------------------------- references

#: docs/metrics.md, "Masked keys": an additive mask entry at or below it blocks its key
MASK_FLOOR = -80.0


def kappa_reference(wq: torch.Tensor, wk: torch.Tensor) -> torch.Tensor:
    """(H, d, d_k) float64 per-head W_Q, W_K -> κ per head, from the dense d×d product's SVD."""
    sigma = torch.linalg.svdvals(wq @ wk.transpose(-1, -2))
    return sigma[:, 0] / sigma.sum(-1)


def spectral_norm_reference(wq: torch.Tensor, wk: torch.Tensor, scale: float) -> torch.Tensor:
    """(H, d, d_k) float64 per-head W_Q, W_K and the model's true logit scale -> σ₁ · scale per
    head (docs/metrics.md, qk_spectral_norm), σ₁ from the dense d×d product's SVD."""
    return torch.linalg.svdvals(wq @ wk.transpose(-1, -2))[:, 0] * scale


#: the factor each entry's modules put between their projections' q·kᵀ and the logits of the
#: softmax, read from the libraries' sources (models.py's notes), where it is not 1/sqrt(d_k):
#: (model, layer name, d_k) -> scale. timm: ``head_dim ** -0.5``, on q before the product where
#: ``fused_attn=False``; CaiT's talking heads: the factor on each head's own q·kᵀ before
#: ``proj_l`` mixes the heads (q pre-scaled); T5: none (1); Gemma-2:
#: ``query_pre_attn_scalar ** -0.5`` (its soft-cap comes after).
TRUE_SCALE = {
    "hf-t5-eager": lambda model, name, d_k: 1.0,
    "hf-t5-sdpa": lambda model, name, d_k: 1.0,
    "hf-gemma2-eager": lambda model, name, d_k: model.config.query_pre_attn_scalar**-0.5,
}


def true_scale(name: str, model, layer: str, d_k: int) -> float:
    scale = TRUE_SCALE.get(name)
    return d_k**-0.5 if scale is None else float(scale(model, layer, d_k))


def probabilities(s: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Row softmax of float64 logits over the allowed keys (exact zeros elsewhere)."""
    s = s.masked_fill(~allowed, -math.inf)
    peak = s.amax(-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isfinite(peak), peak, 0.0))
    z = e.sum(-1, keepdim=True)
    return torch.where(z > 0, e / torch.where(z > 0, z, 1.0), 0.0)


def head_statistics(p: torch.Tensor, allowed: torch.Tensor) -> dict[str, torch.Tensor]:
    """(B, H, N, M) probabilities -> per head: entropy_norm (mean over rows with n_i > 1, and the
    batch) and max_prob (mean over rows with n_i ≥ 1)."""
    n = allowed.sum(-1).double()  # (B, H, N) attended keys
    plogp = torch.where(p > 0, p * torch.log(torch.where(p > 0, p, 1.0)), 0.0)
    entropy = -plogp.sum(-1)
    multi, some = n > 1, n >= 1
    entropy_norm = torch.where(multi, entropy / torch.log(n.clamp_min(2)), 0.0).sum(
        (0, 2)
    ) / multi.sum((0, 2))
    max_prob = torch.where(some, p.amax(-1), 0.0).sum((0, 2)) / some.sum((0, 2))
    return {"entropy_norm": entropy_norm, "max_prob": max_prob}


def expand_keys(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, H_kv, M, D) -> (B, H, M, D): query head h reads key head h // (H / H_kv) (SDPA's
    ``enable_gqa``; with one key head, broadcasting)."""
    return x if x.shape[-3] == heads else x.repeat_interleave(heads // x.shape[-3], dim=-3)


_SDPA = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_MHA = inspect.signature(F.multi_head_attention_forward)


def sdpa_reference(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """torch's SDPA by its definition in float64: (P, allowed, P @ V)."""
    assert dropout_p == 0.0, "dropout must be off"
    q, k, v = query.double(), key.double(), value.double()
    k, v = expand_keys(k, q.shape[-3]), expand_keys(v, q.shape[-3])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * (q @ k.transpose(-1, -2))
    allowed = torch.ones_like(s, dtype=torch.bool)
    if is_causal:  # SDPA's is_causal: top-left aligned
        allowed = allowed & torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            # additive: an entry at or below the floor of docs/metrics.md marks a masked key
            # (-inf, finfo.min, -finfo.max // 2, -1e4, timm Swin's -100)
            bias = attn_mask.double()
            allowed = allowed & (bias > MASK_FLOOR)
            s = s + torch.where(allowed, bias, 0.0)
    p = probabilities(s, allowed)
    return p, allowed, p @ v


def softmax_reference(logits: torch.Tensor, keys=None):
    """The model's own logits (scale, masks, biases in): a key is masked when its logit is -inf or
    a fill value (-1e4 ... -finfo.max) far below the row's best, where float64 exp is exactly 0,
    or where ``keys(logits)`` (the module's own mask, where it adds one itself) says so."""
    s = logits.double()
    peak = s.amax(-1, keepdim=True)
    allowed = torch.isfinite(s) & (s > peak - 1e3)
    if keys is not None:
        allowed = allowed & keys(logits)
    return probabilities(s, allowed), allowed


def mha_reference(arguments: dict):
    """``F.multi_head_attention_forward`` (packed in-projection) in float64: (P, allowed,
    output)."""
    a = arguments
    assert not a["use_separate_proj_weight"] and a["bias_k"] is None and not a["add_zero_attn"]
    assert a["dropout_p"] == 0.0 or not a["training"]
    e, h = a["embed_dim_to_check"], a["num_heads"]
    w, b = a["in_proj_weight"].double(), a["in_proj_bias"].double()
    length, batch, _ = a["query"].shape

    def project(x, i):
        y = x.double() @ w[i * e : (i + 1) * e].T + b[i * e : (i + 1) * e]
        return y.reshape(y.shape[0], batch, h, e // h).permute(1, 2, 0, 3)  # (B, H, L, d_k)

    q, k, v = project(a["query"], 0), project(a["key"], 1), project(a["value"], 2)
    s = q @ k.transpose(-1, -2) / math.sqrt(e // h)
    allowed = torch.ones_like(s, dtype=torch.bool)
    for mask, shape in ((a["key_padding_mask"], (batch, 1, 1, -1)), (a["attn_mask"], None)):
        if mask is None:
            continue
        mask = (
            mask.reshape(shape)
            if shape
            else (mask.reshape(batch, h, *mask.shape[-2:]) if mask.dim() == 3 else mask)
        )
        if mask.dtype == torch.bool:  # True: may NOT attend (torch's convention)
            allowed = allowed & ~mask
        else:
            bias = mask.double()
            ok = bias > MASK_FLOOR
            allowed, s = allowed & ok, s + torch.where(ok, bias, 0.0)
    p = probabilities(s, allowed)
    heads_out = (p @ v).permute(2, 0, 1, 3).reshape(length, batch, e)
    out = heads_out @ a["out_proj_weight"].double().T + a["out_proj_bias"].double()
    return p, allowed, out


class Capture(TorchFunctionMode):
    """Records the attention each named module computes, while the model runs under it.

    Test-local forward hooks (removed by :meth:`close`) say which attention module is running;
    calls outside one are ignored. ``kernel_patches`` names functions (e.g. the bundled model's
    ``attention`` kernel) to record by their arguments instead.
    """

    def __init__(self, model, names, kernel_patches=(), monkeypatch=None):
        super().__init__()
        self.records = {name: [] for name in names}
        self.stack: list[str] = []
        self.paused = False
        self.handles = []
        for name in names:
            module = model.get_submodule(name)
            self.handles.append(module.register_forward_pre_hook(self._enter(name)))
            self.handles.append(module.register_forward_hook(self._leave, always_call=True))
        for owner, attr in kernel_patches:
            monkeypatch.setattr(owner, attr, self._kernel(getattr(owner, attr)))

    def _enter(self, name):
        def hook(module, args):
            self.stack.append(name)

        return hook

    def _leave(self, module, args, output):
        self.stack.pop()

    def close(self):
        for handle in self.handles:
            handle.remove()

    def _kernel(self, fn):
        def recorded(q, k, v, *, causal=False, key_padding_mask=None, scale=None, **kwargs):
            self.paused = True
            try:
                out = fn(
                    q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, **kwargs
                )
            finally:
                self.paused = False
            if self.stack:
                n, m = q.shape[-2], k.shape[-2]
                mask = (
                    torch.ones(n, m, dtype=torch.bool).tril(m - n) if causal else None
                )  # bottom-right
                if key_padding_mask is not None:
                    keep = key_padding_mask.bool()[:, None, None, :]
                    mask = keep if mask is None else mask & keep
                self._add(
                    "sdpa",
                    {"query": q, "key": k, "value": v, "attn_mask": mask, "scale": scale},
                    out,
                )
            return out

        return recorded

    def _add(self, kind, arguments, out):
        detach = lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x
        out = out[0] if isinstance(out, tuple) else out
        self.records[self.stack[-1]].append(
            (kind, {k: detach(v) for k, v in arguments.items()}, detach(out))
        )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.stack or self.paused:
            return out
        name = getattr(func, "__name__", "")
        if name == "scaled_dot_product_attention":
            arguments = dict(zip(_SDPA, args))
            arguments.update(kwargs)
            self._add("sdpa", arguments, out)
        elif name == "softmax":
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if args[0].dim() >= 4 and dim in (-1, args[0].dim() - 1):
                self._add("softmax", {"logits": args[0]}, out)
        elif name == "multi_head_attention_forward":
            bound = _MHA.bind(*args, **kwargs)
            bound.apply_defaults()
            self._add("mha", dict(bound.arguments), out)
        return out


def reference_statistics(
    records, keys=None, heads_at: int = -3
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Per-head statistics of a module's recorded calls (rows pooled; leading dims other than
    the heads, as windows or NesT's blocks, are sequences), and the self-checks' failures.
    ``keys``: the module's own mask, for the logits of a softmax (:func:`softmax_reference`);
    ``heads_at``: the dim of the calls that holds the heads (from the end)."""
    ps, alloweds, problems = [], [], []
    for kind, arguments, out in records:
        if kind == "sdpa":
            p, allowed, ref = sdpa_reference(**arguments)
        elif kind == "softmax":
            p, allowed = softmax_reference(arguments["logits"], keys)
            ref = p  # the model's own softmax output
        else:
            p, allowed, ref = mha_reference(arguments)
        try:  # the reference reproduces what the model computed from the same inputs
            torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
        except AssertionError as error:
            problems.append(f"{kind}: {error}")
        allowed = allowed.expand_as(p).movedim(heads_at, -3)
        p = p.movedim(heads_at, -3)
        ps.append(p.reshape(-1, *p.shape[-3:]))
        alloweds.append(allowed.reshape(-1, *p.shape[-3:]))
    return head_statistics(torch.cat(ps), torch.cat(alloweds)), problems


# ---------------------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: a second torch thread only spins (and under load costs several times the
    run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


#: Entries whose transformers code path differs before 5.0 in ways docs/usage.md names ("Works
#: with"):
#: T5 has no SDPA path, DistilBERT's attention class had another name, ModernBERT's reference
#: here follows 5.x's masks, and GPT-BigCode's eager multi-query path folds the heads into the
#: query sequence (qkmonitor then finds no (B, H, N, M) softmax and says the layer did not run).
NEEDS_TRANSFORMERS_5 = {
    "hf-t5-sdpa",
    "hf-modernbert",
    "hf-distilbert-eager",
    "hf-distilbert-sdpa",
    "hf-gpt-bigcode-mqa-eager",
}


def build(name: str) -> Built:
    for module in ZOO[name].requires:
        pytest.importorskip(module)
    if name in NEEDS_TRANSFORMERS_5:
        import transformers
        from packaging.version import Version

        if Version(transformers.__version__) < Version("5.0"):
            pytest.skip(
                f"{name}: tested from transformers 5.0 (installed: {transformers.__version__})"
            )
    return ZOO[name].build()


def monitored_step(model, built: Built, step: int = 0, said: list[str] | None = None):
    """One monitored step; the warnings it gave are added to ``said``."""
    spectrum, entropy = QKSpectrum(per_head=True), AttentionEntropy(per_head=True)
    monitoring = Monitoring(model, [spectrum, entropy], writer=MemorySink(), every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with monitoring.step(step):
                loss = built.loss(model)
                loss.backward()  # no optimizer step: the κ reference is the initial weights
        finally:
            monitoring.close()
    if said is not None:
        said += [str(w.message) for w in caught]
    return spectrum, entropy, loss.detach()


def assert_refused(said: list[str], layer: str, pattern: str, values: torch.Tensor) -> None:
    """The layer's values are NaN and one warning names it with the pattern's reason."""
    assert torch.isnan(values).all(), f"{layer}: refused, yet measured {values}"
    named = [m for m in said if repr(layer) in m]
    assert any(re.search(pattern, m) for m in named), (
        f"{layer}: no warning names it with {pattern!r}; its warnings: {named}"
    )


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_matches_float64_references(name, monkeypatch, leftovers):
    built = build(name)
    model = built.model
    twin = copy.deepcopy(model)
    expected_qk = built.qk(model)
    assert expected_qk, "the zoo entry found no attention modules of its own"

    said: list[str] = []
    spectrum, entropy, loss = monitored_step(model, built, said=said)
    assert leftovers(model) == []
    # every mask a zoo module adds to its own logits is seen (timm Swin's, Swinv2's, BERT's...):
    # no low logit is left unexplained
    assert not [m for m in said if "no additive mask seen" in m]

    layers = {layer.name: i for i, layer in enumerate(spectrum.layers)}
    assert sorted(layers) == sorted(expected_qk), (
        f"qkmonitor found {list(layers)} ({[type(l.module).__name__ for l in spectrum.layers]}), "
        f"expected {list(expected_qk)}"
    )

    # 1. κ per head, from the weights (or refused by name)
    for layer_name, (wq, wk) in expected_qk.items():
        got = spectrum.latest["kappa"][layers[layer_name]]
        if layer_name in built.kappa_refused:
            assert_refused(said, layer_name, built.kappa_refused[layer_name], got)
            continue
        torch.testing.assert_close(
            got.double(),
            kappa_reference(wq, wk),
            rtol=1e-5 if built.kappa_atol is None else 0.0,
            atol=1e-7 if built.kappa_atol is None else built.kappa_atol,
            msg=lambda m, n=layer_name: f"kappa of {n}: {m}",
        )

    # 1b. qk_spectral_norm = σ₁ · the model's true logit scale, wherever the module applies it
    # (on q before the product, on the product, in SDPA); the layers whose κ is refused are NaN
    for layer_name, (wq, wk) in expected_qk.items():
        got = spectrum.latest["qk_spectral_norm"][layers[layer_name]]
        if layer_name in built.kappa_refused:
            assert torch.isnan(got).all(), f"{layer_name}: layout refused, yet {got}"
            continue
        scale = true_scale(name, model, layer_name, wq.shape[-1])
        torch.testing.assert_close(
            got.double(),
            spectral_norm_reference(wq, wk, scale),
            rtol=1e-5,
            atol=1e-7,
            msg=lambda m, n=layer_name, c=scale: f"qk_spectral_norm of {n} (scale {c:.6g}): {m}",
        )

    # 3. the monitored loss is the unmonitored twin's, bit for bit
    twin_loss = built.loss(twin).detach()
    assert torch.equal(loss, twin_loss), (
        f"monitored loss {loss.item()!r} != unmonitored {twin_loss.item()!r}"
    )

    # 2. statistics from the twin's own q, k and masks, captured in a forward that is bit-identical
    capture = Capture(twin, list(expected_qk), built.kernel_patches, monkeypatch)
    try:
        with capture:
            captured_loss = built.loss(twin).detach()
    finally:
        capture.close()
    monkeypatch.undo()
    assert torch.equal(captured_loss, twin_loss), (
        "the capturing forward is not the same computation"
    )
    for layer_name, records in capture.records.items():
        i = layers[layer_name]
        if layer_name in built.stats_refused:  # (ConViT's GPSA: two softmaxes)
            for metric in ("entropy_norm", "max_prob"):
                assert_refused(
                    said, layer_name, built.stats_refused[layer_name], entropy.latest[metric][i]
                )
            continue
        assert len(records) == 1, (
            f"{layer_name}: {len(records)} attention calls recorded, expected 1"
        )
        reference, problems = reference_statistics(
            records, built.allowed.get(layer_name), built.heads_at
        )
        assert not problems, (
            f"{layer_name}: the float64 reference does not reproduce the model: {problems}"
        )
        assert (
            0.2 < reference["entropy_norm"].mean() < 0.9
        ), (  # a test of something: not near-uniform
            f"{layer_name}: reference entropy_norm {reference['entropy_norm']} (sharpen the zoo "
            "entry)"
        )
        for metric in ("entropy_norm", "max_prob"):
            torch.testing.assert_close(
                entropy.latest[metric][i].double(),
                reference[metric],
                rtol=0,
                atol=built.atol,
                msg=lambda m, n=layer_name, k=metric: f"{k} of {n}: {m}",
            )

    # layer order: that of model.named_modules()
    order = [n for n, _ in model.named_modules() if n in layers]
    assert [layer.name for layer in spectrum.layers] == order
    assert [layer.index for layer in qkmonitor.find_attention_layers(model)] == list(
        range(len(order))
    )


def test_timm_vit_softmax_and_sdpa_give_the_same_qk_spectral_norm():
    """Same weights, q pre-scaled before ``q @ kᵀ`` and a softmax (``fused_attn=False``) or SDPA:
    the same σ₁ · head_dim**-0.5, not σ₁ / head_dim on the softmax path."""
    values = {}
    for name in ("timm-vit-sdpa", "timm-vit-softmax"):
        built = build(name)
        spectrum, _, _ = monitored_step(built.model, built)
        values[name] = torch.stack(spectrum.latest["qk_spectral_norm"]).double()
        wq, wk = built.qk(built.model)["blocks.0.attn"]
        torch.testing.assert_close(
            values[name][0],
            spectral_norm_reference(wq, wk, wq.shape[-1] ** -0.5),
            rtol=1e-5,
            atol=0,
        )
    torch.testing.assert_close(
        values["timm-vit-softmax"], values["timm-vit-sdpa"], rtol=1e-6, atol=0
    )


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("name", list(ZOO))
def test_a_step_that_raises_inside_attention_leaves_nothing(name, where, leftovers, monkeypatch):
    """The second attention module raises inside its forward, before or after its attention
    kernel; after the failed step the model holds no hook, route or probe and no torch function
    mode is left on the stack; the next step measures as usual."""
    built = build(name)
    model = built.model
    names = list(built.qk(model))
    target = names[min(1, len(names) - 1)]
    child = built.fail[where]

    def boom(*args, **kwargs):
        raise Boom(f"raised {where} the kernel of {target}")

    handle = None
    if child is not None:
        module = model.get_submodule(f"{target}.{child}")
        handle = (
            module.register_forward_pre_hook(boom)
            if where == "before"
            else module.register_forward_hook(boom)
        )
    else:  # no child module runs inside (nn.MultiheadAttention): patch the function it calls
        owner, attr = built.fail_patch
        original, calls = getattr(owner, attr), []

        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                if where == "after":
                    original(*args, **kwargs)
                boom()
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, attr, failing)

    configs = [
        (m.__dict__.get("config"), getattr(m.__dict__.get("config"), "_attn_implementation", None))
        for m in model.modules()
    ]
    spectrum, entropy = QKSpectrum(per_head=True), AttentionEntropy(per_head=True)
    monitoring = Monitoring(model, [spectrum, entropy], writer=MemorySink(), every_n_steps=1)
    try:
        with pytest.raises(Boom), monitoring.step(0):
            built.loss(model).backward()
    finally:
        if handle is not None:
            handle.remove()
        monkeypatch.undo()
    assert leftovers(model) == []
    assert torch._C._len_torch_function_stack() == 0
    assert configs == [
        (m.__dict__.get("config"), getattr(m.__dict__.get("config"), "_attn_implementation", None))
        for m in model.modules()
    ], "a Hugging Face config (or its attention implementation) changed"

    with monitoring.step(1):  # a clean step after the failure measures every layer
        built.loss(model).backward()
    monitoring.close()
    assert leftovers(model) == []
    assert torch._C._len_torch_function_stack() == 0
    assert len(entropy.latest["entropy_norm"]) == len(names)
    assert all(
        torch.isfinite(heads).all()
        for layer, heads in zip(entropy.layers, entropy.latest["entropy_norm"])
        if layer.name not in built.stats_refused
    )


@pytest.mark.parametrize("name", ["hf-mistral-sliding", "timm-swin-sdpa", "hf-deepseek-v3"])
def test_a_zoo_model_in_a_lightning_fit_logs_what_one_monitored_step_measures(
    name, tmp_path, leftovers
):
    """The same model through Lightning's callbacks (a TensorBoard-free fit, the weights held
    still by a zero learning rate): κ equals the float64 reference, and the statistics equal
    those of the plain loop's step on the same batch."""
    import lightning.pytorch as pl

    from qkmonitor.callbacks import AttentionEntropyMonitor, QKSpectrumMonitor

    built = build(name)
    twin = copy.deepcopy(built.model)
    _, plain, _ = monitored_step(twin, built)

    class Task(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = built.model

        def training_step(self, batch, batch_idx):
            return built.loss(self.model)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.zeros(2, 1), batch_size=1)

    spectrum = QKSpectrumMonitor(every_n_steps=1, per_head=True)
    entropy = AttentionEntropyMonitor(every_n_steps=1, per_head=True)
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=2,
        logger=False,
        callbacks=[spectrum, entropy],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        accelerator="cpu",
    )
    trainer.fit(Task())
    assert leftovers(built.model) == []
    expected = built.qk(built.model)
    # names under the LightningModule: its `model.` first
    layers = {
        layer.name.removeprefix("model."): i for i, layer in enumerate(spectrum.engine.layers)
    }
    assert sorted(layers) == sorted(expected)
    for layer_name, (wq, wk) in expected.items():
        torch.testing.assert_close(
            spectrum.engine.latest["kappa"][layers[layer_name]].double(),
            kappa_reference(wq, wk),
            rtol=1e-5,
            atol=1e-7,
        )
    for metric in ("entropy_norm", "max_prob"):
        for got, want in zip(entropy.engine.latest[metric], plain.latest[metric]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


#: the families of issue 41: windows folded into the batch (Twins), a mask the module adds itself
#: (Swinv2), heads mixed before the softmax (CaiT), attention over channels (XCiT)
ISSUE_41 = [
    "timm-twins-sdpa",
    "timm-twins-softmax",
    "hf-swinv2",
    "timm-cait",
    "timm-xcit-sdpa",
    "timm-xcit-softmax",
]


@pytest.mark.parametrize("name", ISSUE_41)
def test_qkmonitor_fits_as_a_user_would_and_trains_as_unmonitored(name, tmp_path, leftovers):
    """``QKMonitor(every_n_steps=1, per_head=True)``, no ``layers=``, 4 SGD steps: the fit ends,
    every loss is the unmonitored fit's bit for bit, and each layer's κ and entropy are finite or
    NaN with a warning naming the layer and why (the entry's refusals)."""
    import lightning.pytorch as pl

    from qkmonitor.callbacks import QKMonitor

    class Task(pl.LightningModule):
        def __init__(self, model) -> None:
            super().__init__()
            self.model, self.losses = model, []

        def training_step(self, batch, batch_idx):
            loss = built.loss(self.model)
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.zeros(4, 1), batch_size=1)

    def fit(model, callbacks) -> Task:
        task = Task(model)
        pl.Trainer(
            default_root_dir=tmp_path,
            max_steps=4,
            logger=False,
            callbacks=callbacks,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            accelerator="cpu",
        ).fit(task)
        return task

    built = build(name)
    twin = copy.deepcopy(built.model)
    monitor = QKMonitor(every_n_steps=1, per_head=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitored = fit(built.model, [monitor])
    said = [str(w.message) for w in caught]
    assert leftovers(built.model) == []
    unmonitored = fit(twin, [])
    assert len(monitored.losses) == 4
    for got, want in zip(monitored.losses, unmonitored.losses):
        assert torch.equal(got, want), f"monitored loss {got.item()!r} != {want.item()!r}"

    expected = built.qk(twin)
    spectrum, entropy = monitor.spectrum, monitor.entropy
    names = [layer.name.removeprefix("model.") for layer in spectrum.layers]
    assert sorted(names) == sorted(expected)
    for i, layer in enumerate(names):
        kappa = spectrum.latest["kappa"][i]
        if layer in built.kappa_refused:
            assert_refused(said, f"model.{layer}", built.kappa_refused[layer], kappa)
        else:
            assert torch.isfinite(kappa).all(), f"kappa of {layer}: {kappa}"
        entropy_norm = entropy.latest["entropy_norm"][i]
        if layer in built.stats_refused:
            assert_refused(said, f"model.{layer}", built.stats_refused[layer], entropy_norm)
        else:
            assert torch.isfinite(entropy_norm).all(), f"entropy_norm of {layer}: {entropy_norm}"

r"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2): W_Q and W_K from factored
projections.

MLA projects the keys through a shared low-rank latent. For head h, with ``d_n`` the head's
non-rotary dims, ``d_r`` the rotary ones, ``r`` the key/value latent rank and ``x`` a token's
hidden state (each projection ``(out, in)``, ``nn.Linear`` layout):

- the query ``q^h = [q_C^h ; q_R^h] = W_Q^h x`` (``d_n + d_r`` rows of head h), where ``W_Q`` is
  one projection (``q_proj``) or a factored one, ``W_Q = q_b · diag(g_q) · q_a`` (``q_a_proj``,
  the weight ``g_q`` of ``q_a_layernorm``, ``q_b_proj``);
- the key ``k^h = [k_C^h ; k_R]``: ``kv_a`` (``kv_a_proj_with_mqa``) gives the latent
  ``c = kv_a[:r] x`` and the **shared** rotary key ``k_R = kv_a[r:] x`` (one head, every query
  head reads it); ``k_C^h = kv_b^h · diag(g_kv) · c``, with ``kv_b^h`` the key rows of head h in
  ``kv_b_proj`` (each head's rows are ``[key d_n | value d_v]``) and ``g_kv`` the weight of
  ``kv_a_layernorm``. So ``W_K^h = [kv_b^h · diag(g_kv) · kv_a[:r] ; kv_a[r:]]``.

The model concatenates the parts as ``[non-rotary ; rotary]`` and so does this reading: head h's
``W_QK^h = W_Q^{h⊤} W_K^h`` is the bilinear form of its logits at RoPE position 0, like every
other layer's. The RMS norms also divide each token's latent by its RMS: a positive per-token
factor. On the query side it scales all of ``q^h``, so it scales the token's logits and leaves κ
(scale-invariant) unchanged; on the key side it scales ``k_C^h`` and not ``k_R``, and the form read
here is the one at unit factor, as RoPE's is the one at position 0 (docs/metrics.md).

:class:`LatentLayout` reads a module of this structure by the names the field uses (Hugging Face's
``DeepseekV3Attention``, DeepSeek's own ``wq_a``/``q_norm``/``wq_b``/``wkv_a``/``kv_norm``/
``wkv_b``), or as a :class:`LatentNames` in an ``AttentionSpec(latent=...)`` states it; its
:meth:`LatentLayout.qk_rows` are the rows QK-Clip scales as Kimi K2 does
(:class:`~qkmonitor.attention.clip.LatentQKRows`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from qkmonitor.attention.clip import LatentQKRows, ProjectionRows
from qkmonitor.measures.layer_spectra import QKWeights
from qkmonitor.validation import is_int, is_real

__all__ = ["DEEPSEEK_NAMES", "HF_NAMES", "LatentLayout", "LatentNames", "find_latent"]


@dataclass(frozen=True)
class LatentNames:
    """Where a latent-attention module keeps its projections, and its sizes.

    Attributes:
        kv_down: the key/value down projection, ``(r + d_r, d)``: the latent, then the shared
            rotary key.
        kv_up: the key/value up projection, ``(H·(d_n + d_v), r)``: per head, key rows then value
            rows.
        kv_norm: the norm on the latent (its ``weight`` is ``g_kv``), or None.
        q: a single query projection ``(H·(d_n + d_r), d)``; or None, for a factored one.
        q_down, q_norm, q_up: the factored query projection (``q_up · diag(q_norm.weight) ·
            q_down``); ``q_norm`` may be None. Give both kinds where a module has either (as
            DeepSeek-V3's, by ``q_lora_rank``): the one the module has is read.
        num_heads, rope_dim, latent_dim: an int, or the attribute names that hold it on the module
            or its ``config`` (the first found); the other sizes follow from the shapes.
        scale: the attribute names of the factor on ``q·k``; ``1/sqrt(d_n + d_r)`` if none.
    """

    kv_down: str
    kv_up: str
    kv_norm: str | None
    q: str | None
    q_down: str | None
    q_norm: str | None
    q_up: str | None
    num_heads: int | tuple[str, ...] = ("num_heads", "n_heads", "num_attention_heads")
    rope_dim: int | tuple[str, ...] = ("qk_rope_head_dim",)
    latent_dim: int | tuple[str, ...] = ("kv_lora_rank",)
    scale: tuple[str, ...] = ("scaling", "softmax_scale", "scale")

    def __post_init__(self) -> None:
        for name in ("kv_down", "kv_up"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"Expected `{name}` to be a module path, got {value!r}")
        if self.q is None and (self.q_down is None or self.q_up is None):
            raise ValueError(
                "Expected `q` (one query projection) or `q_down` and `q_up` (a factored one), or "
                f"both, got q={self.q!r}, q_down={self.q_down!r}, q_up={self.q_up!r}"
            )
        for name in ("num_heads", "rope_dim", "latent_dim"):
            value = getattr(self, name)
            if not (is_int(value, 1) or (isinstance(value, tuple) and value)):
                raise ValueError(
                    f"Expected `{name}` to be a positive int or a tuple of attribute names, got "
                    f"{value!r}"
                )

    def with_query(self, module: nn.Module) -> LatentNames | None:
        """These names with the query projection the module has (one or factored), or None."""
        for q, q_down, q_up in ((self.q, None, None), (None, self.q_down, self.q_up)):
            paths = [p for p in (q, q_down, q_up) if p is not None]
            if paths and all(_weight(module, p) is not None for p in paths):
                return replace(self, q=q, q_down=q_down, q_up=q_up)
        return None


#: Hugging Face's ``DeepseekV3Attention`` (and DeepSeek-V2's, Kimi K2's through it).
HF_NAMES = LatentNames(
    kv_down="kv_a_proj_with_mqa",
    kv_up="kv_b_proj",
    kv_norm="kv_a_layernorm",
    q="q_proj",
    q_down="q_a_proj",
    q_norm="q_a_layernorm",
    q_up="q_b_proj",
)
#: DeepSeek's own inference code (``MLA`` in DeepSeek-V3's ``model.py``).
DEEPSEEK_NAMES = LatentNames(
    kv_down="wkv_a",
    kv_up="wkv_b",
    kv_norm="kv_norm",
    q="wq",
    q_down="wq_a",
    q_norm="q_norm",
    q_up="wq_b",
    num_heads=("n_heads", "n_local_heads", "num_heads"),
)


@dataclass(frozen=True)
class LatentLayout:
    """One latent-attention module's reading, every size resolved.

    Attributes:
        names: where the projections are (:class:`LatentNames`, the query one or factored).
        num_heads: H.
        nope_dim, rope_dim, value_dim: d_n, d_r, d_v of a head.
        latent_dim: r, the key/value latent's rank.
        scale: the factor on ``q·k``; None for ``1/sqrt(d_n + d_r)``.
    """

    names: LatentNames
    num_heads: int
    nope_dim: int
    rope_dim: int
    value_dim: int
    latent_dim: int
    scale: float | None = None
    qk_norm: bool = False

    @property
    def head_dim(self) -> int:
        """d_n + d_r: a head's query and key width."""
        return self.nope_dim + self.rope_dim

    @property
    def logit_scale(self) -> float:
        return self.head_dim**-0.5 if self.scale is None else self.scale

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads  # each head has keys of its own (k_C^h; k_R is shared, read per head)

    def sources(self, module: nn.Module) -> list[Tensor]:
        """The weights whose inputs are the layer's hidden states (the down projections)."""
        first = self.names.q if self.names.q is not None else self.names.q_down
        return [_weight(module, first), _weight(module, self.names.kv_down)]

    def query_weight(self, module: nn.Module, dtype: torch.dtype) -> Tensor:
        """``W_Q`` ``(H·(d_n + d_r), d)`` in ``dtype``: the projection, or the factored product."""
        n = self.names
        if n.q is not None:
            return _weight(module, n.q).detach().to(dtype)
        up = _weight(module, n.q_up).detach().to(dtype)
        down = _weight(module, n.q_down).detach().to(dtype)
        return (up * _norm_weight(module, n.q_norm, up)) @ down

    def key_weight(self, module: nn.Module, dtype: torch.dtype) -> Tensor:
        """``W_K`` ``(H·(d_n + d_r), d)`` in ``dtype``: head h's rows are ``[kv_b^h · diag(g_kv) ·
        kv_a[:r] ; kv_a[r:]]``."""
        n, h, r = self.names, self.num_heads, self.latent_dim
        down = _weight(module, n.kv_down).detach().to(dtype)  # (r + d_r, d)
        up = _weight(module, n.kv_up).detach().to(dtype)  # (H (d_n + d_v), r)
        keys = up.view(h, self.nope_dim + self.value_dim, r)[:, : self.nope_dim]  # (H, d_n, r)
        nope = (keys * _norm_weight(module, n.kv_norm, up)) @ down[:r]  # (H, d_n, d)
        rope = down[r : r + self.rope_dim].expand(h, -1, -1)  # (H, d_r, d): shared
        return torch.cat((nope, rope), dim=1).flatten(0, 1)

    def qk_weights(self, module: nn.Module) -> QKWeights:
        dtype = _product_dtype(module, self)
        return QKWeights(
            self.query_weight(module, dtype),
            self.key_weight(module, dtype),
            self.num_heads,
            self.num_heads,
            self.logit_scale,
            qk_norm=self.qk_norm,
        )

    def qk_rows(self, module: nn.Module) -> LatentQKRows:
        """The head-specific rows QK-Clip scales: each head's query rows in ``q`` (or ``q_up``),
        its last ``d_r`` the rotary part, and its key rows in ``kv_up``; the shared rotary key
        (``kv_down``'s last rows) is no head's."""
        n, h = self.names, self.num_heads
        q_path = n.q if n.q is not None else n.q_up
        q_module = _get(module, q_path)
        kv_up = _get(module, n.kv_up)
        q_rows = torch.arange(h * self.head_dim).view(h, self.head_dim)
        k_rows = torch.arange(h * (self.nope_dim + self.value_dim)).view(h, -1)[:, : self.nope_dim]
        return LatentQKRows(
            ProjectionRows(q_module.weight, _bias(q_module), q_rows),
            ProjectionRows(kv_up.weight, _bias(kv_up), k_rows.contiguous()),
            tuple(range(h)),
            self.qk_norm,
            rope_dim=self.rope_dim,
        )

    def describe(self) -> str:
        n = self.names
        query = n.q if n.q is not None else f"{n.q_up}·{n.q_norm or ''}·{n.q_down}"
        return (
            f"latent: query {query}, keys {n.kv_up}·{n.kv_norm or ''}·{n.kv_down}, "
            f"{self.num_heads} heads, d_k {self.nope_dim}+{self.rope_dim} (rotary), latent "
            f"{self.latent_dim}"
        )


def find_latent(module: nn.Module, names: LatentNames | None = None) -> LatentLayout | None:
    """The module's :class:`LatentLayout` under ``names`` (default: Hugging Face's, then DeepSeek's
    own), or None when it has no such projections or their shapes do not fit."""
    for candidate in (HF_NAMES, DEEPSEEK_NAMES) if names is None else (names,):
        layout = _resolve(module, candidate)
        if layout is not None:
            return layout
    return None


def _resolve(module: nn.Module, names: LatentNames) -> LatentLayout | None:
    kv_down, kv_up = _weight(module, names.kv_down), _weight(module, names.kv_up)
    names = names.with_query(module) if kv_down is not None and kv_up is not None else None
    if names is None:
        return None
    heads = _size(module, names.num_heads)
    latent = _size(module, names.latent_dim)
    if latent is None:  # the latent's width: kv_up reads it
        latent = kv_up.shape[1]
    rope = _size(module, names.rope_dim) or kv_down.shape[0] - latent
    q_out = _weight(module, names.q if names.q is not None else names.q_up).shape[0]
    if heads is None or rope < 1 or kv_down.shape[0] != latent + rope or kv_up.shape[1] != latent:
        return None
    if q_out % heads or kv_up.shape[0] % heads or q_out // heads <= rope:
        return None
    nope = q_out // heads - rope
    value = kv_up.shape[0] // heads - nope
    if value < 1:
        return None
    scale = next(
        (float(v) for v in (getattr(module, a, None) for a in names.scale) if is_real(v) and v > 0),
        None,
    )
    return LatentLayout(names, heads, nope, rope, value, latent, scale)


def _get(module: nn.Module, path: str | None):
    obj = module
    for part in (path or "").split("."):
        obj = getattr(obj, part, None) if part else None
        if obj is None:
            return None
    return obj


def _weight(module: nn.Module, path: str | None) -> Tensor | None:
    weight = getattr(_get(module, path), "weight", None)
    return weight if isinstance(weight, Tensor) and weight.dim() == 2 else None


def _bias(projection: nn.Module) -> Tensor | None:
    bias = getattr(projection, "bias", None)
    return bias if isinstance(bias, Tensor) else None


def _norm_weight(module: nn.Module, path: str | None, like: Tensor) -> Tensor:
    """The norm's per-channel weight ``g`` (ones without a norm, or a norm without a weight)."""
    weight = getattr(_get(module, path), "weight", None)
    if not isinstance(weight, Tensor):
        return torch.ones((), dtype=like.dtype, device=like.device)
    return weight.detach().to(like.dtype)


def _size(module: nn.Module, value: int | tuple[str, ...]) -> int | None:
    if is_int(value, 1):
        return value
    for owner in (module, getattr(module, "config", None)):
        for name in value:
            found = getattr(owner, name, None)
            if is_int(found, 1):
                return found
    return None


def _product_dtype(module: nn.Module, layout: LatentLayout) -> torch.dtype:
    """float64 where any weight is, else float32 (the spectral functions' rule)."""
    weights = [_weight(module, p) for p in (layout.names.q, layout.names.q_up, layout.names.kv_up)]
    return (
        torch.float64
        if any(w is not None and w.dtype == torch.float64 for w in weights)
        else torch.float32
    )

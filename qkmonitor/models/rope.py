"""Rotary position embedding (RoPE) for one sequence axis, with context scaling.

:class:`RotaryEmbedding` rotates each head's queries and keys (B, H, N, D) so that a score
``<R_s q, R_t k> = <q, R_{t-s} k>`` depends on the offset ``t - s`` only; :class:`RopeScaling`
stretches it to longer contexts. Axial RoPE over a grid is :mod:`qkmonitor.models.axial_rope`.

References:
    - Su et al. 2021, "RoFormer" (arXiv 2104.09864): rotary position embedding.
    - Chen et al. 2023, "Extending Context Window ... via Positional Interpolation" (linear).
    - bloc97 2023, "NTK-aware scaled RoPE" (base' = base · s^{d/(d-2)}).
    - Peng et al. 2023, "YaRN" (arXiv 2309.00071): ramp-blended interpolation + temperature.

Every table is built in float64 and stored as float32; rotations run in the input's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkmonitor.validation import check_positive_int, check_real

__all__ = [
    "RopeScaling",
    "RotaryEmbedding",
    "apply_rotary_pos_emb",
    "rope_attention_factor",
    "rope_inv_freq",
]


ROPE_SCALING_KINDS = ("linear", "ntk", "yarn")


def _check_even_head_dim(head_dim: object) -> None:
    check_positive_int("head_dim", head_dim)
    if head_dim % 2:
        raise ValueError(
            f"Expected `head_dim` to be even (RoPE rotates pairs of dims), got {head_dim}"
        )


@dataclass(frozen=True)
class RopeScaling:
    """How to stretch RoPE to contexts ``factor`` times longer than it was trained on.

    Attributes:
        kind: ``"linear"`` (position interpolation: every frequency divided by s), ``"ntk"``
            (NTK-aware: a larger base, ``base · s^{d/(d-2)}``), or ``"yarn"`` (per-dimension
            blend of the two regimes plus an attention temperature; Peng et al. 2023).
        factor: s > 1, the context extension ratio.
        original_max_len: L, the training context length; required for ``"yarn"`` (its ramp counts
            how many turns each frequency makes within L), ignored otherwise.
        beta_fast: YaRN ramp bound: dims that turn at least this many times in L keep their
            frequency (paper: β = 32).
        beta_slow: YaRN ramp bound: dims that turn at most this many times in L are fully
            interpolated (paper: α = 1).

    Raises:
        ValueError: naming the field, for an unknown kind, ``factor <= 1``, a missing or
            non-positive ``original_max_len`` for YaRN, or ``beta_fast <= beta_slow`` / non-positive
            betas.
    """

    kind: str
    factor: float
    original_max_len: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALING_KINDS:
            raise ValueError(
                f"Expected `kind` to be one of {ROPE_SCALING_KINDS}, got {self.kind!r}"
            )
        check_real("factor", self.factor, above=1)
        if self.original_max_len is not None or self.kind == "yarn":
            check_positive_int("original_max_len", self.original_max_len)
        for name in ("beta_fast", "beta_slow"):
            check_real(name, getattr(self, name), above=0)
        if self.beta_fast <= self.beta_slow:
            raise ValueError(
                f"Expected `beta_fast` > `beta_slow`, got beta_fast={self.beta_fast}, "
                f"beta_slow={self.beta_slow}"
            )


def rope_inv_freq(
    head_dim: int, base: float = 10_000.0, scaling: RopeScaling | None = None
) -> Tensor:
    r"""RoPE's per-pair angular frequencies θ_i (radians per position), in float64.

    Unscaled: :math:`θ_i = base^{-2i/d}`, ``i = 0 .. d/2 - 1`` (d = ``head_dim``). With ``scaling``
    of factor s:

    - ``linear``: :math:`θ_i / s` — the same as dividing positions by s.
    - ``ntk``: :math:`base'^{-2i/d}` with :math:`base' = base · s^{d/(d-2)}`. The highest frequency
      (i = 0) is unchanged and the lowest, :math:`θ_{d/2-1}`, becomes exactly :math:`θ_{d/2-1}/s`:
      the longest wavelength is interpolated, the short ones are (almost) kept.
    - ``yarn``: with :math:`r_i = L θ_i / 2π` the number of turns dim i makes over the training
      length L and the ramp
      :math:`γ_i = \mathrm{clip}((r_i - β_{slow}) / (β_{fast} - β_{slow}), 0, 1)`,

      .. math:: θ'_i = (1 - γ_i)\, θ_i / s + γ_i\, θ_i

      so dims turning ≥ β_fast times keep θ_i, dims turning ≤ β_slow times are interpolated to
      θ_i / s, and the ramp is linear in r_i between (the paper's continuous form; some libraries
      round the ramp's bounds to whole dimension indices, which differs slightly).

    Args:
        head_dim: d, even; ``ntk`` needs d ≥ 4.
        base: the RoPE base (> 1).
        scaling: optional :class:`RopeScaling`.

    Returns:
        Tensor of shape ``(head_dim // 2,)``, float64, decreasing in i.

    Raises:
        ValueError: for an odd or non-positive ``head_dim``, ``base <= 1``, ``ntk`` with
            ``head_dim == 2``, or a ``scaling`` that is not a :class:`RopeScaling`.
    """
    _check_even_head_dim(head_dim)
    check_real("base", base, above=1)
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim  # 2i/d
    if scaling is None:
        return float(base) ** -exponent
    if not isinstance(scaling, RopeScaling):  # ValueError like every other bad argument here
        raise ValueError(
            f"Expected `scaling` to be a RopeScaling or None, got {type(scaling).__name__}"
        )
    s = float(scaling.factor)
    theta = float(base) ** -exponent
    if scaling.kind == "linear":
        return theta / s
    if scaling.kind == "ntk":
        if head_dim < 4:
            raise ValueError(
                f"NTK-aware scaling needs `head_dim` >= 4 (exponent d/(d-2)), got {head_dim}"
            )
        return (float(base) * s ** (head_dim / (head_dim - 2))) ** -exponent
    turns = scaling.original_max_len * theta / (2 * math.pi)  # r_i  (yarn)
    ramp = ((turns - scaling.beta_slow) / (scaling.beta_fast - scaling.beta_slow)).clamp(
        0.0, 1.0
    )  # γ_i
    return (1.0 - ramp) * theta / s + ramp * theta


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    r"""The multiplier on the attention **logits** that a RoPE scaling asks for.

    YaRN (Peng et al. 2023, eq. for the temperature t) uses
    :math:`\mathrm{softmax}(q^\top k / (t \sqrt{d}))` with :math:`\sqrt{1/t} = 0.1 \ln s + 1`. This
    function returns the logit multiplier

    .. math:: m = 1/t = (0.1 \ln s + 1)^2,

    to be applied *on top of* the usual ``1/sqrt(d)`` (e.g. ``scale = m / sqrt(d)``). Equivalently
    multiply q and k each by ``sqrt(m) = 0.1 ln s + 1`` — the "mscale" some libraries fold into
    their cos/sin tables; do one or the other, not both. ``1.0`` for ``None``, linear and NTK.

    Args:
        scaling: the RoPE scaling, or None.

    Returns:
        The logit multiplier m ≥ 1.
    """
    if scaling is None or scaling.kind != "yarn":
        return 1.0
    return (0.1 * math.log(scaling.factor) + 1.0) ** 2


def apply_rotary_pos_emb(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """Rotate pairs of dims of ``x`` by per-position angles φ (given as ``cos φ``, ``sin φ``).

    Each pair ``(a, b)`` becomes ``(a cos φ − b sin φ, a sin φ + b cos φ)``. Pair i is
    ``(x_i, x_{i + D/2})`` in the half-split layout (GPT-NeoX / LLaMA in Hugging Face) and
    ``(x_{2i}, x_{2i+1})`` in the interleaved layout (RoFormer, GPT-J, Meta's LLaMA).

    Args:
        x: (..., N, D) with D even.
        cos: (N, D/2), or anything broadcastable to (..., N, D/2), e.g. (B, 1, N, D/2).
        sin: same shape as ``cos``.
        interleaved: pair layout, see above.

    Returns:
        Tensor of the shape and dtype of ``x`` (computed in ``x.dtype``).

    Raises:
        ValueError: if D is odd or ``cos``/``sin`` do not have D/2 in their last dim or differ in
            shape.
    """
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"Expected the last dim of `x` to be even, got shape {tuple(x.shape)}")
    if cos.shape != sin.shape or cos.shape[-1] != d // 2:
        raise ValueError(
            f"Expected `cos` and `sin` of equal shape (..., N, {d // 2}), "
            f"got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if interleaved:
        pairs = x.unflatten(-1, (d // 2, 2))  # (..., N, D/2, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


def cos_sin_tables(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """float64 angles ``t · θ_i`` → float32 (cos, sin) of shape (T, len(inv_freq))."""
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


class RotaryEmbedding(nn.Module):
    """Rotary position embedding for one head dim, with optional context scaling.

    Holds ``cos``/``sin`` tables (max_seq_len, D/2) as non-persistent float32 buffers (built in
    float64 from :func:`rope_inv_freq`). ``forward(q, k)`` rotates queries and keys by their
    positions; the scores ``<R_s q, R_t k>`` then depend on ``t − s`` only.

    Positions: keys of length M take ``0 .. M−1``. Queries of length N take ``M−N .. M−1``
    (right-aligned), which is ``0 .. N−1`` when N == M and, when decoding with a key/value cache
    of M keys, places the N new queries at the end. Pass ``positions`` to override (then N == M).

    Attributes:
        attention_factor: the logit multiplier of the scaling (:func:`rope_attention_factor`);
            1.0 except for YaRN. The caller multiplies the softmax scale by it.
        inv_freq: the (D/2,) float64 frequencies (plain attribute, not a buffer).

    Args:
        head_dim: D, even.
        max_seq_len: the largest position served plus one.
        base: the RoPE base (> 1).
        interleaved: pair layout (see :func:`apply_rotary_pos_emb`).
        scaling: optional :class:`RopeScaling`.

    Raises:
        ValueError: for an odd ``head_dim`` or other bad arguments.

    Example::

        >>> rope = RotaryEmbedding(head_dim=8, max_seq_len=32)
        >>> q, k = rope(torch.randn(2, 4, 10, 8), torch.randn(2, 2, 10, 8))
        >>> q.shape, k.shape
        (torch.Size([2, 4, 10, 8]), torch.Size([2, 2, 10, 8]))
    """

    def __init__(
        self,
        head_dim: int,
        max_seq_len: int,
        base: float = 10_000.0,
        interleaved: bool = False,
        scaling: RopeScaling | None = None,
    ) -> None:
        super().__init__()
        check_positive_int("max_seq_len", max_seq_len)
        self.head_dim, self.max_seq_len, self.base = head_dim, max_seq_len, base
        self.interleaved, self.scaling = bool(interleaved), scaling
        self.inv_freq = rope_inv_freq(head_dim, base, scaling)  # (D/2,) float64
        self.attention_factor = rope_attention_factor(scaling)
        cos, sin = cos_sin_tables(torch.arange(max_seq_len), self.inv_freq)  # (L, D/2)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(
        self, q: Tensor, k: Tensor, positions: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Rotate ``q`` (B, H, N, D) and ``k`` (B, H_kv, M, D) by their positions.

        Args:
            q: queries (..., N, D).
            k: keys (..., M, D).
            positions: optional integer positions shared by q and k (requires N == M): shape (N,),
                or (B, N) for per-sequence positions (packed batches). Values must lie in
                ``[0, max_seq_len)``; checking them reads the tensor on the host.

        Returns:
            ``(q_rotated, k_rotated)`` in the inputs' shapes and dtypes.

        Raises:
            ValueError: for a head dim other than D, a length beyond ``max_seq_len``, N > M without
                ``positions``, or malformed ``positions``.
        """
        for name, t in (("q", q), ("k", k)):
            if t.dim() < 2 or t.shape[-1] != self.head_dim:
                raise ValueError(
                    f"Expected `{name}` of shape (..., N, {self.head_dim}), got {tuple(t.shape)}"
                )
        n, m = q.shape[-2], k.shape[-2]
        if positions is None:
            if m > self.max_seq_len:
                raise ValueError(f"Sequence length {m} exceeds `max_seq_len` {self.max_seq_len}")
            if n > m:
                raise ValueError(
                    f"Query length {n} exceeds key length {m}: right-aligned query positions "
                    f"would be negative"
                )
            cos_k, sin_k = self.cos[:m], self.sin[:m]  # (M, D/2)
            cos_q, sin_q = cos_k[m - n :], sin_k[m - n :]  # right-aligned: positions M-N .. M-1
        else:
            pos = self._check_positions(positions, n, m)
            cos_q = cos_k = self.cos[pos]  # (N, D/2) or (B, N, D/2)
            sin_q = sin_k = self.sin[pos]
            if pos.dim() == 2:  # (B, N, D/2) -> (B, 1, N, D/2): broadcast over heads
                cos_q = cos_k = cos_q.unsqueeze(-3)
                sin_q = sin_k = sin_q.unsqueeze(-3)
        return (
            apply_rotary_pos_emb(q, cos_q, sin_q, self.interleaved),
            apply_rotary_pos_emb(k, cos_k, sin_k, self.interleaved),
        )

    def _check_positions(self, positions: Tensor, n: int, m: int) -> Tensor:
        if (
            not isinstance(positions, Tensor)
            or positions.is_floating_point()
            or positions.is_complex()
        ):
            raise ValueError("Expected `positions` to be an integer tensor of shape (N,) or (B, N)")
        if (
            positions.dtype == torch.bool
            or positions.dim() not in (1, 2)
            or positions.shape[-1] != n
        ):
            raise ValueError(
                f"Expected `positions` of shape ({n},) or (B, {n}), got {tuple(positions.shape)}"
            )
        if n != m:
            raise ValueError(
                f"`positions` is shared by q and k, so their lengths must match, got N={n}, M={m}"
            )
        if positions.numel() and (positions.min() < 0 or positions.max() >= self.max_seq_len):
            raise ValueError(
                f"Expected `positions` in [0, {self.max_seq_len}) (`max_seq_len`), got "
                f"[{int(positions.min())}, {int(positions.max())}]"
            )
        return positions.to(device=self.cos.device, dtype=torch.long)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, max_seq_len={self.max_seq_len}, base={self.base}, "
            f"interleaved={self.interleaved}, scaling={self.scaling}"
        )

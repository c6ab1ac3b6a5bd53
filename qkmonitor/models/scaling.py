r"""Attention-scale policies: the factor that multiplies ``q·k`` before the softmax.

A policy maps the number of keys ``n`` a query row attends to the logit multiplier ``λ(n)``, so
that row i computes ``softmax_j(λ(n_i) · q_i·k_j)``:

- ``standard`` (:class:`StandardScale`): :math:`λ = 1/\sqrt{d_k}`;
- ``log_n`` (:class:`CriticalAttentionScaling`): :math:`λ = \max(1, \log n / \log L) / \sqrt{d_k}`,
  at least the standard value — sharper attention for long contexts;
- ``polylog`` (:class:`PolylogScale`): :math:`λ = 1/\sqrt{d_k (1 + c (\log n)^p)}`, at most the
  standard value — flatter attention for long contexts.

With a fixed multiplier, the softmax over n roughly exchangeable logits flattens as n grows (its
entropy climbs like ``log n``), which is the long-context "attention fading" / rank-collapse
pathology. Chen, Lin, Polyanskiy & Rigollet (arXiv 2510.05554) show that multiplying the logits by
:math:`β_n ≍ \log n` is the critical scaling that keeps attention sparse and content-adaptive — the
form YaRN, Qwen (log-n attention) and SSMax use. ``log_n`` follows it; ``polylog`` is the source
document's divisor and goes the opposite way (kept for comparison only).

Because the multiplier depends on each row's key count, a caller folds it into the queries:
``q_i ← λ(n_i) q_i`` and runs the kernel with ``scale=1``. Policies with ``constant = True`` may
instead pass ``λ`` as the kernel's scalar ``scale``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from qkmonitor.measures.probabilities import masked_softmax
from qkmonitor.validation import check_int_at_least, check_real

__all__ = [
    "ATTENTION_SCALE_POLICIES",
    "AttentionScale",
    "CriticalAttentionScaling",
    "PolylogScale",
    "StandardScale",
    "make_attention_scale",
    "stable_softmax",
]


class AttentionScale(ABC):
    """A logit multiplier ``λ(n)`` as a function of the number of attended keys ``n``.

    Attributes:
        constant: True when ``λ`` does not depend on ``n``.
    """

    constant: ClassVar[bool] = False

    def __call__(self, num_keys: Tensor | float) -> Tensor:
        """The factor multiplying ``q·k`` for rows that attend ``num_keys`` keys.

        Args:
            num_keys: key counts, any shape; counts below 1 (fully masked rows) are treated as 1.

        Returns:
            Tensor of the shape of ``num_keys``: float64 if ``num_keys`` is float64, else float32.
            Computed in float64.
        """
        n = torch.as_tensor(num_keys)
        out_dtype = torch.float64 if n.dtype == torch.float64 else torch.float32
        return self._factor(n.to(torch.float64).clamp_min(1.0)).to(out_dtype)

    @abstractmethod
    def _factor(self, n: Tensor) -> Tensor:
        """λ(n) for float64 ``n >= 1``."""

    @abstractmethod
    def describe(self) -> str:
        """A one-line formula with the parameters filled in (for logs and reports)."""


@dataclass(frozen=True)
class StandardScale(AttentionScale):
    r"""The usual constant :math:`λ = 1/\sqrt{d_k}` (Vaswani et al.).

    Args:
        head_dim: d_k.

    Raises:
        ValueError: if ``head_dim`` is not a positive int.

    Example::

        >>> StandardScale(64)(torch.tensor([1.0, 1000.0]))
        tensor([0.1250, 0.1250])
    """

    head_dim: int
    constant: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_int_at_least("head_dim", self.head_dim, 1)

    def _factor(self, n: Tensor) -> Tensor:
        return torch.full_like(n, 1.0 / math.sqrt(self.head_dim))

    def describe(self) -> str:
        return f"standard: 1/sqrt(d_k), d_k={self.head_dim}"


@dataclass(frozen=True)
class CriticalAttentionScaling(AttentionScale):
    r"""Critical log-n scaling (Chen, Lin, Polyanskiy & Rigollet, arXiv 2510.05554), Qwen form.

    .. math:: λ(n) = \frac{1}{\sqrt{d_k}} \max\Bigl(1, \frac{\log n}{\log L}\Bigr)

    with L = ``train_len``. Up to the training length it is the standard scale; beyond, it
    **multiplies** the logits by :math:`\log_L n`, which grows like :math:`\log n` — the critical
    rate :math:`β_n ≍ \log n` of the paper, the one YaRN, Qwen's log-n attention and SSMax use.
    Direction: sharper attention than standard as n grows, i.e. *lower* entropy, counteracting
    the ~log n entropy growth of a softmax over ever more keys.

    Args:
        head_dim: d_k.
        train_len: L ≥ 2, the context length the model was trained on.

    Raises:
        ValueError: if ``head_dim`` is not a positive int or ``train_len`` is not an int ≥ 2.

    Example::

        >>> s = CriticalAttentionScaling(head_dim=64, train_len=16)
        >>> s(torch.tensor([4.0, 16.0, 256.0]))  # 256 = 16², so twice the standard 1/8
        tensor([0.1250, 0.1250, 0.2500])
    """

    head_dim: int
    train_len: int

    def __post_init__(self) -> None:
        check_int_at_least("head_dim", self.head_dim, 1)
        check_int_at_least("train_len", self.train_len, 2)

    def _factor(self, n: Tensor) -> Tensor:
        stretch = (n.log() / math.log(self.train_len)).clamp_min(1.0)
        return stretch / math.sqrt(self.head_dim)

    def describe(self) -> str:
        return f"log_n: max(1, log n / log {self.train_len}) / sqrt(d_k), d_k={self.head_dim}"


@dataclass(frozen=True)
class PolylogScale(AttentionScale):
    r"""The source document's polylog divisor, kept for comparison.

    .. math:: λ(T) = \frac{1}{\sqrt{d_k\, f(T)}}, \qquad f(T) = 1 + c\,(\log T)^p

    with T = ``num_keys``. It **divides** the logits by a factor growing with T, so attention gets
    *flatter* (higher entropy) as the context grows — the opposite direction of the critical
    scaling (:class:`CriticalAttentionScaling`), which sharpens it. Equal to the standard scale at
    T = 1 (or c = 0).

    Args:
        head_dim: d_k.
        c: coefficient c ≥ 0.
        p: power p > 0 (the document also suggests 1.5).

    Raises:
        ValueError: if ``head_dim`` is not a positive int, ``c < 0`` or ``p <= 0``.

    Example::

        >>> PolylogScale(head_dim=4, c=3.0)(torch.tensor([1.0, math.e]))  # f = 1, then 4
        tensor([0.5000, 0.2500])
    """

    head_dim: int
    c: float = 1.0
    p: float = 1.0

    def __post_init__(self) -> None:
        check_int_at_least("head_dim", self.head_dim, 1)
        check_real("c", self.c, at_least=0)
        check_real("p", self.p, above=0)

    def _factor(self, n: Tensor) -> Tensor:
        return (self.head_dim * (1.0 + self.c * n.log() ** self.p)).rsqrt()

    def describe(self) -> str:
        return f"polylog: 1/sqrt(d_k (1 + {self.c} (log T)^{self.p})), d_k={self.head_dim}"


ATTENTION_SCALE_POLICIES: dict[str, tuple[type[AttentionScale], tuple[str, ...]]] = {
    "standard": (StandardScale, ()),
    "log_n": (CriticalAttentionScaling, ("train_len",)),
    "polylog": (PolylogScale, ("c", "p")),
}
_ALL_OPTIONS = ("train_len", "c", "p")


def make_attention_scale(policy: str, head_dim: int, **kwargs: float) -> AttentionScale:
    """Build the scale policy named ``policy``.

    Options that belong to other policies are accepted and ignored, so a caller can pass every
    configured option (``train_len``, ``c``, ``p``) regardless of the policy; options no policy
    knows are an error.

    Args:
        policy: ``"standard"``, ``"log_n"`` or ``"polylog"``.
        head_dim: d_k.
        **kwargs: ``train_len`` (required by ``log_n``), ``c`` and ``p`` (``polylog``).

    Returns:
        The policy object.

    Raises:
        ValueError: for an unknown policy (listing the supported ones), an unknown option, a
            missing ``train_len`` for ``log_n``, or invalid values.

    Example::

        >>> make_attention_scale("log_n", 64, train_len=128, c=1.0).describe()
        'log_n: max(1, log n / log 128) / sqrt(d_k), d_k=64'
    """
    if policy not in ATTENTION_SCALE_POLICIES:
        raise ValueError(
            f"Unknown attention scale `policy` {policy!r}; "
            f"supported: {sorted(ATTENTION_SCALE_POLICIES)}"
        )
    unknown = sorted(set(kwargs) - set(_ALL_OPTIONS))
    if unknown:
        raise ValueError(
            f"Unknown attention scale options {unknown}; supported: {list(_ALL_OPTIONS)}"
        )
    cls, options = ATTENTION_SCALE_POLICIES[policy]
    if policy == "log_n" and kwargs.get("train_len") is None:
        raise ValueError(
            "The `log_n` attention scale needs `train_len`, the training context length"
        )
    return cls(head_dim, **{name: kwargs[name] for name in options if name in kwargs})


def stable_softmax(x: Tensor, dim: int = -1, mask: Tensor | None = None) -> Tensor:
    r"""Softmax that subtracts the row maximum first and tolerates fully masked rows.

    .. math::
        p_j = \frac{e^{x_j - m}}{\sum_{k \in A} e^{x_k - m}} \;(j \in A),
        \qquad m = \max_{k \in A} x_k

    and ``p_j = 0`` outside the allowed set A. A row with no allowed entry (all masked, or all
    ``-inf``) gives all zeros, never NaN. Where ``torch.softmax`` is defined it gives the same
    values; huge logits (e.g. 1e4) do not overflow. float16/bfloat16 inputs are computed in
    float32 and cast back.

    Args:
        x: logits, any shape.
        dim: the dimension to normalize over.
        mask: optional bool (or 0/1) tensor broadcastable to ``x``, **True where an entry may be
            attended** (the convention of :func:`qkmonitor.kernels.attention`).

    Returns:
        Probabilities of the shape and dtype of ``x``.

    Example::

        >>> logits = torch.tensor([[1e4, 1e4], [0.0, 0.0]])
        >>> stable_softmax(logits, mask=torch.tensor([[True, True], [False, False]]))
        tensor([[0.5000, 0.5000],
                [0.0000, 0.0000]])
    """
    return masked_softmax(x, dim=dim, mask=mask)

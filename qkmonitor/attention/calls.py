"""One observed attention call, reduced to what its statistics need.

A probe hands each forward of an attention module to its observers as an
:class:`~qkmonitor.attention.probes.AttentionCall`. The adapters build one of these:

- :class:`MaskedCall`: queries, keys, a scale and which keys each row may attend (causal,
  key padding, a 4-D boolean mask, an additive bias, a sliding window, soft-capping). Where the
  mask is only causal and/or key padding the statistics come from the fused kernel (no N x M
  matrix); otherwise from explicit scores, a few query rows at a time.
- :class:`ScoresCall`: explicit (B, H, N, M) scores as the model computed them (``-inf`` = blocked).
- :class:`FailedCall`: a call that could not be read; measuring it raises the original error, which
  the probe records.
- :class:`UnreadCall`: a forward of the module in which no attention call could be read, and why
  (what it called, what is missing), or whose softmax is not one head's attention over tokens
  (heads mixed before it, channels); not a measurement, the probe keeps the reason.

``flex_attention``'s ``score_mod`` and ``BlockMask`` are applied as flex applies them
(:func:`flex_apply`: the function at every ``(b, h, q_idx, kv_idx)``, vmapped over each index).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from qkmonitor.kernels import autocast_off

__all__ = [
    "MASK_FLOOR",
    "TENSOR_PARALLEL",
    "FailedCall",
    "MaskedCall",
    "ScoresCall",
    "UnreadCall",
    "block_mask_allowed",
    "flex_apply",
    "split_mask",
]

_MAX_SCORES = 1 << 24  # explicit path: score elements per chunk (128 MiB in float64)


class ScoresCall:
    """A call given by its explicit (B, H, N, M) scores (``-inf`` = blocked)."""

    def __init__(self, scores: Tensor) -> None:
        self.scores = scores

    def stats(self, sink_tokens: int = 0):
        from qkmonitor.measures.entropies import attention_stats_from_scores

        return attention_stats_from_scores(self.scores, sink_tokens=sink_tokens)

    def probs(self, sequences: int, rows: int) -> Tensor:
        from qkmonitor.measures.probabilities import masked_softmax

        return masked_softmax(self.scores[:sequences, :, :rows])

    def max_logits(self) -> Tensor:
        scores = self.scores.detach()
        return _largest(scores.to(_score_dtype(scores.dtype)))


class FailedCall:
    """A call that could not be read: measuring it raises the original error."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def stats(self, sink_tokens: int = 0):
        raise self.error

    def probs(self, sequences: int, rows: int) -> Tensor:
        raise self.error

    def max_logits(self) -> Tensor:
        raise self.error


#: the words every refusal under tensor parallelism names (:class:`UnreadCall` ``sharded``), by
#: which the spectrum's warnings about such a layer are told apart (given on the logging rank)
TENSOR_PARALLEL = "tensor parallelism"


class UnreadCall:
    """A forward of a probed module in which no attention call could be read, or whose call is
    refused: what its softmax is over is not one head's attention over tokens (heads mixed before
    it, channels).

    Attributes:
        unread_reason: what the forward called and what was missing to read it, for the warning
            (the attribute a probe looks for).
        no_layout: why the layer's weights have no W_QK to check either (attention over
            channels), or None: a layout check may still read them from the call's q and k.
        sharded: the call is refused because its heads are split across ranks (tensor
            parallelism), or its keys (context parallelism,
            :mod:`~qkmonitor.attention.context_parallel`): not a module qkmonitor cannot read,
            so training goes on and the layer's values are NaN, with the reason named once (on
            the logging rank).
    """

    def __init__(self, reason: str, no_layout: str | None = None, *, sharded: bool = False) -> None:
        self.unread_reason = reason
        self.no_layout = no_layout
        self.sharded = sharded


@dataclass
class MaskedCall:
    """One attention call, reduced to scores and the keys each query row may attend."""

    q: Tensor  # (B, H, N, D)
    k: Tensor  # (B, H_kv, M, D)
    scale: float
    causal: bool  # bottom-right aligned: row i attends key j <= i + M - N
    padding: Tensor | None  # (B, M) bool, True = attend
    allowed: Tensor | None  # 4-D bool broadcastable to (B, H, N, M), beyond causal/padding
    bias: Tensor | None  # 4-D additive float, same broadcasting
    window: int | None = None
    softcap: float | None = None
    #: flex_attention's ``score_mod(score, b, h, q_idx, kv_idx)``, applied to the scaled scores
    score_mod: Callable | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, module, query, key, mask, kwargs, original, scale) -> MaskedCall:
        n, m = query.shape[2], key.shape[2]
        bias = kwargs.get("position_bias")
        softcap = kwargs.get("softcap")
        call = cls(
            query,
            key,
            scale,
            False,
            None,
            None,
            None,
            None,
            None if softcap is None else float(softcap),
        )
        if _is_block_mask(mask):  # flex_attention's: its blocks and its mask_mod
            call.allowed = block_mask_allowed(mask, query.shape[0], query.shape[1], n, m)
            call.bias = bias
            return call
        if (
            isinstance(mask, Tensor) and mask.dim() == 4
        ):  # the mask says it all (sliding windows too)
            call.allowed, mask_bias = split_mask(
                mask[..., :m]
            )  # eager cuts a longer mask to the keys
            call.bias = _add(mask_bias, bias)
            call.reduce()
            return call
        if mask is not None and not (isinstance(mask, Tensor) and mask.dim() == 2):
            raise ValueError(f"attention mask of type {type(mask).__name__} is not supported")
        call.bias = bias
        if mask is not None:  # FlashAttention's (B, M) key padding, 1 = attend
            call.padding = mask.to(torch.bool)
        is_causal = kwargs.get("is_causal")
        is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        call.causal = original not in (None, "eager") and bool(is_causal) and n > 1
        if original is not None and "flash" in original:  # FlashAttention applies the window itself
            call.window = kwargs.get("sliding_window")
        if original == "sdpa" and call.causal and mask is None and m > n:
            call.k = key[:, :, :n]  # what sdpa_attention_forward does for this case
        return call

    def reduce(self) -> None:
        """Recognise a 4-D mask that is only causal and/or key padding (the kernel's cases)."""
        a = self.allowed
        if self.bias is not None or a.shape[1] != 1:
            return
        a = a[:, 0].expand(self.q.shape[0], *a.shape[-2:])  # (B, N, M)
        n, m = a.shape[-2:]
        pad = a.any(dim=1)  # a key any row may attend (the last row, when causal)
        for causal in (False, True):
            rule = torch.ones(n, m, dtype=torch.bool, device=a.device)
            rule = rule.tril(m - n) if causal else rule
            if torch.equal(a, rule & pad[:, None, :]):
                self.causal, self.allowed = causal, None
                self.padding = None if bool(pad.all()) else pad
                return

    def stats(self, sink_tokens: int = 0):
        """Per-row statistics; computed once per sink count however many probes ask."""
        cached = self._cache.get(sink_tokens)
        if cached is None:
            cached = self._cache[sink_tokens] = self._stats(sink_tokens)
        return cached

    def _stats(self, sink_tokens: int):
        from qkmonitor.kernels import attention_stats
        from qkmonitor.measures.entropies import attention_stats_from_scores

        if self._kernel_case():
            try:
                with autocast_off():
                    return attention_stats(**self._kernel_arguments(), sink_tokens=sink_tokens)
            except ValueError:  # a shape or dtype the kernel does not take: the explicit path below
                pass
        b, h, n = self.q.shape[:3]
        rows = max(1, _MAX_SCORES // (h * self.k.shape[2]))
        return _cat_stats(
            [
                _cat_stats(
                    [
                        attention_stats_from_scores(
                            *self._scores(slice(i, i + 1), slice(r, r + rows)),
                            sink_tokens=sink_tokens,
                        )
                        for r in range(0, n, rows)
                    ],
                    dim=2,
                )
                for i in range(b)
            ],
            dim=0,
        )

    def max_logits(self) -> Tensor:
        """(B, H) largest scaled logits: from blocks of scores without the softmax; with a mask
        beyond causal and key padding, from the explicit scores a few rows at a time. Computed
        once however many probes ask."""
        cached = self._cache.get("max_logits")
        if cached is None:
            cached = self._cache["max_logits"] = self._max_logits()
        return cached

    def _max_logits(self) -> Tensor:
        from qkmonitor.kernels import attention_max_logits

        if self._kernel_case():
            try:
                return attention_max_logits(**self._kernel_arguments())
            except ValueError:  # a shape or dtype the kernel does not take: explicit scores
                pass
        b, h, n = self.q.shape[:3]
        rows = max(1, _MAX_SCORES // (h * max(1, self.k.shape[2])))
        per_sequence = []
        for i in range(b):
            best = None
            for r in range(0, n, rows):
                scores, allowed = self._scores(slice(i, i + 1), slice(r, r + rows))
                block = _largest(torch.where(allowed, scores, float("-inf")))
                best = block if best is None else torch.maximum(best, block)
            if best is None:  # no query row
                best = torch.full((1, h), float("-inf"), device=self.q.device)
            per_sequence.append(best)
        return torch.cat(per_sequence) if per_sequence else torch.empty(0, h)

    def _kernel_arguments(self) -> dict:
        """This call as the fused kernels take it (in :meth:`_kernel_case`)."""
        return dict(
            q=self.q, k=self.k, causal=self.causal, key_padding_mask=self.padding, scale=self.scale
        )

    def _kernel_case(self) -> bool:
        """Whether the mask is only causal and/or key padding (what the fused kernel takes)."""
        return (
            self.allowed is None
            and self.bias is None
            and self.window is None
            and self.softcap is None
            and self.score_mod is None
        )

    def probs(self, sequences: int, rows: int) -> Tensor:
        """(S, H, R, M) attention probabilities of the first sequences and query rows.

        Under a causal mask the keys past the last row's diagonal are 0 without being computed
        (half the scores of the first 128 rows of 256). The softmax runs in the scores' memory."""
        from qkmonitor.measures.probabilities import masked_softmax_

        n, m = self.q.shape[2], self.k.shape[2]
        keys = m
        if self.causal:  # row i attends keys j <= i + M - N (none when M - N < -i)
            keys = max(1, min(m, min(rows, n) + m - n)) if m else 0
        scores, allowed = self._scores(slice(0, sequences), slice(0, rows), slice(0, keys))
        probs = masked_softmax_(scores, mask=allowed)
        if keys == m:
            return probs
        full = probs.new_empty(*probs.shape[:-1], m)
        full[..., :keys] = probs
        full[..., keys:] = 0.0
        return full

    def _scores(self, seqs: slice, rows: slice, keys: slice = slice(None)) -> tuple[Tensor, Tensor]:
        """Scaled scores (S, H, R, K) in float32 or better, and where they may be attended."""
        dtype = torch.float64 if self.q.dtype == torch.float64 else torch.float32
        n, m = self.q.shape[2], self.k.shape[2]
        q, k = self.q[seqs, :, rows].to(dtype), self.k[seqs, :, keys].to(dtype)
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scores = q @ k.transpose(-1, -2)  # (S, H, R, K), ours: scaled in place
        scores *= self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        positions = torch.arange(n, device=q.device)[rows]
        i = positions[:, None] + (m - n)  # the row's position among the keys
        j = torch.arange(m, device=q.device)[keys]
        if self.score_mod is not None:
            sequences = torch.arange(self.q.shape[0], device=q.device)[seqs]
            heads = torch.arange(scores.shape[1], device=q.device)
            scores = flex_apply(self.score_mod, sequences, heads, positions, j, score=scores)
        allowed = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device)
        if self.causal:
            allowed = allowed & (j <= i)
        if self.window is not None:  # FlashAttention's window_size=(w - 1, w - 1)
            allowed = allowed & ((i - j).abs() < self.window)
        allowed = allowed.expand_as(scores)
        if self.padding is not None:
            allowed = allowed & self.padding[seqs, None, None, keys]
        if self.allowed is not None:
            allowed = allowed & _rows_of(self.allowed, seqs, rows)[..., keys]
        if self.bias is not None:
            scores = scores + _rows_of(self.bias, seqs, rows)[..., keys].to(dtype)
        return scores, allowed


def _cat_stats(parts: list, dim: int):
    """AttentionStats concatenated field by field along ``dim``."""
    if len(parts) == 1:
        return parts[0]
    fields = {f.name: [getattr(p, f.name) for p in parts] for f in dataclasses.fields(parts[0])}
    return type(parts[0])(
        **{
            name: None if values[0] is None else torch.cat(values, dim=dim)
            for name, values in fields.items()
        }
    )


def _score_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _largest(scores: Tensor) -> Tensor:
    """(B, H, N, M) scores (``-inf`` where blocked) -> (B, H) largest; ``-inf`` without any."""
    if scores.shape[-1] == 0 or scores.shape[-2] == 0:
        return scores.new_full(scores.shape[:2], float("-inf"))
    return scores.amax(dim=(-2, -1))


def _rows_of(mask: Tensor, seqs: slice, rows: slice) -> Tensor:
    """A (B|1, H|1, N, M) tensor cut to some sequences and rows (broadcast dims kept)."""
    mask = mask if mask.shape[0] == 1 else mask[seqs]
    return mask[:, :, rows]


def flex_apply(
    fn: Callable, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor, score: Tensor | None = None
) -> Tensor:
    """``fn`` at every ``(b, h, q_idx, kv_idx)``, as ``flex_attention`` calls it: a ``score_mod``
    ``fn(score, b, h, q_idx, kv_idx)`` on ``score`` (B, H, N, M), or a ``mask_mod``
    ``fn(b, h, q_idx, kv_idx)``; written for one position, vmapped over each index (the key
    innermost). Returns (B, H, N, M)."""
    args = (b, h, q_idx, kv_idx) if score is None else (score, b, h, q_idx, kv_idx)
    first = 0 if score is None else 1
    mapped = fn
    for axis in (3, 2, 1, 0):  # kv, q, h, b: each map takes the score's leading dim
        dims: list[int | None] = [None] * len(args)
        dims[first + axis] = 0
        if score is not None:
            dims[0] = 0
        mapped = torch.vmap(mapped, in_dims=tuple(dims))
    out = mapped(*args)
    return out.expand(len(b), len(h), len(q_idx), len(kv_idx))


def _is_block_mask(mask: object) -> bool:
    """Whether ``mask`` is flex_attention's ``BlockMask`` (torch 2.5 and later; not imported)."""
    return type(mask).__name__ == "BlockMask" and callable(getattr(mask, "mask_mod", None))


def block_mask_allowed(block_mask, batch: int, heads: int, n: int, m: int) -> Tensor:
    """(B, H, N, M) bool: the keys a ``BlockMask`` lets each query row attend, as flex applies it:
    the blocks it computes (partial or full) and, inside them, its ``mask_mod`` at every
    position of the call's ``batch`` sequences and ``heads``."""
    dense = block_mask.to_dense().bool()  # (B or 1, H or 1, query blocks, key blocks)
    q_block, kv_block = block_mask.BLOCK_SIZE
    blocks = dense.repeat_interleave(q_block, -2).repeat_interleave(kv_block, -1)[..., :n, :m]
    device = dense.device
    index = [torch.arange(size, device=device) for size in (batch, heads, n, m)]
    return blocks & flex_apply(block_mask.mask_mod, *index).bool()


#: An additive mask entry at or below this blocks its key (docs/metrics.md, "Masked keys"):
#: ``-inf``, ``finfo.min``, ``-1e4`` and timm Swin's ``-100`` alike. ``e^-80 < 2^-115``: such a
#: key's weight is below float32's resolution next to any key its row attends, unless its own
#: logit is over 63 above theirs; no position bias (ALiBi, T5's buckets, relative tables) comes
#: near it in practice.
MASK_FLOOR = -80.0


def split_mask(mask: Tensor) -> tuple[Tensor, Tensor | None]:
    """A 4-D attention mask as (allowed bool, additive bias or None): an additive entry at or
    below :data:`MASK_FLOOR` blocks its key, any other is a bias added to the logits."""
    if mask.dtype == torch.bool:
        return mask, None
    blocked = mask <= MASK_FLOOR
    bias = mask.masked_fill(blocked, 0.0)
    return ~blocked, (None if not bool(bias.any()) else bias)


def _add(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    if a is None or b is None:
        return a if b is None else b
    return a + b

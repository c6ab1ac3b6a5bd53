"""Find the attention layers of a model and read their query/key weights.

An :class:`AttentionLayer` wraps one attention module, whatever its origin, and gives the monitors
what they need: a name, its index in forward order, and :meth:`AttentionLayer.qk_weights` —
``(w_q, w_k, num_heads, num_kv_heads, scale)`` in ``nn.Linear`` layout. The core never imports
the bundled models: they take part through the :class:`SupportsQKMonitor` protocol, which any
user module may implement too.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "QKWeights",
    "SupportsQKMonitor",
    "AttentionLayer",
    "NativeAttentionLayer",
    "MultiheadAttentionLayer",
    "find_attention_layers",
]


@dataclass(frozen=True)
class QKWeights:
    """A layer's query and key projections (``nn.Linear`` layout) and how they split into heads.

    Attributes:
        w_q: (num_heads * d_k, d) query weight, biases left out.
        w_k: (num_kv_heads * d_k, d') key weight.
        num_heads: query heads H.
        num_kv_heads: key/value heads; divides H (GQA/MQA when smaller).
        scale: the factor the layer multiplies ``q·k`` by before the softmax.
    """

    w_q: Tensor
    w_k: Tensor
    num_heads: int
    num_kv_heads: int
    scale: float


@runtime_checkable
class SupportsQKMonitor(Protocol):
    """An attention module that describes itself to qkmonitor (qkmonitor's own modules do).

    ``qk_weights()`` returns the :class:`QKWeights` of the module's current parameters. A module
    may also offer activation statistics by defining ``set_probe(enabled: bool)`` (capture on the
    following forwards) and ``pop_stats() -> AttentionStats | None`` (the last forward's per-row
    statistics, see :class:`qkmonitor.kernels.AttentionStats`).
    """

    def qk_weights(self) -> QKWeights: ...


class AttentionLayer:
    """One attention layer of a model, seen through an adapter.

    Args:
        name: the module's qualified name in the model (``""`` for the model itself).
        module: the attention module.
        index: position in forward order, from 0.
    """

    kind = "custom"

    def __init__(self, name: str, module: nn.Module, index: int = 0) -> None:
        self.name = name
        self.module = module
        self.index = index
        #: while probing, also report the attention mass on the first this-many keys (0: off),
        #: where the adapter can (qkmonitor's own attention, nn.MultiheadAttention).
        self.sink_tokens = 0

    def qk_weights(self) -> QKWeights:
        """The layer's current query/key weights; subclasses read them from their module."""
        raise NotImplementedError(f"{type(self).__name__} must implement `qk_weights()`")

    @property
    def supports_stats(self) -> bool:
        """Whether :meth:`set_probe` / :meth:`pop_stats` give activation statistics."""
        return False

    def set_probe(self, enabled: bool, probs_slice: tuple[int, int] | None = None) -> None:
        """Capture attention statistics on the following forwards (``enabled``) or stop.

        ``probs_slice=(sequences, rows)`` also keeps the explicit attention matrix of that slice
        (all keys), for :meth:`pop_probs`.
        """
        raise NotImplementedError(f"{type(self).__name__} has no activation statistics")

    def pop_stats(self):
        """The :class:`~qkmonitor.kernels.AttentionStats` of the last probed forward, or None."""
        raise NotImplementedError(f"{type(self).__name__} has no activation statistics")

    def pop_probs(self) -> Tensor | None:
        """The (S, H, R, M) attention matrix of the last probed forward's slice, or None."""
        raise NotImplementedError(f"{type(self).__name__} has no activation statistics")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(index={self.index}, name={self.name!r})"


class NativeAttentionLayer(AttentionLayer):
    """A module implementing :class:`SupportsQKMonitor` (qkmonitor's own attention)."""

    kind = "qkmonitor"

    def qk_weights(self) -> QKWeights:
        return self.module.qk_weights()

    @property
    def supports_stats(self) -> bool:
        return callable(getattr(self.module, "set_probe", None)) and callable(getattr(self.module, "pop_stats", None))

    def set_probe(self, enabled: bool, probs_slice: tuple[int, int] | None = None) -> None:
        if not self.supports_stats:
            super().set_probe(enabled)
        self._probs_slice = probs_slice if enabled else None
        if probs_slice is None:
            self.module.set_probe(enabled)
        else:
            self.module.set_probe(enabled, probs_slice=probs_slice)
        if enabled and self.sink_tokens and hasattr(self.module, "probe_sink_tokens"):
            self.module.probe_sink_tokens = max(self.module.probe_sink_tokens, self.sink_tokens)

    def pop_stats(self):
        if not self.supports_stats:
            return super().pop_stats()
        return self.module.pop_stats()

    def pop_probs(self) -> Tensor | None:
        pop = getattr(self.module, "pop_probs", None)
        if not callable(pop):
            return None
        slice_ = getattr(self, "_probs_slice", None)
        return pop(slice_) if slice_ is not None else pop()


class CapturingAttentionLayer(AttentionLayer):
    """An adapter that captures statistics itself (hooks, wrappers) and hands them out once."""

    def __init__(self, name: str, module: nn.Module, index: int = 0) -> None:
        super().__init__(name, module, index)
        self._stats = None
        self._probs: Tensor | None = None
        self._probs_slice: tuple[int, int] | None = None

    def pop_stats(self):
        stats, self._stats = self._stats, None
        return stats

    def pop_probs(self) -> Tensor | None:
        probs, self._probs = self._probs, None
        return probs


class MultiheadAttentionLayer(CapturingAttentionLayer):
    """``torch.nn.MultiheadAttention``: packed ``in_proj_weight`` or separate q/k/v weights.

    ``batch_first`` does not matter for the weights. The scale is ``1/sqrt(head_dim)``, as in
    ``F.multi_head_attention_forward``.

    Statistics: while probing, a forward pre-hook reads the call's query, key and masks and
    recomputes the scores ``q_h k_h^T / sqrt(d_k)`` on the side, under ``no_grad`` — the module's
    own call, its arguments and its outputs are untouched (``need_weights`` stays as the caller
    set it). With no mask or a key padding mask the fused kernel gives the statistics without an
    N x M matrix; an arbitrary ``attn_mask`` goes through the explicit scores. ``set_probe(False)``
    removes the hook.
    """

    kind = "torch.nn.MultiheadAttention"

    def __init__(self, name: str, module: nn.Module, index: int = 0) -> None:
        super().__init__(name, module, index)
        self._hook = None

    def qk_weights(self) -> QKWeights:
        w_q, w_k, _, _ = self._projections()
        mha: nn.MultiheadAttention = self.module
        return QKWeights(w_q, w_k, mha.num_heads, mha.num_heads, 1.0 / math.sqrt(mha.head_dim))

    def _projections(self):
        mha: nn.MultiheadAttention = self.module
        e = mha.embed_dim
        if mha.in_proj_weight is not None:  # packed (3E, E): rows are q, k, v
            w_q, w_k = mha.in_proj_weight[:e], mha.in_proj_weight[e : 2 * e]
        else:
            w_q, w_k = mha.q_proj_weight, mha.k_proj_weight  # (E, E) and (E, kdim)
        b = mha.in_proj_bias
        return w_q, w_k, (None if b is None else b[:e]), (None if b is None else b[e : 2 * e])

    @property
    def supports_stats(self) -> bool:
        return True

    def set_probe(self, enabled: bool, probs_slice: tuple[int, int] | None = None) -> None:
        self._probs_slice = probs_slice if enabled else None
        if enabled and self._hook is None:
            self._hook = self.module.register_forward_pre_hook(self._capture, with_kwargs=True)
        elif not enabled:
            if self._hook is not None:
                self._hook.remove()
            self._hook, self._stats, self._probs = None, None, None

    def _capture(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask",
                 "average_attn_weights", "is_causal")
        call = dict(zip(names, args)) | kwargs
        try:
            with torch.no_grad():
                self._stats, self._probs = self._stats_of_call(call)
        except (RuntimeError, ValueError) as err:  # a metric problem must never stop training
            self._stats, self._probs = None, None
            warnings.warn(f"qkmonitor: no attention statistics for {self.name!r} ({type(err).__name__}: {err})",
                          RuntimeWarning, stacklevel=2)

    def _stats_of_call(self, call: dict):
        from qkmonitor.functional import attention_probs, attention_stats_from_scores, masked_softmax
        from qkmonitor.kernels import attention

        mha: nn.MultiheadAttention = self.module
        query, key = call["query"], call["key"]
        if query.dim() == 2:  # unbatched (L, E)
            query, key = query[None], key[None]
        elif not mha.batch_first:  # (L, B, E) -> (B, L, E)
            query, key = query.transpose(0, 1), key.transpose(0, 1)
        w_q, w_k, b_q, b_k = self._projections()
        h, d_k = mha.num_heads, mha.head_dim
        q = F.linear(query, w_q, b_q).unflatten(-1, (h, d_k)).transpose(1, 2)  # (B, H, N, d_k)
        k = F.linear(key, w_k, b_k).unflatten(-1, (h, d_k)).transpose(1, 2)  # (B, H, M, d_k)
        if mha.bias_k is not None or mha.add_zero_attn:
            k = _extra_keys(mha, k)
        allowed_keys = _allowed_keys(call.get("key_padding_mask"), q.shape[0], k.shape[2], k.device)
        scale = 1.0 / math.sqrt(d_k)
        attn_mask = call.get("attn_mask")
        causal = attn_mask is not None and _is_causal_mask(attn_mask, q.shape[2], k.shape[2])
        probs = None
        if (attn_mask is None or causal) and _boolean_or_none(allowed_keys):
            _, stats = attention(q, k, k, causal=causal, key_padding_mask=allowed_keys, scale=scale,
                                 return_stats=True, sink_tokens=self.sink_tokens)
            if self._probs_slice is not None:
                seqs, rows = self._probs_slice
                pad = None if allowed_keys is None else allowed_keys[:seqs]
                r, m = min(rows, q.shape[2]), k.shape[2]
                future = torch.ones(r, m, dtype=torch.bool, device=q.device).triu(1)  # N == M here
                bias = torch.zeros(r, m, device=q.device).masked_fill(future, float("-inf")) if causal else None
                probs = attention_probs(q[:seqs, :, :rows], k[:seqs], scale=scale, key_padding_mask=pad, bias=bias)
            return stats, probs
        scores = (q @ k.transpose(-1, -2)) * scale  # an arbitrary mask: the explicit path
        scores = scores + _additive(attn_mask, q.shape[0], h, scores)
        if allowed_keys is not None:
            scores = scores + _additive(allowed_keys, None, h, scores, keys_only=True)
        if self._probs_slice is not None:
            seqs, rows = self._probs_slice
            probs = masked_softmax(scores[:seqs, :, :rows])
        return attention_stats_from_scores(scores, sink_tokens=self.sink_tokens), probs


def _allowed_keys(key_padding_mask: Tensor | None, batch: int, num_keys: int, device) -> Tensor | None:
    """MHA's key_padding_mask (True or -inf = ignore) as True-where-allowed, or a float bias."""
    if key_padding_mask is None:
        return None
    mask = key_padding_mask.to(device)
    if mask.dtype == torch.bool:
        allowed = ~mask
    else:  # additive float mask: -inf drops a key, other values bias it (explicit path)
        return mask.float()
    if allowed.shape[-1] < num_keys:  # bias_k / zero-attention keys are appended, always allowed
        allowed = F.pad(allowed, (0, num_keys - allowed.shape[-1]), value=True)
    return allowed


def _boolean_or_none(mask: Tensor | None) -> bool:
    return mask is None or mask.dtype == torch.bool


def _is_causal_mask(attn_mask: Tensor, n: int, m: int) -> bool:
    """Whether ``attn_mask`` is exactly the causal mask (bool True or float -inf above the diagonal)."""
    if attn_mask.dim() != 2 or tuple(attn_mask.shape) != (n, m) or n != m:
        return False
    future = torch.ones(n, m, dtype=torch.bool, device=attn_mask.device).triu(1)
    blocked = attn_mask if attn_mask.dtype == torch.bool else torch.isneginf(attn_mask)
    if attn_mask.dtype != torch.bool and not bool((attn_mask[~future] == 0).all()):
        return False
    return bool((blocked == future).all())


def _additive(mask: Tensor | None, batch: int | None, heads: int, like: Tensor, keys_only: bool = False) -> Tensor:
    """A bool (True = blocked) or float mask as an additive bias broadcastable to (B, H, N, M)."""
    if mask is None:
        return torch.zeros((), dtype=like.dtype, device=like.device)
    if keys_only:  # (B, M): bool True = allowed here, or an additive float mask
        bias = mask if mask.dtype != torch.bool else torch.where(mask, 0.0, float("-inf"))
        return bias.to(like.dtype)[:, None, None, :]
    bias = torch.where(mask, float("-inf"), 0.0) if mask.dtype == torch.bool else mask
    bias = bias.to(device=like.device, dtype=like.dtype)
    if bias.dim() == 3:  # (B * H, N, M)
        bias = bias.view(batch, heads, *bias.shape[-2:])
    return bias[..., : like.shape[-2], : like.shape[-1]] if bias.dim() == 2 else bias


def _extra_keys(mha: nn.MultiheadAttention, k: Tensor) -> Tensor:
    """The keys MHA appends: ``bias_k`` and, with ``add_zero_attn``, a zero key."""
    b, h, _, d_k = k.shape
    if mha.bias_k is not None:
        k = torch.cat([k, mha.bias_k.view(1, h, 1, d_k).expand(b, h, 1, d_k)], dim=2)
    if mha.add_zero_attn:
        k = torch.cat([k, k.new_zeros(b, h, 1, d_k)], dim=2)
    return k


def _adapt(name: str, module: nn.Module, index: int) -> AttentionLayer | None:
    if isinstance(module, SupportsQKMonitor):
        return NativeAttentionLayer(name, module, index)
    if isinstance(module, nn.MultiheadAttention):
        return MultiheadAttentionLayer(name, module, index)
    if sys.modules.get("transformers") is not None:  # a transformers module implies transformers imported
        from qkmonitor.hf import adapt_hf_module

        return adapt_hf_module(name, module, index)
    return None


_LOOKED_FOR = (
    "qkmonitor attention modules (a `qk_weights()` method), torch.nn.MultiheadAttention, "
    "Hugging Face transformers attention (LLaMA-family `q_proj`/`k_proj` with "
    "`num_key_value_heads`, GPT-2 `c_attn` Conv1D, BERT `query`/`key`; needs the `hf` extra)"
)

LayerSpec = Iterable[AttentionLayer | nn.Module] | Callable[[nn.Module], Any]


def find_attention_layers(model: nn.Module, layers: LayerSpec | None = None) -> list[AttentionLayer]:
    """The attention layers of ``model``, in forward (registration) order.

    Args:
        model: the model to search.
        layers: optional override: a list of :class:`AttentionLayer` or modules, or a function
            ``model -> list`` of either. Modules must be of a supported kind.

    Returns:
        A non-empty list of :class:`AttentionLayer`, ``index`` counting from 0.

    Raises:
        ValueError: if no attention layer is found, or a given module is not supported.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"Expected `model` to be a torch.nn.Module, got {type(model).__name__}")
    if layers is not None:
        return _from_user(model, layers)
    found: list[AttentionLayer] = []
    claimed: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") or prefix == "" for prefix in claimed):
            continue  # inside an attention module already found
        layer = _adapt(name, module, len(found))
        if layer is not None:
            found.append(layer)
            claimed.append(name)
    if not found:
        raise ValueError(
            f"No attention layers found in {type(model).__name__}: looked for {_LOOKED_FOR}. "
            "Pass `layers=` (a list of AttentionLayer or modules, or a function of the model)."
        )
    return found


def _from_user(model: nn.Module, layers: LayerSpec) -> list[AttentionLayer]:
    items = list(layers(model) if callable(layers) else layers)
    names = {id(m): n for n, m in model.named_modules()}
    result: list[AttentionLayer] = []
    for i, item in enumerate(items):
        if isinstance(item, AttentionLayer):
            item.index = i
            result.append(item)
            continue
        if not isinstance(item, nn.Module):
            raise ValueError(
                f"Expected `layers` to hold AttentionLayer or nn.Module items, got {type(item).__name__} at {i}"
            )
        layer = _adapt(names.get(id(item), f"layers.{i}"), item, i)
        if layer is None:
            raise ValueError(
                f"`layers[{i}]` ({type(item).__name__}) is not a supported attention module: "
                f"expected one of {_LOOKED_FOR}, or wrap it in an AttentionLayer subclass"
            )
        result.append(layer)
    if not result:
        raise ValueError("Expected `layers` to name at least one attention layer, got none")
    return result

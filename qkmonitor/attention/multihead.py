"""The torch family: ``nn.MultiheadAttention``, its weights from ``in_proj_weight`` (or separate
q/k/v weights) and its calls seen by a forward pre-hook that recomputes the scores on the side."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkmonitor.attention.adapters import AttentionLayer
from qkmonitor.attention.calls import MASK_FLOOR, ScoresCall
from qkmonitor.attention.clip import ProjectionRows, QKRows
from qkmonitor.attention.compiled import add_forward_hooks
from qkmonitor.attention.probes import AttentionCall, KernelCall, Probe
from qkmonitor.attention.registry import register_family
from qkmonitor.attention.route import Channel, Route, observed
from qkmonitor.kernels import autocast_off
from qkmonitor.measures.layer_spectra import QKWeights

__all__ = ["MultiheadAttentionLayer"]


class MultiheadAttentionLayer(AttentionLayer):
    """``torch.nn.MultiheadAttention``: packed ``in_proj_weight`` or separate q/k/v weights.

    ``batch_first`` does not matter for the weights. The scale is ``1/sqrt(head_dim)``, as in
    ``F.multi_head_attention_forward``.

    Statistics: the module's route carries one forward pre-hook (:class:`_MultiheadChannel`, for
    every probe open on it) that reads the call's query, key and masks and recomputes the scores
    ``q_h k_h^T / sqrt(d_k)`` on the side, under ``no_grad`` and in float32
    or better — the module's own call, its arguments and its outputs are untouched
    (``need_weights`` stays as the caller set it). The keys MHA appends (``bias_k``, the zero key
    of ``add_zero_attn``) are appended here too, and masks are widened over them as MHA does. With
    no mask, a causal mask or a boolean key padding mask the fused kernel gives the statistics
    without an N x M matrix; any other ``attn_mask`` goes through the explicit scores. Closing the
    last probe removes the hook.
    """

    kind = "torch.nn.MultiheadAttention"

    def qk_weights(self) -> QKWeights:
        w_q, w_k, _, _ = self._projections()
        mha: nn.MultiheadAttention = self.module
        return QKWeights(w_q, w_k, mha.num_heads, mha.num_heads, 1.0 / math.sqrt(mha.head_dim))

    def qk_rows(self) -> QKRows:
        mha: nn.MultiheadAttention = self.module
        w_q, w_k, b_q, b_k = self._projections()
        rows = torch.arange(mha.embed_dim).view(mha.num_heads, mha.head_dim)
        heads = tuple(range(mha.num_heads))
        return QKRows(ProjectionRows(w_q, b_q, rows), ProjectionRows(w_k, b_k, rows), heads)

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

    def install(self, probe: Probe) -> Callable[[], None]:
        def make() -> _MultiheadChannel:
            return _MultiheadChannel(self)

        _, remove = Route.attach(
            self.module, _MultiheadChannel, probe.observe, probe.request.sink_tokens, make
        )
        return remove

    def _call_of(self, call: dict):
        mha: nn.MultiheadAttention = self.module
        query, key = call["query"], call["key"]
        if query.dim() == 2:  # unbatched (L, E)
            query, key = query[None], key[None]
        elif not mha.batch_first:  # (L, B, E) -> (B, L, E)
            query, key = query.transpose(0, 1), key.transpose(0, 1)
        w_q, w_k, b_q, b_k = self._projections()
        dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        h, d_k = mha.num_heads, mha.head_dim
        q = (
            F.linear(query.to(dtype), w_q.to(dtype), _to(b_q, dtype))
            .unflatten(-1, (h, d_k))
            .transpose(1, 2)
        )
        k = (
            F.linear(key.to(dtype), w_k.to(dtype), _to(b_k, dtype))
            .unflatten(-1, (h, d_k))
            .transpose(1, 2)
        )
        extra = 0
        if mha.bias_k is not None or mha.add_zero_attn:
            k, extra = _extra_keys(mha, k)
        b, n, m = q.shape[0], q.shape[2], k.shape[2]
        key_padding_mask, attn_mask = call.get("key_padding_mask"), call.get("attn_mask")
        if key_padding_mask is not None and key_padding_mask.dim() == 1:  # unbatched (S,)
            key_padding_mask = key_padding_mask[None]
        scale = 1.0 / math.sqrt(d_k)
        causal = attn_mask is not None and extra == 0 and _is_causal_mask(attn_mask, n, m)
        if (attn_mask is None or causal) and _boolean_or_none(key_padding_mask):
            allowed = (
                None
                if key_padding_mask is None
                else _pad_keys(~key_padding_mask.to(q.device), m, True)
            )
            return KernelCall(q, k, scale=scale, causal=causal, key_padding_mask=allowed)
        scores = (
            q @ k.transpose(-1, -2)
        ) * scale  # an arbitrary mask: the explicit path (B, H, N, M)
        if attn_mask is not None:
            scores = scores + _pad_keys(_additive(attn_mask, b, h, scores), m, 0.0)
        if (
            key_padding_mask is not None
        ):  # MHA: bool True = ignore; _additive's keys: True = allowed
            kpm = ~key_padding_mask if key_padding_mask.dtype == torch.bool else key_padding_mask
            scores = scores + _pad_keys(
                _additive(kpm.to(q.device), None, h, scores, keys_only=True), m, 0.0
            )
        return ScoresCall(scores)


_MHA_ARGS = (
    "query",
    "key",
    "value",
    "key_padding_mask",
    "need_weights",
    "attn_mask",
    "average_attn_weights",
    "is_causal",
)


class _MultiheadChannel(Channel):
    """``nn.MultiheadAttention``'s calls, seen by a forward pre-hook that reads the call's
    arguments and measures it once for every probe open on the module."""

    def __init__(self, layer: MultiheadAttentionLayer) -> None:
        super().__init__()

        def capture(module: nn.Module, args: tuple, kwargs: dict) -> None:
            call = dict(zip(_MHA_ARGS, args)) | kwargs

            def build() -> AttentionCall:
                with autocast_off():  # float32 or better under autocast too
                    return layer._call_of(call)

            self.observers.notify(observed(build))

        self._remove_hook = add_forward_hooks(layer.module, pre=capture)
        self._fast_path = _FastPathHold() if _FAST_PATH_SKIPS_HOOKS else None

    def uninstall(self) -> None:
        self._remove_hook()
        if self._fast_path is not None:
            self._fast_path.release()


#: Before torch 2.5, ``nn.TransformerEncoderLayer``'s fast path (eval, no grad) runs the layer
#: fused, without calling ``self_attn`` or its hooks (pytorch/pytorch#128413): a probed layer would
#: not run. From 2.5 on, a hook on any submodule turns that fast path off by itself.
_FAST_PATH_SKIPS_HOOKS = torch.__version__ < "2.5"


class _FastPathHold:
    """``torch.backends.mha``'s fast path held off while any channel holds it (a count, so two
    monitors or several layers nest), and put back as it was when the last one lets go."""

    holders = 0
    before = True

    def __init__(self) -> None:
        if _FastPathHold.holders == 0:
            _FastPathHold.before = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)
        _FastPathHold.holders += 1
        self.held = True

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        _FastPathHold.holders -= 1
        if _FastPathHold.holders == 0:
            torch.backends.mha.set_fastpath_enabled(_FastPathHold.before)


def _to(bias: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if bias is None else bias.to(dtype)


def _pad_keys(mask: Tensor, num_keys: int, value) -> Tensor:
    """Widen a mask's key dim to ``num_keys`` with ``value`` (the keys MHA appends are allowed)."""
    short = num_keys - mask.shape[-1]
    if short <= 0:
        return mask
    if mask.dtype == torch.bool:
        return F.pad(mask, (0, short), value=bool(value))
    return F.pad(mask, (0, short), value=float(value))


def _boolean_or_none(mask: Tensor | None) -> bool:
    return mask is None or mask.dtype == torch.bool


def _is_causal_mask(attn_mask: Tensor, n: int, m: int) -> bool:
    """Whether ``attn_mask`` is exactly the causal mask (bool True or float -inf above the
    diagonal)."""
    if attn_mask.dim() != 2 or tuple(attn_mask.shape) != (n, m) or n != m:
        return False
    future = torch.ones(n, m, dtype=torch.bool, device=attn_mask.device).triu(1)
    blocked = attn_mask if attn_mask.dtype == torch.bool else torch.isneginf(attn_mask)
    if attn_mask.dtype != torch.bool and not bool((attn_mask[~future] == 0).all()):
        return False
    return bool((blocked == future).all())


def _additive(
    mask: Tensor | None, batch: int | None, heads: int, like: Tensor, keys_only: bool = False
) -> Tensor:
    """A bool (True = blocked) or float mask as an additive bias broadcastable to (B, H, N, M)."""
    if mask is None:
        return torch.zeros((), dtype=like.dtype, device=like.device)
    if keys_only:  # (B, M): bool True = allowed here, or an additive float mask
        bias = mask if mask.dtype != torch.bool else torch.where(mask, 0.0, float("-inf"))
        return _floored(bias.to(like.dtype))[:, None, None, :]
    bias = torch.where(mask, float("-inf"), 0.0) if mask.dtype == torch.bool else mask
    bias = _floored(bias.to(device=like.device, dtype=like.dtype))
    if bias.dim() == 3:  # (B * H, N, M)
        bias = bias.view(batch, heads, *bias.shape[-2:])
    return bias[..., : like.shape[-2], : like.shape[-1]] if bias.dim() == 2 else bias


def _floored(bias: Tensor) -> Tensor:
    """An additive mask with its entries at or below ``MASK_FLOOR`` made ``-inf``: blocked keys."""
    return bias.masked_fill(bias <= MASK_FLOOR, float("-inf"))


def _extra_keys(mha: nn.MultiheadAttention, k: Tensor) -> tuple[Tensor, int]:
    """The keys MHA appends: ``bias_k`` and, with ``add_zero_attn``, a zero key; and how many."""
    b, h, _, d_k = k.shape
    extra = 0
    if mha.bias_k is not None:
        k = torch.cat([k, mha.bias_k.to(k.dtype).view(1, h, 1, d_k).expand(b, h, 1, d_k)], dim=2)
        extra += 1
    if mha.add_zero_attn:
        k = torch.cat([k, k.new_zeros(b, h, 1, d_k)], dim=2)
        extra += 1
    return k, extra


def _adapt_mha(name: str, module: nn.Module, index: int) -> AttentionLayer | None:
    return (
        MultiheadAttentionLayer(name, module, index)
        if isinstance(module, nn.MultiheadAttention)
        else None
    )


register_family("torch", _adapt_mha, priority=20, looked_for="torch.nn.MultiheadAttention")

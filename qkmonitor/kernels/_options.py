"""The options of one attention call, as the backends receive them."""

from __future__ import annotations

import dataclasses

import torch

#: ``attention``'s ``pv_rounding``: how the softmax weights are rounded before ``P·V``
#: (docs/kernel.md, "Rounding of the softmax weights").
PV_ROUNDINGS = ("auto", "float32", "kernel", "unbiased")


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionOptions:
    """What ``attention`` passes to a backend besides q, k, v: validated and normalized.

    Attributes:
        causal: query i attends key j only when ``j ≤ i + M − N`` (bottom-right aligned).
        key_padding_mask: (B, M) bool, True where the key may be attended, or None.
        scale: the factor on ``q · k``.
        return_stats: also compute the statistics.
        sink_tokens: number of leading keys whose attention mass is reported (0 for none).
        pv_rounding: how the weights ``p = e^{s − m}`` meet the values in ``P·V`` (each backend
            resolves "auto": ``attention``'s docstring): "float32" (not rounded: the exact
            reference), "kernel" (rounded to the values' dtype, accumulated in float32, as
            FlashAttention's GPU kernels do; the output then leans toward the values' common
            direction where keys tie near a row's max) or "unbiased" (rounded once, and the row
            sum, the output and the statistics all use the rounded weights, so that a direction
            common to the values passes unrounded). For float32 and float64 values the three are
            the same computation.
    """

    causal: bool
    key_padding_mask: torch.Tensor | None
    scale: float
    return_stats: bool
    sink_tokens: int
    pv_rounding: str = "float32"

    def weight_rounding(self, dtype: torch.dtype, auto: str) -> tuple[torch.dtype, bool] | None:
        """How a backend rounds the weights of ``dtype`` values: None (not at all), or the dtype
        they are rounded to and whether the row sum and statistics use the rounded weights
        ("unbiased"); ``auto`` is the backend's choice for "auto"."""
        mode = auto if self.pv_rounding == "auto" else self.pv_rounding
        if mode == "float32" or dtype not in (torch.float16, torch.bfloat16):
            return None
        return dtype, mode == "unbiased"

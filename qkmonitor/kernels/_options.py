"""The options of one attention call, as the backends receive them."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionOptions:
    """What ``attention`` passes to a backend besides q, k, v: validated and normalized.

    Attributes:
        causal: query i attends key j only when ``j ≤ i + M − N`` (bottom-right aligned).
        key_padding_mask: (B, M) bool, True where the key may be attended, or None.
        scale: the factor on ``q · k``.
        return_stats: also compute the statistics.
        sink_tokens: number of leading keys whose attention mass is reported (0 for none).
    """

    causal: bool
    key_padding_mask: torch.Tensor | None
    scale: float
    return_stats: bool
    sink_tokens: int

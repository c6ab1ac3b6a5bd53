"""Additive positional encodings: sinusoidal and learned, added to the residual stream ``x``
(B, N, d).

References:
    - Vaswani et al. 2017, "Attention Is All You Need" (sinusoidal encodings).

Every table is built in float64 and stored as float32.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qkmonitor.validation import check_positive_int, check_real

__all__ = ["LearnedPositionalEmbedding", "PositionalEncoding", "sinusoidal_encoding"]


def sinusoidal_encoding(
    num_positions: int, dim: int, base: float = 10_000.0, dtype: torch.dtype = torch.float32
) -> Tensor:
    r"""The fixed sinusoidal table of Vaswani et al.

    .. math::
        PE[t, 2i] = \sin(t / base^{2i/dim}), \qquad PE[t, 2i+1] = \cos(t / base^{2i/dim})

    Each (sin, cos) column pair is a point on the unit circle turning at frequency
    ``ω_i = base^{-2i/dim}``, so ``PE[t + k]`` is ``PE[t]`` rotated by ``k·ω_i`` in every pair.
    An odd ``dim`` is served by truncation: the table is built for ``dim + 1`` columns' worth of
    frequencies (still with exponent ``2i/dim``) and the last (cosine) column is dropped, so the
    final column is an unpaired sine.

    Args:
        num_positions: number of rows (positions ``0 .. num_positions - 1``).
        dim: number of columns (the model width); any positive int.
        base: the wavelength base (> 1); wavelengths run from ``2π`` to about ``2π·base``.
        dtype: dtype of the result; the table is computed in float64.

    Returns:
        Tensor of shape ``(num_positions, dim)`` with values in ``[-1, 1]``.

    Raises:
        ValueError: if ``num_positions`` or ``dim`` is not a positive int, or ``base`` is not > 1.
    """
    check_positive_int("num_positions", num_positions)
    check_positive_int("dim", dim)
    check_real("base", base, above=1)
    n_freq = (dim + 1) // 2
    freq = float(base) ** (-torch.arange(n_freq, dtype=torch.float64) * 2 / dim)  # (dim/2,)
    angles = torch.arange(num_positions, dtype=torch.float64)[:, None] * freq  # (T, dim/2)
    table = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # sin, cos interleaved
    return table[:, :dim].to(dtype)


class PositionalEncoding(nn.Module):
    """Adds the sinusoidal table of :func:`sinusoidal_encoding` to the residual stream.

    ``y = x + PE[:N]`` for ``x`` of shape (B, N, dim). The table is a non-persistent buffer: it is
    rebuilt from the arguments, never saved in a checkpoint. Dropout is left to the caller.

    Args:
        dim: model width (last dim of ``x``).
        max_len: longest sequence served.
        base: wavelength base, see :func:`sinusoidal_encoding`.

    Raises:
        ValueError: for bad arguments, and in ``forward`` when ``x`` is longer than ``max_len`` or
            its last dim is not ``dim``.

    Example::

        >>> pe = PositionalEncoding(dim=8, max_len=16)
        >>> pe(torch.zeros(2, 5, 8)).shape
        torch.Size([2, 5, 8])
    """

    def __init__(self, dim: int, max_len: int = 5000, base: float = 10_000.0) -> None:
        super().__init__()
        self.dim, self.max_len, self.base = dim, max_len, base
        self.register_buffer(
            "pe", sinusoidal_encoding(max_len, dim, base), persistent=False
        )  # (L, dim)

    def forward(self, x: Tensor) -> Tensor:
        """Return ``x + PE[:N]``; ``x`` is (B, N, dim) (any leading dims), result in ``x.dtype``."""
        _check_sequence_input(x, self.dim, self.max_len)
        return x + self.pe[: x.shape[-2]].to(x.dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, max_len={self.max_len}, base={self.base}"


class LearnedPositionalEmbedding(nn.Module):
    """Adds a trained table ``W`` (max_len, dim): ``y = x + W[:N]`` for ``x`` (B, N, dim).

    Initialised ``N(0, 0.02²)`` (GPT-2). Positions beyond ``max_len`` have no row, so longer
    inputs are an error rather than silently wrapped.

    Args:
        max_len: number of learned positions.
        dim: model width.

    Raises:
        ValueError: for bad arguments, and in ``forward`` when ``N > max_len`` or the last dim of
            ``x`` is not ``dim``.
    """

    def __init__(self, max_len: int, dim: int) -> None:
        super().__init__()
        check_positive_int("max_len", max_len)
        check_positive_int("dim", dim)
        self.max_len, self.dim = max_len, dim
        self.weight = nn.Parameter(torch.empty(max_len, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        """Return ``x + W[:N]``; ``x`` is (B, N, dim) (any leading dims)."""
        _check_sequence_input(x, self.dim, self.max_len)
        return x + self.weight[: x.shape[-2]].to(x.dtype)

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, dim={self.dim}"


def _check_sequence_input(x: Tensor, dim: int, max_len: int) -> None:
    if x.dim() < 2 or x.shape[-1] != dim:
        raise ValueError(f"Expected `x` of shape (..., N, {dim}), got {tuple(x.shape)}")
    if x.shape[-2] > max_len:
        raise ValueError(f"Sequence length {x.shape[-2]} exceeds `max_len` {max_len}")

"""Axial RoPE for tokens on an n-dimensional grid (2-D image patches, 3-D video): each axis
rotates its own slice of the head dim, as 1-D RoPE (:mod:`qkmonitor.models.rope`) does.

References:
    - Heo et al. 2024, "Rotary Position Embedding for Vision Transformer" (axial 2-D RoPE).

Every table is built in float64 and stored as float32; rotations run in the input's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qkmonitor.validation import check_positive_int

from .rope import apply_rotary_pos_emb, cos_sin_tables, rope_inv_freq

__all__ = ["NDimensionalRoPE", "grid_coords"]


def grid_coords(*sizes: int) -> Tensor:
    """Integer coordinates of every cell of a grid, in row-major order (last axis fastest).

    Args:
        *sizes: the grid's size along each axis, e.g. ``(H, W)`` or ``(T, H, W)``.

    Returns:
        LongTensor of shape ``(prod(sizes), len(sizes))``; row ``r`` holds the multi-index of the
        r-th cell of ``torch.arange(prod(sizes)).view(*sizes)``.

    Raises:
        ValueError: if no size is given or a size is not a positive int.

    Example::

        >>> grid_coords(2, 3).tolist()
        [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    """
    if not sizes:
        raise ValueError("Expected at least one grid size in `sizes`")
    for size in sizes:
        check_positive_int("sizes", size)
    axes = torch.meshgrid(*(torch.arange(s) for s in sizes), indexing="ij")
    return torch.stack([a.reshape(-1) for a in axes], dim=-1)


class NDimensionalRoPE(nn.Module):
    r"""Axial RoPE for tokens on an n-dimensional grid (2-D image patches, 3-D video).

    The head dim D is split into n equal, contiguous slices of :math:`d_a = D / n` dims, one per
    axis. Slice a is rotated like 1-D RoPE (:class:`RotaryEmbedding`, same ``interleaved``
    layout within the slice) by the token's coordinate :math:`c_a` along axis a, with
    frequencies :math:`θ_{a,i} = base^{-2i/d_a}`, ``i = 0 .. d_a/2 − 1``. Hence

    .. math:: \langle R(c) q, R(c') k \rangle = \sum_a \langle q_a, R_a(c'_a - c_a) k_a \rangle

    depends only on the per-axis offsets ``c' − c``: shifting every coordinate of one axis leaves
    all scores unchanged.

    Args:
        head_dim: D; must be divisible by the number of axes n, and ``D / n`` must be even.
        axes_max_len: the grid size bound per axis, e.g. ``(14, 14)`` or ``(8, 16, 16)``;
            coordinate ``c_a`` must lie in ``[0, axes_max_len[a])``.
        base: the RoPE base (> 1), shared by all axes.
        interleaved: pair layout inside each axis slice (see :func:`apply_rotary_pos_emb`).

    Raises:
        ValueError: for an empty ``axes_max_len`` or a non-positive length, or when ``head_dim``
            does not split into even per-axis slices.

    Example::

        >>> rope = NDimensionalRoPE(head_dim=16, axes_max_len=(4, 4))
        >>> coords = grid_coords(4, 4)  # (16, 2)
        >>> q, k = rope(torch.randn(1, 2, 16, 16), torch.randn(1, 2, 16, 16), coords)
        >>> q.shape
        torch.Size([1, 2, 16, 16])
    """

    def __init__(
        self,
        head_dim: int,
        axes_max_len: tuple[int, ...],
        base: float = 10_000.0,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        axes_max_len = tuple(axes_max_len)
        if not axes_max_len:
            raise ValueError("Expected `axes_max_len` to name at least one axis, got ()")
        for length in axes_max_len:
            check_positive_int("axes_max_len", length)
        check_positive_int("head_dim", head_dim)
        n_axes = len(axes_max_len)
        if head_dim % n_axes or (head_dim // n_axes) % 2:
            raise ValueError(
                f"Expected `head_dim` ({head_dim}) to split into {n_axes} axes of an even number "
                f"of dims each (head_dim divisible by 2 * {n_axes} = {2 * n_axes})"
            )
        self.head_dim, self.axes_max_len, self.base = head_dim, axes_max_len, base
        self.interleaved, self.n_axes, self.axis_dim = bool(interleaved), n_axes, head_dim // n_axes
        self.inv_freq = rope_inv_freq(
            self.axis_dim, base
        )  # (d_a/2,) float64, the same for every axis
        cos, sin = cos_sin_tables(torch.arange(max(axes_max_len)), self.inv_freq)  # (L_max, d_a/2)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_buffer("_max_len", torch.tensor(axes_max_len), persistent=False)

    def forward(self, q: Tensor, k: Tensor, coords: Tensor) -> tuple[Tensor, Tensor]:
        """Rotate ``q`` (B, H, N, D) and ``k`` (B, H_kv, N, D) by their tokens' grid coordinates.

        Args:
            q: queries (..., N, D).
            k: keys (..., N, D), the same N tokens.
            coords: LongTensor (N, n_axes), token r at grid cell ``coords[r]`` (see
                :func:`grid_coords`). Checking the bounds reads the tensor on the host.

        Returns:
            ``(q_rotated, k_rotated)`` in the inputs' shapes and dtypes.

        Raises:
            ValueError: for a wrong head dim, lengths that differ from ``coords``, or coordinates
                that are not integers in ``[0, axes_max_len[a])``.
        """
        for name, t in (("q", q), ("k", k)):
            if t.dim() < 2 or t.shape[-1] != self.head_dim:
                raise ValueError(
                    f"Expected `{name}` of shape (..., N, {self.head_dim}), got {tuple(t.shape)}"
                )
        coords = self._check_coords(coords, q.shape[-2], k.shape[-2])
        cos, sin = self.cos[coords], self.sin[coords]  # (N, n, d_a/2): all axes share one table
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x_axes = x.unflatten(-1, (self.n_axes, self.axis_dim))  # (..., N, n, d_a)
        return apply_rotary_pos_emb(x_axes, cos, sin, self.interleaved).flatten(-2)

    def _check_coords(self, coords: Tensor, n: int, m: int) -> Tensor:
        if (
            not isinstance(coords, Tensor)
            or coords.is_floating_point()
            or coords.is_complex()
            or (coords.dtype == torch.bool)
        ):
            raise ValueError(
                f"Expected `coords` to be an integer tensor of shape (N, {self.n_axes})"
            )
        if coords.dim() != 2 or coords.shape[1] != self.n_axes or coords.shape[0] != n or n != m:
            raise ValueError(
                f"Expected `coords` of shape (N, {self.n_axes}) with N the length of q and k, "
                f"got coords {tuple(coords.shape)}, q length {n}, k length {m}"
            )
        coords = coords.to(device=self.cos.device, dtype=torch.long)
        if coords.numel() and bool(((coords < 0) | (coords >= self._max_len)).any()):
            raise ValueError(
                f"Expected `coords[:, a]` in [0, axes_max_len[a]), "
                f"`axes_max_len`={self.axes_max_len}"
            )
        return coords

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, axes_max_len={self.axes_max_len}, base={self.base}, "
            f"interleaved={self.interleaved}"
        )

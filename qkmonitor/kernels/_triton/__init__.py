"""Fused attention with in-kernel row statistics in Triton (FlashAttention-2 forward and backward).

- ``tiles``: the ``@triton.jit`` helpers the kernels share: a tile's load and store, the
  attention mask, the key blocks of a query block.
- ``forward``: the forward kernel, with the online statistics (the algorithm in its docstring).
- ``backward``: the δ, dK/dV and dQ kernels.
- ``tuning``: the autotuned tile configurations, their pruning, and the launcher (one small tile
  under the interpreter).
- ``autograd``: the ``torch.autograd.Function`` and ``triton_attention``, the backend's entry
  point. Under the interpreter bfloat16 is computed in float32, because the interpreter's
  bfloat16 arithmetic is wrong.

Reference: Tri Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning", 2023; Triton's fused-attention tutorial for the structure.
"""

from qkmonitor.kernels._triton.autograd import triton_attention

__all__ = ["triton_attention"]

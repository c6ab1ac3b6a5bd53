"""Batches of small CPU problems solved on several Python threads.

torch solves a batch of small LAPACK problems (``eigvalsh``, ``eigvals``) one after another on one
core, whatever its intra-op thread count; split into chunks on Python threads of their own (torch
releases the GIL), they keep every core busy. Used by :mod:`qkmonitor.layer_spectra` (the W_QK
spectra) and :func:`qkmonitor.functional.gram_singular_values` (the effective ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

__all__ = ["on_threads"]

T = TypeVar("T")


def on_threads(solve: Callable[[slice], T], chunks: list[slice]) -> list[T]:
    """``[solve(c) for c in chunks]``, on ``torch.get_num_threads()`` Python threads when several.

    Each chunk runs single-threaded inside (matmuls and LAPACK alike): torch solves a batch of small
    LAPACK problems one after another on one core, and chunks on separate threads (torch releases
    the GIL) keep every core busy through the products and the solvers alike. torch's intra-op
    thread count is process-wide, so it is 1 while the chunks run and restored after.
    """
    if len(chunks) == 1:
        return [solve(chunks[0])]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            return list(pool.map(solve, chunks))
    finally:
        torch.set_num_threads(threads)

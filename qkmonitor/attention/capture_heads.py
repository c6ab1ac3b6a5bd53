"""Where an intercepted call's heads are, and what mixes them before its softmax.

Two questions the capture (:mod:`.capture_call`) asks of the tensors it sees, by their shapes and
strides and the equations that made them, never by a module's name:

- **which dim holds the heads** (:func:`heads_dim`) of queries or logits with more than one dim
  before the heads' rows: timm Twins' ``(B, windows, H, N, D)`` holds them third from the end,
  timm NesT's ``(B, H, blocks, N, D)`` second. The layer's head count tells them apart where one
  dim alone has its size; where several do (as many blocks as heads), the heads are the dim cut
  from a token's features (a stride below the rows'), as a projection's output viewed by head
  has them; where that does not tell either, the call is refused by name.
- **which ops mix the heads of the logits** between ``q·kᵀ`` and the softmax (talking heads):
  a Linear over the heads (timm CaiT's ``proj_l``), a convolution whose output channels read more
  than one head (EfficientFormerV2's and x-transformers' 1×1 talking heads), an ``einsum`` that
  sums over the heads (:class:`HeadsMixed`). A softmax over logits so mixed is refused by name.

And the ``q·kᵀ`` an ``einsum`` computes (:func:`einsum_qk`, x-transformers' scores), which the
capture reads as it reads ``q @ kᵀ``; and where a tensor-parallel rank's heads are among the
layer's, from how the forward's projections are split across ranks (:func:`placement_of`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from qkmonitor.attention.calls import TENSOR_PARALLEL
from qkmonitor.measures.sharding import HeadPlacement, RowShard

#: the first query rows of logits kept to measure the factor on q·kᵀ (as many as
#: :func:`~qkmonitor.attention.layout_check.product_scale` reads)
SCALE_ROWS = 8


def heads_dim(x: Tensor, heads: int | None) -> int | str:
    """The dim of ``(..., H, N, D)`` queries (or ``(..., H, N, M)`` logits) that holds the layer's
    ``heads`` heads, counted from the end (-3 for ``(B, H, N, D)``, Twins' windows); or why it
    cannot be told. Dim 0 is the batch. Where no count is known, or no dim before the rows has
    its size, the heads are taken third from the end (the documented convention)."""
    if x.dim() <= 4 or heads is None:
        return -3
    found = [d for d in range(1, x.dim() - 2) if x.shape[d] == heads]
    if len(found) > 1:  # e.g. NesT's (B, H, T, N, D) with T = H: the heads are cut from features
        inner = [d for d in found if 0 < x.stride(d) < x.stride(-2)]
        if len(inner) != 1:
            return (
                f"its queries of shape {tuple(x.shape)} hold {heads} (its head count) in dims "
                f"{found}, and their strides do not tell which holds its heads"
            )
        found = inner
    return found[0] - x.dim() if found else -3


def heads_third(x: Tensor, dim: int) -> Tensor:
    """``x`` with its heads (``dim``, from the end) moved third from the end, before the rows."""
    return x if dim == -3 else x.movedim(dim, -3)


def broadcast_to_dims(x: Tensor, dims: int) -> Tensor:
    """``x`` with leading dims of 1 up to ``dims`` dims (as broadcasting aligns it)."""
    return x[(None,) * (dims - x.dim())] if x.dim() < dims else x


@dataclass
class HeadsMixed:
    """An op that mixed the heads of logits before a softmax.

    Attributes:
        how: what mixed them, for the warning.
        shape: the mixed logits' shape with the heads third from the end ``(..., H', N, M)``.
        rows: the first query rows of the logits the op mixed, ``(B, H, n, M)``, or None; with
            ``qk``, the ``q·kᵀ`` before them, they tell the factor on each head's own q·kᵀ.
        qk: the queries and keys ``(B, H, N, D)``, ``(B, H_kv, M, D)`` of that ``q·kᵀ``, or None.
    """

    how: str
    shape: tuple[int, ...]
    rows: Tensor | None
    qk: tuple[Tensor, Tensor] | None

    def feeds(self, logits: Tensor) -> bool:
        """Whether ``logits`` (a softmax's, any layout of the same rows) are the mixed ones."""
        return tuple(logits.shape[-2:]) == self.shape[-2:] and logits.numel() == math.prod(
            self.shape
        )


def _rows(logits: Tensor) -> Tensor | None:
    """The first query rows of ``(B, H, N, M)`` logits, copied (a later in-place change is not
    theirs); None for other shapes."""
    return logits.detach()[..., :SCALE_ROWS, :].clone() if logits.dim() == 4 else None


def _like_product(x: Tensor, product: Tensor | None) -> bool:
    """Whether ``x`` ``(..., H, N, M)`` may be the logits of the latest ``q·kᵀ`` (its shape), or
    any logits where none was seen."""
    return product is None or tuple(x.shape) == tuple(product.shape)


def linear_mixes(x: Tensor, weight: Tensor, product: Tensor | None, qk) -> HeadsMixed | None:
    """A Linear over the heads of the latest ``q·kᵀ``, its logits permuted to ``(B, N, M, H)``
    (timm CaiT's ``proj_l``). Where no ``q·kᵀ`` was seen, a Linear over a 4-D input is not taken
    for one (a projection of per-pair features, as ConViT's ``pos_proj``, is one too)."""
    if product is None or x.dim() != 4 or weight.dim() != 2 or weight.shape[-1] < 2:
        return None
    logits = x.movedim(-1, -3)
    if not _like_product(logits, product):
        return None
    how = f"talking heads: a Linear over the {x.shape[-1]} heads of q·kᵀ, as CaiT's proj_l"
    mixed = (*logits.shape[:-3], weight.shape[0], *logits.shape[-2:])  # its output, heads third
    return HeadsMixed(how, mixed, _rows(logits), qk)


def conv_mixes(args: tuple, kwargs: dict, out, product: Tensor | None, qk) -> HeadsMixed | None:
    """``F.conv2d(input, weight, bias, stride, padding, dilation, groups)`` over ``(B, H, N, M)``
    logits whose output channels read more than one head (``groups < H``): 1×1 talking heads."""
    call = dict(zip(("input", "weight", "bias", "stride", "padding", "dilation", "groups"), args))
    call |= kwargs
    x, groups = call.get("input"), call.get("groups", 1)
    if not (isinstance(x, Tensor) and isinstance(out, Tensor) and x.dim() == 4 == out.dim()):
        return None
    heads = x.shape[1]
    if heads < 2 or not isinstance(groups, int) or groups >= heads or not _like_product(x, product):
        return None
    how = f"talking heads: a convolution over the {heads} heads of q·kᵀ"
    return HeadsMixed(how, tuple(out.shape), _rows(x), qk)


def einsum_labels(args: tuple) -> tuple[list[list[str]], list[str], list[Tensor]] | None:
    """``torch.einsum(equation, *operands)`` (or its operands in one list): each operand's label
    per dim, the output's, and the operands; ``...`` as one label per dim it covers, aligned from
    the right. None for another form (sublists) or an equation that does not fit the operands."""
    if not args or not isinstance(args[0], str):
        return None
    listed = len(args) == 2 and isinstance(args[1], list | tuple)
    operands = list(args[1] if listed else args[1:])
    if not all(isinstance(x, Tensor) for x in operands):
        return None
    equation = args[0].replace(" ", "")
    inputs, arrow, output = equation.partition("->")
    terms = inputs.split(",")
    if len(terms) != len(operands):
        return None
    labels = [_labels(term, x.dim()) for term, x in zip(terms, operands)]
    if any(label is None for label in labels):
        return None
    if arrow:
        spread = max(x.dim() - len(t.replace("...", "")) for t, x in zip(terms, operands))
        out = _labels(output, len(output.replace("...", "")) + (spread if "..." in output else 0))
    else:  # implicit: the ellipsis' dims, then the labels seen once, in order
        seen = [label for term in labels for label in term]
        out = sorted({lb for lb in seen if lb.startswith("…")}, key=lambda lb: -int(lb[1:]))
        out += sorted(lb for lb in set(seen) if not lb.startswith("…") and seen.count(lb) == 1)
    return (labels, out, operands) if out is not None else None


def _labels(term: str, dims: int) -> list[str] | None:
    """One label per dim of an operand of ``dims`` dims; ``...``'s as ``…k``, k counted from the
    ellipsis' last dim (broadcasting aligns them from there)."""
    head, ellipsis, tail = term.partition("...")
    if not ellipsis:
        return list(term) if len(term) == dims else None
    covered = dims - len(head) - len(tail)
    if covered < 0:
        return None
    return [*head, *(f"…{k}" for k in range(covered - 1, -1, -1)), *tail]


def einsum_qk(parsed) -> tuple[Tensor, Tensor] | None:
    """The queries ``(..., H, N, D)`` and keys ``(..., H_kv, M, D)`` of an ``einsum`` that is a
    ``q·kᵀ`` (``'b h i d, b h j d -> b h i j'``; keys of one head as ``'b j d'``), or None."""
    if parsed is None or len(parsed[0]) != 2:
        return None
    (a, b), out, (q, k) = parsed
    if len(a) < 4 or len(b) < 3 or a[-1] != b[-1] or a[-1] in out or a[-2] == b[-2]:
        return None
    if out != [*a[:-1], b[-2]]:
        return None
    if b[:-2] == a[:-2]:
        return q, k
    if b[:-2] == a[:-3]:  # keys without a heads dim: one key head for all
        return q, k.unsqueeze(-3)
    return None


def einsum_mixes(parsed, out, product: Tensor | None, qk) -> HeadsMixed | None:
    """An ``einsum`` that sums over the heads of ``(..., H, N, M)`` logits while it keeps their
    rows and keys (``'b h i j, h g -> b g i j'``), or None."""
    if parsed is None or not isinstance(out, Tensor):
        return None
    labels, out_labels, operands = parsed
    if len(out_labels) != out.dim():
        return None
    for term, x in zip(labels, operands):
        if len(term) < 4 or x.shape[-3] < 2 or not _like_product(x, product):
            continue
        h, i, j = term[-3:]
        if h in out_labels or i not in out_labels or j not in out_labels or i == j:
            continue
        kept = [d for d, label in enumerate(out_labels) if label not in (i, j)]
        order = [*kept, out_labels.index(i), out_labels.index(j)]
        how = f"talking heads: an einsum that sums over the {x.shape[-3]} heads of q·kᵀ"
        return HeadsMixed(how, tuple(out.permute(order).shape), _rows(x), qk)
    return None


def mixed_reason(how: str) -> str:
    """Why a softmax over logits whose heads were mixed (``how``) is not measured."""
    return (
        f"it mixes its heads' logits before the softmax ({how}), so a head's softmax is not over "
        "its own queries' and keys' logits: its attention statistics are not measured, while "
        "its kappa, of its own W_Q^h W_K^hᵀ, is a property of the weights (read where they are "
        "found)"
    )


#: why a forward's two softmaxes, of content and of positions, are not measured
GATED = (
    "it computes two softmaxes over the same queries' keys in one forward, one over its q·kᵀ "
    "and one over logits no q·kᵀ gave (content and position attention, as ConViT's GPSA, which "
    "mixes them by a gate), so neither is the attention it applies: its attention statistics "
    "are not measured, while its kappa, of its own W_Q^h W_K^hᵀ, is a property of the weights "
    "(read where they are found)"
)


def over_channels(
    q: Tensor, k: Tensor, tokens: set[int], widths: set[int]
) -> tuple[str, str] | None:
    """Why a q·kᵀ of (..., H, R, D) queries is over channels, not tokens, with what it means
    for the weights; None when it is not: its rows are the head width of a projection
    (R = C/H, C among the projections' input ``widths``) and the dim it contracts is the
    projections' ``tokens`` (D = N), as in XCiT's cross-covariance attention. Where R = D no
    shape tells them apart: read as tokens."""
    heads, rows, width = q.shape[-3], q.shape[-2], q.shape[-1]
    if rows == width or width not in tokens:
        return None
    if not any(c % heads == 0 and c // heads == rows for c in widths):
        return None
    reason = (
        "its softmax is over channels, not tokens (cross-covariance attention, as XCiT's XCA: "
        f"q·kᵀ contracts the {width} tokens, its rows are the {rows} channels of a head), so "
        "it has no attention over tokens to measure"
    )
    no_layout = (
        "its attention is over channels (cross-covariance attention, as XCiT's XCA: q·kᵀ "
        "contracts the tokens), so there is no W_QK over tokens to read"
    )
    return reason, no_layout


def placement_of(shards: dict[int, RowShard | str], heads: int | None) -> HeadPlacement | str:
    """Where this rank's ``heads`` query heads are among the layer's, from how the forward's
    projections are split across ranks (every split projection in equal chunks, all alike: the
    query heads of chunk c are ``c·heads ..``); else why they cannot be placed."""
    refused = [s for s in shards.values() if isinstance(s, str)]
    splits = {(s.index, s.ranks) for s in shards.values() if isinstance(s, RowShard)}
    if not refused and heads is not None and len(splits) > 1:
        refused = [f"its projections are split in different ways across ranks ({sorted(splits)})"]
    if not refused and heads is None:
        refused = ["its attention call's heads are not known"]
    if refused:
        return (
            f"its projections are sharded by rows across ranks ({TENSOR_PARALLEL}), and "
            f"{refused[0]}; its attention statistics are not measured"
        )
    (index, ranks), *_ = splits
    return HeadPlacement(index * heads, heads, ranks * heads)

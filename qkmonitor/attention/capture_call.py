"""What one intercepted forward captures (:class:`ForwardCapture`): the projections' inputs and
biases the layout check asks for, the queries and keys of ``q @ kᵀ``, the additive masks going
into the logits, what the logits went through before the softmax (heads mixed, channels), how the
projections are split across ranks; and each attention call handed on to the channel's observers,
the first with the forward's layout evidence."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.nn.functional as F
from torch import Tensor

from qkmonitor.attention.calls import TENSOR_PARALLEL, ScoresCall, UnreadCall
from qkmonitor.attention.capture_builders import (
    flex_call,
    fold,
    folded,
    scores_call,
    sdpa_call,
)
from qkmonitor.attention.context_parallel import context_parallel_reason, first_chunk, local
from qkmonitor.attention.layout_check import LayoutEvidence, product_scale
from qkmonitor.attention.masks import AdditiveMasks
from qkmonitor.attention.probes import AttentionCall
from qkmonitor.attention.route import observed
from qkmonitor.measures.sharding import HeadPlacement, RowShard, row_shard

if TYPE_CHECKING:  # the channel makes each forward's capture: a type named here only
    from qkmonitor.attention.capture import InterceptChannel

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
#: flex_attention's arguments after (query, key, value)
_FLEX_ARGS = ("score_mod", "block_mask", "scale", "enable_gqa")


def _watched(channel: InterceptChannel) -> set[int]:
    """The ids of the weights the channel's layout probes ask for, as the module holds them now."""
    watch: set[int] = set()
    for sources in channel.sources.values():
        try:
            weights = sources()
        except Exception:  # noqa: BLE001 -- no evidence then; the check says so, training goes on
            weights = []
        watch.update(id(weight) for weight in weights)
    return watch


class ForwardCapture:
    """What one forward of an intercepted module captures: the projections' inputs the layout
    check asks for, the first ``q @ kᵀ`` (an explicit softmax's queries and keys), the additive
    masks added to logits (:mod:`.masks`), what happened to the logits before the softmax (their
    heads mixed), the token counts and widths the projections saw, and whether an attention call
    was already handed on (the first carries the layout evidence)."""

    def __init__(self, channel: InterceptChannel) -> None:
        self.channel = channel
        #: ids of the weights whose inputs are kept (the objects of this forward)
        self.watch = _watched(channel)
        self.inputs: dict[int, Tensor] = {}
        self.biases: dict[int, Tensor] = {}  # the bias each projection's call added, where one did
        self.first = True
        self.qk: tuple[Tensor, Tensor] | None = None  # the first q @ kᵀ: its q and k
        self.last_qk: tuple[Tensor, Tensor] | None = None  # the latest q @ kᵀ before a softmax
        self.product: Tensor | None = None  # the latest q @ kᵀ's result (logits to come)
        self.product_version: int | None = None  # its version counter when the matmul made it
        self.mixed: str | None = None  # how the logits' heads were mixed, before the softmax
        #: the heads were mixed from the product as the matmul gave it (no factor after it), or
        #: why that is not known (it was changed in place first)
        self.mixed_unscaled: str | None = None
        self.tokens: set[int] = set()  # the sequence lengths of the projections' inputs
        self.widths: set[int] = set()  # and their widths
        self.masks = AdditiveMasks()
        self.in_kernel = False  # inside an observed kernel: its own ops are not the module's
        self.unread: list[str] = []  # attention-like calls seen but not read, and why
        #: id(weight) -> how the projections' weights, as the forward computes with them, are
        #: split by output features across ranks (tensor parallelism: a ``RowShard``), or why
        #: that split cannot be read by head
        self.shards: dict[int, RowShard | str] = {}

    def unread_reason(self) -> str:
        """Why this forward gave nothing to read: the calls seen and what was missing, or that
        none of the calls qkmonitor reads was made."""
        if self.unread:
            return "; ".join(dict.fromkeys(self.unread))
        return (
            "its forward called none of F.scaled_dot_product_attention, flex_attention or a "
            "softmax over the keys of (B, H, N, M) or (B·H, N, M) scores (another kernel, e.g. "
            "xformers' or flash-attn's, is not read)"
        )

    def on_flex(self, query, key, args: tuple, kwargs: dict) -> None:
        """``flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa, ...)``:
        the scores as flex computes them (its score_mod and block mask applied)."""
        flex = dict(zip(_FLEX_ARGS, args)) | kwargs
        refused = context_parallel_reason(query, key)
        if refused is not None:
            self._refuse_split(refused, query, key, flex.get("scale"))
            return
        if not (isinstance(query, Tensor) and isinstance(key, Tensor) and query.dim() == 4):
            self.unread.append("a flex_attention call whose queries are not (B, H, N, D)")
            return
        scale = flex.get("scale")
        self._notify(
            lambda: flex_call(query, key, flex.get("score_mod"), flex.get("block_mask"), scale),
            lambda: self._evidence(query, key, None, scale),
            heads=query.shape[1],
        )

    def on_projection(self, func, args, kwargs) -> None:
        """``F.linear(input, weight, bias)`` and ``addmm(input, mat1, mat2)`` (GPT-2's Conv1D:
        ``addmm(bias, x, weight)``), their arguments given by position or by keyword; the bias the
        call adds is kept with the input (a module may assemble it in the forward, as BEiT's
        ``cat(q_bias, zeros, v_bias)``). A Linear over the heads of the logits (talking heads)
        mixes them."""
        if func is F.linear:
            call = dict(zip(("input", "weight", "bias"), args)) | kwargs
            x, weight, bias = call.get("input"), call.get("weight"), call.get("bias")
        else:
            call = dict(zip(("input", "mat1", "mat2"), args)) | kwargs
            x, weight, bias = call.get("mat1"), call.get("mat2"), call.get("input")
        shard = row_shard(weight, 0 if func is F.linear else 1)
        if shard is not None:
            self.shards[id(weight)] = shard
        if not isinstance(x, Tensor):
            return
        product = self.product
        if product is not None and x.shape[-1] == product.shape[-3] and _same_storage(x, product):
            self.mixed = (
                f"talking heads: a Linear over the {product.shape[-3]} heads of q·kᵀ, as CaiT's "
                "proj_l"
            )
            self.mixed_unscaled = self._changed_in_place(product)
            return
        if x.dim() >= 3:
            self.tokens.add(x.shape[-2])
            self.widths.add(x.shape[-1])
        watched = isinstance(weight, Tensor) and id(weight) in self.watch
        if watched and id(weight) not in self.inputs:
            self.inputs[id(weight)] = _replicated(x).detach()
            if isinstance(bias, Tensor) and bias.dim() == 1:
                self.biases[id(weight)] = bias.detach()

    def on_conv(self, x) -> None:
        """A convolution whose channels are the heads of the logits mixes them (x-transformers'
        1×1 talking heads)."""
        product = self.product
        if (
            isinstance(x, Tensor)
            and product is not None
            and x.dim() == 4
            and x.shape[1] == product.shape[-3]
            and _same_storage(x, product)
        ):
            self.mixed = f"talking heads: a convolution over the {x.shape[1]} heads of q·kᵀ"
            self.mixed_unscaled = self._changed_in_place(product)

    def _changed_in_place(self, product: Tensor) -> str | None:
        """None where the latest ``q @ kᵀ`` is as the matmul gave it (its version counter
        unchanged: the heads are mixed from it with no factor after the product); else why the
        factor after the product is not known."""
        version = _version(product)
        if version is not None and version == self.product_version:
            return None
        return (
            "its q @ kᵀ was changed in place before its heads were mixed, so the factor on a "
            "head's own q·kᵀ is not known"
        )

    def on_matmul(self, a, b, out) -> None:
        """``x @ W.T`` (a projection written as a matmul, e.g. Falcon's) and ``q @ kᵀ`` of
        (..., H, N, D) queries (the queries and keys of an explicit softmax, the first kept for
        the layout check)."""
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
            return
        if self.watch:
            weight = b if id(b) in self.watch else b._base
            if weight is not None and id(weight) in self.watch:
                self.inputs.setdefault(id(weight), a.detach())
                return
        if a.dim() >= 4 and b.dim() == a.dim() and a.shape[-1] == b.shape[-2]:
            self.last_qk = (a.detach(), b.detach().transpose(-1, -2))
            self.qk = self.qk or self.last_qk
            self.product = out.detach() if isinstance(out, Tensor) else None
            self.product_version = None if self.product is None else _version(self.product)

    def on_sdpa(self, args, kwargs) -> None:
        sdpa = dict(zip(_SDPA_ARGS, args)) | kwargs
        q, k = sdpa["query"], sdpa["key"]
        refused = context_parallel_reason(q, k)
        if refused is not None:
            self._refuse_split(refused, q, k, sdpa.get("scale"))
            return
        if isinstance(q, Tensor) and isinstance(k, Tensor) and q.dim() >= 4:
            refused = self._over_channels(q, k)
            if refused is not None:
                self._refuse(*refused)
                return
        self._notify(
            lambda: sdpa_call(
                q, k, sdpa.get("attn_mask"), bool(sdpa.get("is_causal", False)), sdpa.get("scale")
            ),
            lambda: self._evidence(fold(q), fold(k), None, sdpa.get("scale")),
            heads=q.shape[-3] if isinstance(q, Tensor) and q.dim() >= 4 else None,
        )

    def on_softmax(self, args, kwargs) -> None:
        """A softmax over the keys: of (B, H, N, M) logits (any leading dims before H folded into
        the batch), of (B, N, H, M) ones (heads in the third dim where the layer's head count says
        so), or of (B·H, N, M) ones split by the module's head count. The additive masks seen
        going into the logits block their keys."""
        x = args[0] if args else kwargs.get("input")
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if not isinstance(x, Tensor) or dim not in (-1, x.dim() - 1):
            return
        blocked = self.masks.blocked(x)
        self.masks.clear()
        mixed, self.mixed, self.product = self.mixed, None, None
        mixed_unscaled, self.mixed_unscaled = self.mixed_unscaled, None
        last_qk, self.last_qk = self.last_qk, None
        by_heads = self._heads_first(x, blocked)
        if by_heads is None:
            return
        x, blocked = by_heads
        if last_qk is not None and x.shape[-2] == last_qk[0].shape[-2]:
            refused = self._over_channels(*last_qk)
            if refused is not None:
                self._refuse(*refused)
                return
        if mixed is not None:
            self._refuse(_mixed_reason(mixed), None, mixed_unscaled)
            return
        self._read_scores(fold(x), None if blocked is None else fold(blocked))

    def _heads_first(
        self, x: Tensor, blocked: Tensor | None
    ) -> tuple[Tensor, Tensor | None] | None:
        """A softmax's logits and their blocked keys as (..., H, N, M): (B·H, N, M) split by the
        module's head count, (B, N, H, M) transposed where the layer's head count says so; None
        where they cannot be (why, in ``unread``, where they hold attention-like scores)."""
        heads = self.channel.heads
        if x.dim() == 3:
            split = heads or self.channel.split_heads
            if split is None or x.shape[0] % split:
                self.unread.append(
                    f"a softmax over the last dim of a 3-D tensor of shape {tuple(x.shape)}, whose "
                    "first dim could not be split into (batch, heads): "
                    + ("the module names no head count" if split is None else f"{split} heads")
                )
                return None
            x = x.view(x.shape[0] // split, split, *x.shape[1:])
            blocked = None if blocked is None else blocked.view(x.shape)
        elif x.dim() < 4:
            return None
        elif heads is not None and x.shape[-3] != heads:
            if x.dim() != 4 or x.shape[2] != heads:  # not (B, H, N, M) nor (B, N, H, M)
                self.unread.append(
                    f"a softmax over a tensor of shape {tuple(x.shape)}, in which no dim holds "
                    f"the layer's {heads} heads"
                )
                return None
            x = x.transpose(1, 2)
            blocked = None if blocked is None else blocked.transpose(1, 2)
        return x, blocked

    def _read_scores(self, x: Tensor, blocked: Tensor | None) -> None:
        """Hand on (B, H, N, M) logits a softmax got, with the forward's first ``q @ kᵀ`` as the
        layout evidence where it is theirs (the factor between the two: the logit scale), else
        the logits' own query 0, key 0."""
        qk = self.qk
        if qk is not None and folded(qk[0])[:3] == x.shape[:3] and qk[1].shape[-2] == x.shape[3]:
            self._notify(
                lambda: self._scores(x, blocked),
                lambda: self._evidence(
                    fold(qk[0]),
                    fold(qk[1]),
                    None,
                    *product_scale(fold(qk[0]), fold(qk[1]), x, blocked),
                ),
                heads=x.shape[1],
            )
            return
        self._notify(
            lambda: self._scores(x, blocked),
            lambda: self._evidence(None, None, x, None),
            heads=x.shape[1],
        )

    def _over_channels(self, q: Tensor, k: Tensor) -> tuple[str, str] | None:
        """Why a q·kᵀ of (..., H, R, D) queries is over channels, not tokens, with what it means
        for the weights; None when it is not: its rows are the head width of a projection
        (R = C/H) and the dim it contracts is the projections' tokens (D = N), as in XCiT's
        cross-covariance attention. Where R = D no shape tells them apart: read as tokens."""
        heads, rows, width = q.shape[-3], q.shape[-2], q.shape[-1]
        if rows == width or width not in self.tokens:
            return None
        if not any(c % heads == 0 and c // heads == rows for c in self.widths):
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

    def _refuse(self, reason: str, no_layout: str | None, scale_unknown: str | None = None) -> None:
        """Hand on a call that is not read, and why; ``no_layout``: why the weights are not read
        either (else the first call's evidence still checks them). The heads of a mixed product
        were mixed from ``q @ kᵀ`` as the matmul gave it: the factor on a head's own ``q·kᵀ`` is
        what its operands carry (1 after the product), unless ``scale_unknown`` says why not."""

        qk = self.qk
        evidence = (
            (lambda: self._evidence(fold(qk[0]), fold(qk[1]), None, 1.0, scale_unknown))
            if qk
            else None
        )
        self._notify(lambda: UnreadCall(reason, no_layout), None if no_layout else evidence)

    def _refuse_split(self, reason: str, q, k, scale) -> None:
        """Refuse a call whose keys are split across ranks (context parallelism) as
        :class:`UnreadCall` ``sharded``; its queries and keys, as the rank holding the sequence's
        first chunk computed them, still check the weights' layout (kappa is read)."""
        q_local, k_local = local(q), local(k)

        def evidence() -> LayoutEvidence:
            return first_chunk(self._evidence(fold(q_local), fold(k_local), None, scale), q)

        readable = isinstance(q_local, Tensor) and isinstance(k_local, Tensor) and q.dim() >= 4
        self._notify(lambda: UnreadCall(reason, sharded=True), evidence if readable else None)

    def _scores(self, x: Tensor, blocked: Tensor | None) -> ScoresCall:
        call, lowest = scores_call(x, blocked)
        if lowest is not None:
            self.channel.note_unmasked(lowest)
        return call

    def _notify(
        self, build: Callable, evidence: Callable | None, *, heads: int | None = None
    ) -> None:
        """Hand one attention call on (its layout evidence with the forward's first). Where the
        forward's projections are split by output features across ranks (tensor parallelism),
        ``heads``, the query heads of the call, are this rank's part: the call says where they
        are among all (``placement``), or is refused where that cannot be told."""
        if not self.channel.observers:
            return
        placement = None
        if self.shards:
            placement = _placement(self.shards, heads)
            if isinstance(placement, str):
                self.first = False
                self.channel.observers.notify(UnreadCall(placement, placement, sharded=True))
                return
        first, self.first = self.first, False

        def build_with_evidence() -> AttentionCall:
            call = build()
            call.placement = placement
            if first and self.watch and evidence is not None:
                call.evidence = evidence()
            return call

        self.channel.observers.notify(observed(build_with_evidence))

    def _evidence(
        self,
        q: Tensor | None,
        k: Tensor | None,
        logits: Tensor | None,
        scale,
        scale_unknown: str | None = None,
    ) -> LayoutEvidence:
        like = q if q is not None else logits
        b, n, m = like.shape[0], like.shape[2], (k.shape[2] if k is not None else logits.shape[3])
        return LayoutEvidence(
            dict(self.inputs),
            dict(self.biases),
            None if q is None else q[:, :, 0].detach().clone(),
            None if k is None else k[:, :, 0].detach().clone(),
            None if logits is None else logits[:, :, 0, 0].detach().clone(),
            None if scale is None else float(scale),
            b,
            n,
            m,
            like.dtype,
            scale_unknown,
            {i: s for i, s in self.shards.items() if isinstance(s, RowShard)},
        )


def _placement(shards: dict[int, RowShard | str], heads: int | None) -> HeadPlacement | str:
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


def _replicated(x: Tensor) -> Tensor:
    """A projection's input as a plain tensor: a DTensor replicated on every mesh dim
    (``ColwiseParallel``'s input) by its local copy, which is the whole input."""
    placements = getattr(x, "placements", None)
    if placements is not None and all(p.is_replicate() for p in placements):
        return x.to_local()
    return x


def _mixed_reason(how: str) -> str:
    return (
        f"it mixes its heads' logits before the softmax ({how}), so a head's softmax is not over "
        "its own queries' and keys' logits: its attention statistics are not measured, while "
        "its kappa, of its own W_Q^h W_K^hᵀ, is a property of the weights and is read"
    )


def _version(x: Tensor) -> int | None:
    """A tensor's version counter (bumped by each in-place change), or None where it has none
    (an inference tensor)."""
    try:
        return int(x._version)
    except (RuntimeError, AttributeError):
        return None


def _same_storage(a: Tensor, b: Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except RuntimeError:  # a tensor without storage of its own (a subclass): not known the same
        return False

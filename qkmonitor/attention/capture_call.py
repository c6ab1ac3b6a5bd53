"""What one intercepted forward captures (:class:`ForwardCapture`): the projections' inputs and
biases the layout check asks for, the queries and keys of ``q @ kᵀ`` (or of an ``einsum``), the
additive masks going into the logits, what the logits went through before the softmax (heads
mixed, channels: :mod:`.capture_heads`), how the projections are split across ranks; and each
attention call handed on to the channel's observers, the first with the forward's layout evidence
(a softmax's at the forward's next call or its end: two softmaxes of content and position are
refused together)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch.nn.functional as F
from torch import Tensor

from qkmonitor import private_apis
from qkmonitor.attention.calls import ScoresCall, UnreadCall
from qkmonitor.attention.capture_builders import (
    flex_call,
    fold,
    folded,
    scores_call,
    sdpa_call,
)
from qkmonitor.attention.capture_heads import (
    GATED,
    HeadsMixed,
    broadcast_to_dims,
    conv_mixes,
    einsum_labels,
    einsum_mixes,
    einsum_qk,
    heads_dim,
    heads_third,
    linear_mixes,
    mixed_reason,
    over_channels,
    placement_of,
)
from qkmonitor.attention.context_parallel import context_parallel_reason, first_chunk, local
from qkmonitor.attention.layout_check import LayoutEvidence, product_scale
from qkmonitor.attention.masks import AdditiveMasks
from qkmonitor.attention.probes import AttentionCall, ObserverSet
from qkmonitor.attention.route import observed
from qkmonitor.measures.sharding import HeadPlacement, RowShard, row_shard

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
#: flex_attention's arguments after (query, key, value)
_FLEX_ARGS = ("score_mod", "block_mask", "scale", "enable_gqa")


class CaptureChannel(Protocol):
    """What a forward's capture reads of the channel that made it
    (:class:`~qkmonitor.attention.capture.InterceptChannel`): named here by its shape, so that the
    channel imports the capture and the capture nothing of the channel's module."""

    heads: int | None  # the query heads, where the layer knows them before a call
    split_heads: int | None  # the head count a 3-D (B·H, N, M) softmax is split by
    sources: dict[object, Callable[[], list[Tensor]]]  # the weights layout probes ask for
    observers: ObserverSet

    def note_unmasked(self, lowest: float) -> None: ...


def _watched(channel: CaptureChannel) -> set[int]:
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

    def __init__(self, channel: CaptureChannel) -> None:
        self.channel = channel
        #: ids of the weights whose inputs are kept (the objects of this forward)
        self.watch = _watched(channel)
        self.inputs: dict[int, Tensor] = {}
        self.biases: dict[int, Tensor] = {}  # the bias each projection's call added, where one did
        self.first = True
        self.qk: tuple[Tensor, Tensor] | None = None  # the first q @ kᵀ: its q and k
        self.last_qk: tuple[Tensor, Tensor] | None = None  # the latest q @ kᵀ before a softmax
        self.product: Tensor | None = None  # the latest q @ kᵀ's result (logits to come)
        #: where its queries' heads are (from the end; -3: before the rows), or why not known
        self.product_dim: int | str = -3
        self.mixed: HeadsMixed | None = None  # what mixed the logits' heads, before the softmax
        #: the softmax calls read, kept until the forward's next call or its end (:meth:`flush`)
        self.pending: list[_Kept] = []
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
        if func is F.linear and isinstance(weight, Tensor) and id(weight) not in self.watch:
            mixed = linear_mixes(x, weight, self.product, self.last_qk)
            if mixed is not None:
                self.mixed = mixed
                return
        if x.dim() >= 3:
            self.tokens.add(x.shape[-2])
            self.widths.add(x.shape[-1])
        watched = isinstance(weight, Tensor) and id(weight) in self.watch
        if watched and id(weight) not in self.inputs:
            self.inputs[id(weight)] = _replicated(x).detach()
            if isinstance(bias, Tensor) and bias.dim() == 1:
                self.biases[id(weight)] = bias.detach()

    def on_conv(self, args: tuple, kwargs: dict, out) -> None:
        """A convolution whose output channels read more than one head of the logits mixes them
        (EfficientFormerV2's and x-transformers' 1×1 talking heads)."""
        mixed = conv_mixes(args, kwargs, out, self.product, self.last_qk)
        if mixed is not None:
            self.mixed = mixed

    def on_einsum(self, args: tuple, out) -> None:
        """``torch.einsum``: a ``q·kᵀ`` (x-transformers' scores), read as ``q @ kᵀ`` is; or a sum
        over the heads of the logits, which mixes them."""
        parsed = einsum_labels(args)
        qk = einsum_qk(parsed)
        if qk is not None:
            self._product(*qk, out)
            return
        mixed = einsum_mixes(parsed, out, self.product, self.last_qk)
        if mixed is not None:
            self.mixed = mixed

    def on_matmul(self, a, b, out) -> None:
        """``x @ W.T`` (a projection written as a matmul, e.g. Falcon's) and ``q @ kᵀ`` of
        (..., H, N, D) queries (the queries and keys of an explicit softmax, the first kept for
        the layout check)."""
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
            return
        if self.watch:
            weight = b if id(b) in self.watch else private_apis.view_base(b)
            if weight is not None and id(weight) in self.watch:
                self.inputs.setdefault(id(weight), a.detach())
                return
        if a.dim() >= 4 and b.dim() == a.dim() and a.shape[-1] == b.shape[-2]:
            self._product(a, b.transpose(-1, -2), out)

    def _product(self, q: Tensor, k: Tensor, out) -> None:
        """Keep a ``q·kᵀ``'s queries ``(..., H, N, D)`` and keys ``(..., H_kv, M, D)``, their
        heads moved third from the end where other dims come first (NesT's blocks after them),
        and its result."""
        dim = self.product_dim = heads_dim(q, self._heads())
        if isinstance(dim, int):
            q, k = heads_third(q, dim), heads_third(broadcast_to_dims(k, q.dim()), dim)
        self.last_qk = (q.detach(), k.detach())
        self.qk = self.qk or self.last_qk
        self.product = out.detach() if isinstance(out, Tensor) else None

    def _heads(self) -> int | None:
        """The layer's query heads, where it says before a call."""
        return self.channel.heads or self.channel.split_heads

    def on_sdpa(self, args, kwargs) -> None:
        sdpa = dict(zip(_SDPA_ARGS, args)) | kwargs
        q, k = sdpa["query"], sdpa["key"]
        refused = context_parallel_reason(q, k)
        if refused is not None:
            self._refuse_split(refused, q, k, sdpa.get("scale"))
            return
        mask = sdpa.get("attn_mask")
        if isinstance(q, Tensor) and isinstance(k, Tensor) and q.dim() >= 4:
            dim = heads_dim(q, self._heads())  # NesT's (B, H, T, N, D): heads before its blocks
            if isinstance(dim, str):
                self._refuse(dim, dim)
                return
            q, k = heads_third(q, dim), heads_third(broadcast_to_dims(k, q.dim()), dim)
            if isinstance(mask, Tensor) and mask.dim() > 2:
                mask = heads_third(broadcast_to_dims(mask, q.dim()), dim)
            refused = over_channels(q, k, self.tokens, self.widths)
            if refused is not None:
                self._refuse(*refused)
                return
        self._notify(
            lambda: sdpa_call(q, k, mask, bool(sdpa.get("is_causal", False)), sdpa.get("scale")),
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
        mixed, self.mixed = self.mixed, None
        product, self.product = self.product, None
        last_qk, self.last_qk = self.last_qk, None
        if mixed is not None and mixed.feeds(x):
            self._refuse_mixed(mixed)
            return
        by_heads = self._heads_first(x, blocked, product)
        if isinstance(by_heads, str):
            self._refuse(by_heads, by_heads)
            return
        if by_heads is None:
            return
        x, blocked = by_heads
        if last_qk is not None and x.shape[-2] == last_qk[0].shape[-2]:
            refused = over_channels(*last_qk, self.tokens, self.widths)
            if refused is not None:
                self._refuse(*refused)
                return
        from_product = product is not None and product.shape[-2:] == x.shape[-2:]
        self._read_scores(fold(x), None if blocked is None else fold(blocked), from_product)

    def _heads_first(
        self, x: Tensor, blocked: Tensor | None, product: Tensor | None
    ) -> tuple[Tensor, Tensor | None] | str | None:
        """A softmax's logits and their blocked keys as (..., H, N, M): (B·H, N, M) split by the
        module's head count, (B, N, H, M) transposed where the layer's head count says so, the
        heads of (B, H, T, N, M) moved before the blocks (NesT: where its ``q @ kᵀ``'s queries
        had them); None where they cannot be (why, in ``unread``, where they hold attention-like
        scores), or why the dim of the heads is not known."""
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
        elif x.dim() > 4:
            same = product is not None and product.shape == x.shape
            dim = self.product_dim if same else heads_dim(x, self._heads())
            if isinstance(dim, str):
                return dim
            if blocked is not None:
                blocked = heads_third(broadcast_to_dims(blocked, x.dim()), dim)
            x = heads_third(x, dim)
        elif heads is not None and x.shape[-3] != heads:
            if x.shape[2] != heads:  # not (B, H, N, M) nor (B, N, H, M)
                self.unread.append(
                    f"a softmax over a tensor of shape {tuple(x.shape)}, in which no dim holds "
                    f"the layer's {heads} heads"
                )
                return None
            x = x.transpose(1, 2)
            blocked = None if blocked is None else blocked.transpose(1, 2)
        if heads is not None and x.dim() > 4 and x.shape[-3] != heads:
            self.unread.append(
                f"a softmax over a tensor of shape {tuple(x.shape)}, in which no dim holds "
                f"the layer's {heads} heads"
            )
            return None
        return x, blocked

    def _read_scores(self, x: Tensor, blocked: Tensor | None, from_product: bool) -> None:
        """Keep (B, H, N, M) logits a softmax got, read now, until the forward's next call or its
        end (:meth:`flush`); with the forward's first ``q @ kᵀ`` as the layout evidence where it
        is theirs (the factor between the two: the logit scale), else the logits' own query 0,
        key 0."""
        if not self.channel.observers:
            return
        qk, wants_evidence = self.qk, self.first and bool(self.watch)

        def evidence() -> LayoutEvidence:
            theirs = qk is not None and folded(qk[0])[:3] == x.shape[:3]
            if theirs and qk[1].shape[-2] == x.shape[3]:
                q, k = fold(qk[0]), fold(qk[1])
                return self._evidence(q, k, None, *product_scale(q, k, x, blocked))
            return self._evidence(None, None, x, None)

        def build() -> ScoresCall:
            call = self._scores(x, blocked)
            if wants_evidence:
                call.evidence = evidence()
            return call

        placement = self._place(x.shape[1])
        self.pending.append(_Kept(observed(build), placement, tuple(x.shape), from_product))

    def flush(self) -> None:
        """Hand on the softmax calls kept back; or, where one forward computed two softmaxes over
        the same queries' keys, one over its ``q·kᵀ`` and one over logits no ``q·kᵀ`` gave (the
        content and the position attention of ConViT's GPSA, which it mixes by a gate), refuse
        them: neither is the attention it applies."""
        kept, self.pending = self.pending, []
        if not kept or not self.channel.observers:
            return
        content = next((c for c in kept if c.from_product), None)
        others = {c.shape for c in kept if not c.from_product}
        if content is not None and content.shape in others:
            refusal = UnreadCall(GATED)
            refusal.evidence = getattr(content.call, "evidence", None) if self.first else None
            self._hand_on(refusal)
            return
        for one in kept:
            if isinstance(one.placement, str):
                self._hand_on(UnreadCall(one.placement, one.placement, sharded=True))
                continue
            if not self.first:  # the layout evidence rides with the forward's first call
                one.call.evidence = None
            one.call.placement = one.placement
            self._hand_on(one.call)

    def _refuse(self, reason: str, no_layout: str | None, evidence: Callable | None = None) -> None:
        """Hand on a call that is not read, and why; ``no_layout``: why the weights are not read
        either, else ``evidence`` (the first call's) may still check them."""
        self._notify(lambda: UnreadCall(reason, no_layout), None if no_layout else evidence)

    def _refuse_mixed(self, mixed: HeadsMixed) -> None:
        """Refuse a softmax over logits whose heads were mixed; the weights are still checked by
        the ``q·kᵀ`` the mixed logits came from, and the factor on each head's own ``q·kᵀ`` is
        the one between that product and the logits the op mixed (1 where it mixed the product
        itself, as CaiT's ``proj_l``), or not known, and why."""
        qk, rows = mixed.qk, mixed.rows
        evidence = None
        if qk is not None and rows is not None and qk[0].dim() == 4:

            def evidence() -> LayoutEvidence:
                q, k = qk
                scale, why = product_scale(q, k, rows, None)
                if why is not None:
                    why = f"its heads are mixed from logits not a multiple of its q·kᵀ: {why}"
                return self._evidence(q, k, None, scale, why)

        self._refuse(mixed_reason(mixed.how), None, evidence)

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

    def _place(self, heads: int | None) -> HeadPlacement | str | None:
        """Where a call's ``heads`` query heads are among the layer's where the forward's
        projections are split by output features across ranks (tensor parallelism: this rank's
        part), or why that cannot be told; None where they are not split."""
        return placement_of(self.shards, heads) if self.shards else None

    def _notify(
        self, build: Callable, evidence: Callable | None, *, heads: int | None = None
    ) -> None:
        """Hand one attention call on, after the softmax calls kept back (its layout evidence
        with the forward's first; its ``placement`` among the layer's heads under tensor
        parallelism, or refused where that cannot be told)."""
        self.flush()
        if not self.channel.observers:
            return
        placement = self._place(heads)
        if isinstance(placement, str):
            self._hand_on(UnreadCall(placement, placement, sharded=True))
            return
        first = self.first

        def build_with_evidence() -> AttentionCall:
            call = build()
            call.placement = placement
            if first and self.watch and evidence is not None:
                call.evidence = evidence()
            return call

        self._hand_on(observed(build_with_evidence))

    def _hand_on(self, call: AttentionCall) -> None:
        self.first = False
        self.channel.observers.notify(call)

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


def _replicated(x: Tensor) -> Tensor:
    """A projection's input as a plain tensor: a DTensor replicated on every mesh dim
    (``ColwiseParallel``'s input) by its local copy, which is the whole input."""
    placements = getattr(x, "placements", None)
    if placements is not None and all(p.is_replicate() for p in placements):
        return x.to_local()
    return x


@dataclass
class _Kept:
    """A softmax call read and kept until the forward's next call or its end."""

    call: AttentionCall  # a ScoresCall (its evidence on it), or the FailedCall of its reading
    placement: HeadPlacement | str | None
    shape: tuple[int, ...]  # its logits' (B, H, N, M)
    from_product: bool  # over the q·kᵀ seen before it

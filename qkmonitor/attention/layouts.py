r"""Where an attention module keeps W_Q and W_K, and how they split into heads.

A :class:`QKLayout` names the projections of one module and how to cut them: separate query and
key projections, or one fused q/k/v projection in one of three row orders, each ``(out, in)``
like ``nn.Linear`` (a GPT-2 ``Conv1D``, whose weight is ``(in, out)``, is read transposed):

- ``"blocks"``: ``[q_0 … q_{H-1} | k_0 … k_{H_kv-1} | v …]`` (timm, nanoGPT, Phi-3, ModernBERT,
  GPT-BigCode and Falcon multi-query, litgpt ≥ 0.5);
- ``"heads"``: per head ``[q_h k_h v_h]`` (GPT-NeoX/Pythia, BLOOM);
- ``"groups"``: per key/value group ``[q_{g r} … q_{g r + r - 1} k_g v_g]``, ``r = H / H_kv``
  (Falcon's new decoder architecture, litgpt before 0.5).

Query head h scores against key head ``kv_index[h]``; ``None`` means the grouped pairing of
SDPA's ``enable_gqa`` and ``repeat_interleave``, ``g = h // (H / H_kv)``. Some libraries pair
``g = h % H_kv`` instead (x-transformers repeats its keys with ``einops.repeat``); the pairing is
the model's own, found by :func:`qkmonitor.attention.intercept.check_layout` from the call it makes.

:func:`infer_layouts` reads a module by the names the field uses and returns every layout its
shapes allow; the first probe keeps the one that reproduces the queries and keys the module
actually computed (see :mod:`qkmonitor.attention.intercept`). :class:`AttentionSpec` states a layout
for a model that no rule covers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from qkmonitor.attention.clip import ProjectionRows, QKRows
from qkmonitor.attention.latent import LatentLayout, LatentNames, find_latent
from qkmonitor.measures.layer_spectra import QKWeights
from qkmonitor.measures.sharding import HeadPlacement, RowShard, stated_shape, whole
from qkmonitor.validation import is_int, is_real

__all__ = [
    "FUSED_ORDERS",
    "PAIRINGS",
    "AttentionSpec",
    "QKLayout",
    "infer_layouts",
    "qk_norm_modules",
]

FUSED_ORDERS = ("blocks", "heads", "groups")
PAIRINGS = ("grouped", "modulo")

#: Separate query/key projections, by the names the field gives them.
SEPARATE_NAMES = (
    ("q_proj", "k_proj"),
    ("query", "key"),
    ("to_q", "to_k"),
    ("wq", "wk"),
    ("q", "k"),
    ("q_lin", "k_lin"),
    ("query_proj", "key_proj"),
    ("linear_q", "linear_k"),
    ("q", "kv"),  # a fused key/value projection, keys first (timm Twins' and PVT's `kv`)
)
#: One fused q/k/v projection.
FUSED_NAMES = (
    "qkv",
    "c_attn",
    "query_key_value",
    "Wqkv",
    "qkv_proj",
    "in_proj",
    "attn",
    "to_qkv",
    "wqkv",
)
#: Head counts and sizes, on the module or its ``config``.
HEADS_NAMES = (
    "num_heads",
    "n_head",
    "n_heads",
    "heads",
    "num_attention_heads",
    "nhead",
    "n_heads_q",
)
KV_HEADS_NAMES = (
    "num_kv_heads",
    "n_kv_heads",
    "num_key_value_heads",
    "kv_heads",
    "n_query_groups",
    "n_kv_head",
    "num_kv",
)
HEAD_DIM_NAMES = (
    "head_dim",
    "head_size",
    "dim_head",
    "attention_head_size",
    "key_value_proj_dim",
    "d_head",
    "head_dim_qk",
)
SCALE_NAMES = ("scale", "scaling", "softmax_scale")
#: QK-norm modules (applied per head, or over the whole projection, after the projections).
QK_NORM_NAMES = (
    ("q_norm", "k_norm"),
    ("norm_q", "norm_k"),
    ("q_layernorm", "k_layernorm"),
    ("query_norm", "key_norm"),
    ("q_ln", "k_ln"),
)


@dataclass(frozen=True)
class QKLayout:
    """How one module's W_Q and W_K are read (resolved: every count known).

    Attributes:
        q: the query projection's path in the module (a submodule with a ``weight``, or a
            parameter), or the fused q/k/v projection when ``k`` is None.
        k: the key projection's path; None when ``q`` is fused.
        fused: the fused projection's row order (:data:`FUSED_ORDERS`); ignored when ``k`` is set.
        num_heads, num_kv_heads, head_dim: H, H_kv (dividing H) and d_k.
        kv_index: the key head of each query head; None for the grouped pairing.
        scale: the factor on ``q·k``; None for ``1/sqrt(head_dim)``.
        qk_norm: the layer normalizes q and k after the projections.
        scale_unknown: why the layer's forward does not tell the factor between its projections'
            ``q·kᵀ`` and the logits its softmax gets (set by the layout check,
            :mod:`.layout_check`); the weights are read, and ``qk_spectral_norm`` (σ₁ · scale) is
            NaN (:meth:`qk_weights` gives a NaN scale) rather than a guess.
        shards: where the heads are split across ranks (tensor parallelism): the layout is then
            this rank's, its counts and rows those of the heads it computes (:meth:`localized`).
    """

    q: str
    k: str | None
    fused: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_index: tuple[int, ...] | None = None
    scale: float | None = None
    qk_norm: bool = False
    scale_unknown: str | None = None
    shards: HeadShards | None = None

    @property
    def logit_scale(self) -> float:
        return self.head_dim**-0.5 if self.scale is None else self.scale

    def sources(self, module: nn.Module) -> list[Tensor]:
        """The parameters whose inputs are the layer's query and key inputs (the fused one once)."""
        return [_weight_param(module, path) for path in (self.q, self.k) if path is not None]

    def read(self, module: nn.Module) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        """``(w_q, b_q, w_k, b_k)``: (H·d_k, d) and (H_kv·d_k, d') weights, ``nn.Linear`` layout."""
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.shards is not None:  # this rank's rows, as the forward computes with them
            return self.shards.read(module, self.q, self.k)
        if self.k is not None:
            w_q, b_q = map(whole, projection(module, self.q))
            w_k, b_k = map(whole, projection(module, self.k))
            return (
                w_q[: h * d],
                _rows(b_q, slice(0, h * d)),
                w_k[: kv * d],
                _rows(b_k, slice(0, kv * d)),
            )
        w, b = map(whole, projection(module, self.q))
        q_rows, k_rows = fused_rows(self.fused, h, kv, d, device=w.device)
        return w[q_rows], _rows(b, q_rows), w[k_rows], _rows(b, k_rows)

    def split_biases(
        self, q_bias: Tensor | None, k_bias: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None]:
        """The query and key rows of biases given for the projections (``q_bias`` for ``q``, or
        for the fused one; ``k_bias`` for ``k``), cut as :meth:`read` cuts the weights'."""
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.k is not None:
            return _rows(q_bias, slice(0, h * d)), _rows(k_bias, slice(0, kv * d))
        if q_bias is None:
            return None, None
        q_rows, k_rows = fused_rows(self.fused, h, kv, d, device=q_bias.device)
        return q_bias[q_rows], q_bias[k_rows]

    def qk_rows(self, module: nn.Module) -> QKRows:
        """The projections by head, as views written through in place (QK-Clip)."""
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        index = self.kv_index if self.kv_index is not None else grouped_index(h, kv)
        if self.shards is not None:
            q, k = self.shards.rows(module, self.q, self.k, d)
            return QKRows(q, k, tuple(index), self.qk_norm)
        if self.k is not None:
            (w_q, b_q), (w_k, b_k) = projection(module, self.q), projection(module, self.k)
            q_rows, k_rows = torch.arange(h * d), torch.arange(kv * d)
            return QKRows(
                ProjectionRows(w_q, b_q, q_rows.view(h, d)),
                ProjectionRows(w_k, b_k, k_rows.view(kv, d)),
                tuple(index),
                self.qk_norm,
            )
        w, b = projection(module, self.q)
        q_rows, k_rows = fused_rows(self.fused, h, kv, d)
        return QKRows(
            ProjectionRows(w, b, q_rows.view(h, d)),
            ProjectionRows(w, b, k_rows.view(kv, d)),
            tuple(index),
            self.qk_norm,
        )

    def qk_weights(self, module: nn.Module) -> QKWeights:
        w_q, _, w_k, _ = self.read(module)
        kv_heads = self.num_kv_heads
        if self.kv_index is not None and tuple(self.kv_index) != grouped_index(
            self.num_heads, kv_heads
        ):
            # a pairing of its own: one key head per query head, in the query heads' order
            index = torch.tensor(self.kv_index, device=w_k.device)
            w_k = w_k.view(kv_heads, self.head_dim, -1)[index].flatten(0, 1)
            kv_heads = self.num_heads
        scale = float("nan") if self.scale_unknown is not None else self.logit_scale
        return QKWeights(w_q, w_k, self.num_heads, kv_heads, scale, qk_norm=self.qk_norm)

    def describe(self) -> str:
        where = f"{self.q}/{self.k}" if self.k is not None else f"{self.q} ({self.fused})"
        pairing = "" if self.kv_index is None else f", key heads {list(self.kv_index)}"
        return (
            f"{where}, {self.num_heads} heads, {self.num_kv_heads} kv heads, d_k "
            f"{self.head_dim}{pairing}"
        )

    def localized(self, q: RowShard | None, k: RowShard | None) -> QKLayout | str:
        """This layout (of all the heads) as one rank of tensor parallelism computes it: its query
        projection split as ``q`` says, its key projection as ``k`` (None: whole on every rank),
        each rank holding whole heads whose key heads it holds too; else why it cannot be."""
        if q is None:
            return self
        if self.k is None:
            return f"its fused projection {self.q!r} is sharded by rows across {q.ranks} ranks"
        heads, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        k_ranks = 1 if k is None else k.ranks
        if heads % q.ranks or kv % k_ranks or q.rows != heads * d:
            return (
                f"its {heads} query heads of {d} ({q.rows} rows) and {kv} key heads do not split "
                f"into whole heads across {q.ranks} ranks"
            )
        local, local_kv = heads // q.ranks, kv // k_ranks
        first, first_kv = q.index * local, (0 if k is None else k.index * local_kv)
        pairing = self.kv_index or grouped_index(heads, kv)
        index = tuple(pairing[first + h] - first_kv for h in range(local))
        if not all(0 <= g < local_kv for g in index):
            return "its query heads and the key heads they score against are on different ranks"
        shards = HeadShards(q, k, HeadPlacement(first, local, heads))
        grouped = index == grouped_index(local, local_kv)
        return replace(
            self,
            num_heads=local,
            num_kv_heads=local_kv,
            kv_index=None if grouped else index,
            shards=shards,
        )


@dataclass(frozen=True)
class HeadShards:
    """How a layer's query and key projections are split across ranks (tensor parallelism), and
    where this rank's query heads are among all (``placement``); ``k`` None: the keys whole on
    every rank."""

    q: RowShard
    k: RowShard | None
    placement: HeadPlacement

    def read(self, module: nn.Module, q: str, k: str) -> tuple:
        """``(w_q, b_q, w_k, b_k)`` of this rank's heads."""
        (w_q, b_q), (w_k, b_k) = projection(module, q), projection(module, k)
        read_k = whole if self.k is None else self.k.local
        return (
            self.q.local(w_q),
            None if b_q is None else self.q.local(b_q),
            read_k(w_k),
            None if b_k is None else read_k(b_k),
        )

    def rows(
        self, module: nn.Module, q: str, k: str, head_dim: int
    ) -> tuple[ProjectionRows, ProjectionRows]:
        """This rank's query and key rows by head, written through in place.

        Raises:
            ValueError: where this rank's local shard of a weight is not the rows it computes with
                (:meth:`RowShard.in_place`; FSDP2 over tensor parallelism on several
                data-parallel ranks: the rows would be a gathered copy, which a write would lose
                and which an update would leave stale).
        """
        out = []
        for path, shard in ((q, self.q), (k, self.k)):
            weight, bias = projection(module, path)
            if shard is not None and not shard.in_place(weight):
                raise ValueError(
                    f"this rank's shard of {path!r} is not the rows it computes with (FSDP2 over "
                    "tensor parallelism on more than one data-parallel rank), so they are not "
                    "read in place"
                )
            local = shard.local if shard is not None else _replica
            rows = torch.arange(local(weight).shape[0]).view(-1, head_dim)
            out.append(
                ProjectionRows(
                    local(weight),
                    None if bias is None else local(bias),
                    rows,
                    gradient=lambda w=weight, read=local: None if w.grad is None else read(w.grad),
                )
            )
        return out[0], out[1]


def _replica(tensor: Tensor) -> Tensor:
    """A tensor whole on every rank: a replicated DTensor's local copy, else itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def grouped_index(heads: int, kv_heads: int) -> tuple[int, ...]:
    """The grouped pairing ``g = h // (H / H_kv)``."""
    return tuple(h // (heads // kv_heads) for h in range(heads))


def modulo_index(heads: int, kv_heads: int) -> tuple[int, ...]:
    """The pairing ``g = h % H_kv`` (x-transformers)."""
    return tuple(h % kv_heads for h in range(heads))


def fused_rows(
    order: str, heads: int, kv_heads: int, head_dim: int, device=None
) -> tuple[Tensor, Tensor]:
    """Row indices of W_Q and W_K in a fused projection of the given order."""
    d, r = head_dim, heads // kv_heads
    if order == "blocks":
        q = torch.arange(heads * d)
        k = heads * d + torch.arange(kv_heads * d)
    elif order == "heads":  # per head [q k v]
        base = torch.arange(heads)[:, None] * 3 * d + torch.arange(d)
        q, k = base.flatten(), (base + d).flatten()
    elif order == "groups":  # per group [q x r, k, v]
        group = torch.arange(kv_heads)[:, None, None] * (r + 2) * d
        q = (group + torch.arange(r)[None, :, None] * d + torch.arange(d)).flatten()
        k = (group[:, 0] + r * d + torch.arange(d)).flatten()
    else:
        raise ValueError(f"Expected `fused` to be one of {FUSED_ORDERS}, got {order!r}")
    return q.to(device), k.to(device)


def _rows(bias: Tensor | None, rows) -> Tensor | None:
    return None if bias is None else bias[rows]


def _get(module: nn.Module, path: str):
    obj = module
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _is_conv1d(proj: nn.Module) -> bool:
    """GPT-2's ``Conv1D``: weight ``(in, out)``, out features in ``nf``."""
    weight = getattr(proj, "weight", None)
    return (
        type(proj).__name__ == "Conv1D"
        and isinstance(weight, Tensor)
        and weight.dim() == 2
        and getattr(proj, "nf", None) == weight.shape[1]
    )


def projection(module: nn.Module, path: str) -> tuple[Tensor, Tensor | None]:
    """The ``(out, in)`` weight and the bias of a projection (a Linear-like module, a
    ``Conv1D``, or a bare 2-D parameter) at ``path`` in ``module``."""
    obj = _get(module, path)
    if isinstance(obj, Tensor):
        return obj, None
    weight = getattr(obj, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(
            f"`{path}` of {type(module).__name__} is not a projection with a 2-D weight"
        )
    bias = getattr(obj, "bias", None)
    bias = bias if isinstance(bias, Tensor) else None
    return (weight.T, bias) if _is_conv1d(obj) else (weight, bias)


def _weight_param(module: nn.Module, path: str) -> Tensor:
    obj = _get(module, path)
    return obj if isinstance(obj, Tensor) else obj.weight


def _out_features(module: nn.Module, path: str) -> int | None:
    obj = _get(module, path)
    weight = getattr(obj, "weight", None) if isinstance(obj, nn.Module) else None
    if not isinstance(weight, Tensor) or isinstance(obj, (nn.Embedding, nn.MultiheadAttention)):
        return None
    shape = stated_shape(weight)  # a partitioned parameter's whole shape
    if len(shape) == 2:
        return shape[1] if _is_conv1d(obj) else shape[0]
    return None


def _positive_int(value) -> int | None:
    return value if is_int(value, 1) else None


def attribute(module: nn.Module, names: tuple[str, ...]) -> int | None:
    """The first positive int among ``names`` on the module, then on its ``config``."""
    for owner in (module, getattr(module, "config", None)):
        for name in names:
            value = _positive_int(getattr(owner, name, None))
            if value is not None:
                return value
    return None


def _scale(module: nn.Module) -> float | None:
    for name in SCALE_NAMES:
        value = getattr(module, name, None)
        if is_real(value) and value > 0:
            return float(value)
    return None


def qk_norm_modules(module: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """The module's QK-norm pair (``q_norm``/``k_norm`` and the like), or None."""
    for q_name, k_name in QK_NORM_NAMES:
        q, k = getattr(module, q_name, None), getattr(module, k_name, None)
        if isinstance(q, nn.Module) and isinstance(k, nn.Module) and not isinstance(q, nn.Identity):
            return q, k
    return None


def projections_of(module: nn.Module) -> tuple[str, str | None] | None:
    """``(q, k)`` paths of separate projections, ``(qkv, None)`` of a fused one, or None."""
    for q, k in SEPARATE_NAMES:
        if _out_features(module, q) is not None and _out_features(module, k) is not None:
            return q, k
    for name in FUSED_NAMES:
        if _out_features(module, name) is not None:
            return name, None
    return None


def infer_layouts(
    module: nn.Module,
    *,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    paths: tuple[str, str | None] | None = None,
    fused: str | None = None,
    kv_index: tuple[int, ...] | None = None,
    scale: float | None = None,
) -> list[QKLayout]:
    """Every layout of ``module`` that its projections' shapes and attributes allow.

    Counts given as arguments win over the module's attributes (``num_heads``, ``n_head``,
    ``num_key_value_heads``, ``n_query_groups``, ``head_dim``, ... on the module or its
    ``config``); what neither says is solved from the shapes where that is unambiguous.

    Returns:
        The candidate layouts, most likely first; empty when the module has no recognised
        projections or the counts do not fit them.
    """
    paths = paths or projections_of(module)
    if paths is None:
        return []
    q_path, k_path = paths
    heads = heads or attribute(module, HEADS_NAMES)
    if heads is None:
        return []
    q_out = _out_features(module, q_path)
    if q_out is None:
        return []
    if k_path is not None:
        head_dim = (
            head_dim
            or attribute(module, HEAD_DIM_NAMES)
            or (q_out // heads if q_out % heads == 0 else None)
        )
    else:
        head_dim = head_dim or attribute(module, HEAD_DIM_NAMES)
    kv_heads = kv_heads or attribute(module, KV_HEADS_NAMES)
    if kv_heads is None and getattr(module, "multi_query", False) is True:
        kv_heads = 1
    if kv_heads is None:
        groups = attribute(module, ("num_key_value_groups",))
        kv_heads = heads // groups if groups and heads % groups == 0 else None
    if k_path is not None:
        k_out = _out_features(module, k_path)
        if k_path.rsplit(".", 1)[-1] == "kv":  # [k | v]: the keys are its first half
            k_out //= 2
        if head_dim is None or q_out < heads * head_dim:
            return []
        kv_heads = kv_heads or (k_out // head_dim if k_out % head_dim == 0 else None)
        if kv_heads is None or heads % kv_heads or k_out < kv_heads * head_dim:
            return []
    else:
        if head_dim is None:  # q, k, v of one width: (H + 2 H_kv) d_k rows; or q and k alone
            widths = [heads + 2 * (kv_heads or heads), heads + (kv_heads or heads)]
            head_dim = next((q_out // width for width in widths if q_out % width == 0), None)
        if head_dim is None:
            return []
        if (
            kv_heads is None
        ):  # (H + 2 H_kv) d_k rows hold q, k, v; 2 H d_k may also be q and k alone
            rest = q_out // head_dim - heads if q_out % head_dim == 0 else 0
            kv_options = [rest // 2] if rest > 0 and rest % 2 == 0 else []
            kv_options += [heads] if rest == heads and heads not in kv_options else []
        else:
            kv_options = [kv_heads]
        kv_options = [
            kv
            for kv in kv_options
            if kv > 0 and heads % kv == 0 and q_out >= (heads + kv) * head_dim
        ]
        if not kv_options:
            return []
        layouts = []
        for kv in kv_options:
            orders = (
                (fused,)
                if fused
                else (("blocks", "heads") if kv == heads else ("blocks", "groups"))
            )
            layouts += [(order, kv) for order in orders]
        norm = qk_norm_modules(module) is not None
        scale = scale if scale is not None else _scale(module)
        return [
            QKLayout(q_path, None, order, heads, kv, head_dim, kv_index, scale, norm)
            for order, kv in layouts
        ]
    norm = qk_norm_modules(module) is not None
    scale = scale if scale is not None else _scale(module)
    return [QKLayout(q_path, k_path, "blocks", heads, kv_heads, head_dim, kv_index, scale, norm)]


@dataclass(frozen=True)
class AttentionSpec:
    """A declarative adapter: how to read a kind of attention module that no rule covers.

    Register it with :func:`qkmonitor.register_attention`; discovery then wraps every matching
    module. Statistics come from the module's own attention call (an SDPA call or a 4-D softmax
    inside its forward, :mod:`qkmonitor.attention.intercept`); the weights from the projections
    named here, checked against that call at the first probe.

    Attributes:
        match: a module class (or tuple of classes), or ``match(name, module) -> bool``.
        q, k: paths of the query and key projections in the module (``"attn.wq"``), each a module
            with a 2-D ``weight`` (``nn.Linear`` layout; ``Conv1D`` read transposed) or a 2-D
            parameter; or ``qkv``, one fused projection, cut in ``fused`` order.
        num_heads, num_kv_heads, head_dim: an int, or the name of the module attribute holding it
            (``"n_head"``, ``"config.n_kv"``); None: read from the usual attributes or shapes.
        pairing: ``"grouped"`` (``g = h // (H / H_kv)``) or ``"modulo"`` (``g = h % H_kv``).
        scale: the factor on ``q·k`` (a float or an attribute name); None: ``1/sqrt(head_dim)``.
        name: the family name shown at discovery (default: the class name matched).
        latent: instead of ``q``/``k``/``qkv``, the factored projections of a multi-head latent
            attention (:class:`qkmonitor.attention.latent.LatentNames`); its sizes are read from
            the names and the shapes, ``scale`` from its ``scale`` names.

    Example::

        import qkmonitor

        qkmonitor.register_attention(qkmonitor.AttentionSpec(
            match=MyAttention, qkv="in_proj", fused="heads", num_heads="n_heads"))

        # a latent attention of one's own: the factored projections by name
        qkmonitor.register_attention(qkmonitor.AttentionSpec(
            match=MyLatentAttention,
            latent=qkmonitor.LatentNames(kv_down="kv_down", kv_up="kv_up", kv_norm="kv_norm",
                               q=None, q_down="q_down", q_norm="q_norm", q_up="q_up",
                               num_heads=8, rope_dim=32)))
    """

    match: type | tuple[type, ...] | Callable[[str, nn.Module], bool]
    q: str | None = None
    k: str | None = None
    qkv: str | None = None
    fused: str = "blocks"
    num_heads: int | str | None = None
    num_kv_heads: int | str | None = None
    head_dim: int | str | None = None
    pairing: str = "grouped"
    scale: float | str | None = None
    name: str | None = None
    latent: LatentNames | None = None

    def __post_init__(self) -> None:
        if not (callable(self.match) or isinstance(self.match, tuple)):
            raise ValueError(
                f"Expected `match` to be a module class, a tuple of them or a function "
                f"(name, module) -> bool, got {self.match!r}"
            )
        if self.latent is not None:
            if not isinstance(self.latent, LatentNames):
                raise ValueError(
                    "Expected `latent` to be a qkmonitor.attention.latent.LatentNames, got "
                    f"{type(self.latent).__name__}"
                )
            if self.q or self.k or self.qkv:
                raise ValueError(
                    "Expected either `latent` or `q`/`k`/`qkv`, got both (latent attention's "
                    "projections are all in `latent`)"
                )
            return
        if (self.qkv is None) == (self.q is None or self.k is None) or (
            self.qkv and (self.q or self.k)
        ):
            raise ValueError(
                "Expected either `q` and `k` (separate projections) or `qkv` (a fused one), "
                f"got q={self.q!r}, k={self.k!r}, qkv={self.qkv!r}"
            )
        for field_name in ("q", "k", "qkv"):
            value = getattr(self, field_name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(
                    f"Expected `{field_name}` to be a module path such as 'wq', got {value!r}"
                )
        if self.fused not in FUSED_ORDERS:
            raise ValueError(f"Expected `fused` to be one of {FUSED_ORDERS}, got {self.fused!r}")
        if self.pairing not in PAIRINGS:
            raise ValueError(f"Expected `pairing` to be one of {PAIRINGS}, got {self.pairing!r}")
        for field_name in ("num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, field_name)
            if value is not None and not isinstance(value, str) and _positive_int(value) is None:
                raise ValueError(
                    f"Expected `{field_name}` to be a positive int, an attribute name or None, "
                    f"got {value!r}"
                )
        if (
            self.scale is not None
            and not isinstance(self.scale, str)
            and not (is_real(self.scale) and self.scale > 0)
        ):
            raise ValueError(
                "Expected `scale` to be a positive float, an attribute name or None, got "
                f"{self.scale!r}"
            )

    @property
    def family(self) -> str:
        if self.name:
            return self.name
        classes = self.match if isinstance(self.match, tuple) else (self.match,)
        names = [c.__name__ for c in classes if isinstance(c, type)]
        return "spec:" + ("|".join(names) if names else getattr(self.match, "__name__", "match"))

    def matches(self, name: str, module: nn.Module) -> bool:
        if isinstance(self.match, (tuple, type)):
            return isinstance(module, self.match)
        return bool(self.match(name, module))

    def layout(self, module: nn.Module) -> QKLayout | LatentLayout:
        """The module's layout under this spec.

        Raises:
            ValueError: naming the field that the module does not have or that does not fit.
        """
        if self.latent is not None:
            layout = find_latent(module, self.latent)
            if layout is None:
                raise ValueError(
                    f"`latent`: {type(module).__name__} has no latent projections "
                    f"{self.latent.kv_down!r}/{self.latent.kv_up!r} with a query projection, "
                    "of shapes that split into the heads (give `num_heads`, `rope_dim`, "
                    "`latent_dim`)"
                )
            return layout

        def count(field_name: str) -> int | None:
            value = getattr(self, field_name)
            if isinstance(value, str):
                found = _positive_int(_get(module, value))
                if found is None:
                    raise ValueError(
                        f"`{field_name}={value!r}`: {type(module).__name__} has no positive int "
                        "there"
                    )
                return found
            return value

        paths = (self.qkv, None) if self.qkv is not None else (self.q, self.k)
        for path in paths:
            if (
                path is not None
                and _out_features(module, path) is None
                and not isinstance(_get(module, path), Tensor)
            ):
                raise ValueError(
                    f"`{path}` is not a projection of {type(module).__name__} (expected a module "
                    "with a 2-D weight, or a 2-D parameter)"
                )
        scale = _get(module, self.scale) if isinstance(self.scale, str) else self.scale
        heads = count("num_heads")
        kv_heads = count("num_kv_heads")
        candidates = infer_layouts(
            module,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=count("head_dim"),
            paths=paths,
            fused=self.fused if self.qkv else None,
            scale=scale,
        )
        if not candidates:
            raise ValueError(
                f"{type(module).__name__}: the projections {paths} do not split into the given "
                f"heads (num_heads={heads}, num_kv_heads={kv_heads}); give `num_heads`, "
                "`num_kv_heads` and `head_dim`"
            )
        layout = candidates[0]
        if self.pairing == "modulo" and layout.num_kv_heads < layout.num_heads:
            layout = replace(layout, kv_index=modulo_index(layout.num_heads, layout.num_kv_heads))
        return layout

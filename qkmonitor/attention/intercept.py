r"""The generic family: any attention that goes through SDPA or a softmax, statistics by
interception, weights by layout.

A module no specific family knows is recognised by its name and its class's code
(:mod:`.recognition`); while a probe is open on it, its attention calls are captured from inside
its forward (:mod:`.capture`); its query/key weights are read by name as candidate layouts
(:func:`qkmonitor.attention.layout_names.infer_layouts`), or as an :class:`AttentionSpec` states
them, and the first probe keeps the candidate that reproduces what the module computed
(:mod:`.layout_check`). This module holds the layer (:class:`InterceptedAttentionLayer`), its
registration as a family, and :func:`register_attention` for a user's spec.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import Tensor, nn

from qkmonitor.attention.adapters import AttentionLayer
from qkmonitor.attention.calls import TENSOR_PARALLEL, UnreadCall
from qkmonitor.attention.capture import route_probe
from qkmonitor.attention.clip import QKRows
from qkmonitor.attention.latent import LatentLayout, find_latent
from qkmonitor.attention.layout_check import LayoutEvidence, check_layout
from qkmonitor.attention.layout_names import (
    HEADS_NAMES,
    attribute,
    infer_layouts,
    projections_of,
    qk_norm_modules,
)
from qkmonitor.attention.layouts import QKLayout, out_features, placed_heads, projection
from qkmonitor.attention.probes import Probe, side_computation
from qkmonitor.attention.recognition import (
    ATTENTION_NAME,
    NOT_ATTENTION,
    child_computes,
    computes_attention,
    library,
    looks_like_attention,
)
from qkmonitor.attention.registry import register_family
from qkmonitor.attention.spec import AttentionSpec
from qkmonitor.measures.layer_spectra import QKWeights
from qkmonitor.measures.sharding import HeadPlacement, whole

__all__ = [
    "InterceptedAttentionLayer",
    "LayoutChecked",
    "LayoutEvidence",
    "LayoutUnknownError",
    "check_layout",
    "looks_like_attention",
    "register_attention",
    "unmeasured_attention_like",
]


class LayoutChecked:
    """Weights read by layout (candidates, or one stated by an :class:`AttentionSpec`), kept only
    once a forward has reproduced them (:func:`check_layout`). Mixed into an
    :class:`~qkmonitor.attention.adapters.AttentionLayer` that has ``name`` and ``module``."""

    name: str
    module: nn.Module

    def set_layouts(
        self, candidates: list[QKLayout], *, trusted: bool = False, heads_from_call: bool = False
    ) -> None:
        """The candidate layouts; ``trusted``: the first one is used until a forward checks it;
        ``heads_from_call``: the projections are known but not the head counts (taken from the
        call)."""
        self.layout_candidates = list(candidates)
        self.layout: QKLayout | None = self.layout_candidates[0] if trusted and candidates else None
        self.layout_error: str | None = None
        self._checked = False
        self._trusted = trusted
        self._paths = projections_of(self.module) if heads_from_call else None

    @property
    def supports_weights(self) -> bool:
        return bool(self.layout_candidates) or self._paths is not None

    @property
    def needs_layout_check(self) -> bool:
        return self.supports_weights and not self._checked

    def qk_weights(self) -> QKWeights:
        return self._checked_layout().qk_weights(self.module)

    def qk_rows(self) -> QKRows:
        return self._checked_layout().qk_rows(self.module)

    def _checked_layout(self) -> QKLayout:
        if self.layout is None or not self._checked:
            why = self.layout_error or "its layout is checked at the first probed forward"
            raise LayoutUnknownError(f"the weights of {self.name!r} are not read: {why}")
        return self.layout

    def _layout_sources(self) -> list[Tensor]:
        seen, out = set(), []
        if self._paths is not None:
            layouts = [QKLayout(self._paths[0], self._paths[1], "blocks", 1, 1, 1)]
        else:
            layouts = self.layout_candidates
        for layout in layouts:
            for weight in layout.sources(self.module):
                if id(weight) not in seen:
                    seen.add(id(weight))
                    out.append(weight)
        return out

    def placed(self, call):
        """``call`` with its heads' placement under tensor parallelism checked against the query
        projection (:func:`~qkmonitor.attention.layouts.placed_heads`): kept, made None where the
        call holds every head on every rank (measured whole on each, as one process does), or
        the call refused by name (an :class:`UnreadCall` ``sharded``: NaN, one warning per
        layer), never a rank's calls counted as heads they are not."""
        placement = getattr(call, "placement", None)
        if placement is None:
            return call
        layouts = [c for c in self.layout_candidates if isinstance(c, QKLayout)]
        dims = {c.head_dim for c in layouts}
        queries = {c.q for c in layouts if c.k is not None}
        if self._paths is not None:
            queries = {self._paths[0]} if self._paths[1] is not None else set()
        q = getattr(call, "q", None)
        verdict = placed_heads(
            placement,
            call_head_dim=q.shape[-1] if isinstance(q, torch.Tensor) and q.dim() == 4 else None,
            rows=out_features(self.module, queries.pop()) if len(queries) == 1 else None,
            heads=self._known_heads() if layouts else None,
            head_dim=dims.pop() if len(dims) == 1 else None,
        )
        if isinstance(verdict, str):
            why = (
                f"its projections are sharded by rows across ranks ({TENSOR_PARALLEL}), and "
                f"{verdict}; its attention statistics are not measured"
            )
            return UnreadCall(why, why, sharded=True)
        call.placement = verdict
        return call

    def install_layout(self, probe: Probe) -> Callable[[], None]:
        def observe(call) -> None:
            call = self.placed(call)
            # judged now, inside the forward: the weights are those that computed the call (an
            # optimizer step may change them before the probe closes)
            refused = getattr(call, "no_layout", None)  # its attention has no W_QK to check
            if refused is not None and self._verdict is None:
                self._verdict = refused
            evidence = getattr(call, "evidence", None)
            if evidence is not None and self._verdict is None:
                try:
                    with torch.no_grad(), side_computation():
                        self._verdict = self._judge(evidence)
                except Exception as err:  # noqa: BLE001 -- a metric problem must never stop training
                    self._verdict = f"the layout check failed ({type(err).__name__}: {err})"
            probe.observe(call)

        self._verdict = None
        return route_probe(self.module, probe, self._layout_sources, observe, self._known_heads())

    def _known_heads(self) -> int | None:
        """H where the layout candidates agree on it before any call (a softmax over another dim 1
        is then not this layer's attention)."""
        counts = {layout.num_heads for layout in self.layout_candidates}
        return counts.pop() if len(counts) == 1 else None

    @property
    def layout_ready(self) -> bool:
        return self.layout is not None and self._checked

    @property
    def num_heads_hint(self) -> int:
        layout = self.layout or (self.layout_candidates[0] if self.layout_candidates else None)
        shards = getattr(layout, "shards", None)  # (a latent layout is read whole)
        if shards is not None:  # every rank's heads
            return shards.placement.total
        return (
            layout.num_heads if layout is not None else (attribute(self.module, HEADS_NAMES) or 1)
        )

    @property
    def head_placement(self) -> HeadPlacement | None:
        shards = getattr(self.layout, "shards", None) if self._checked else None
        return None if shards is None else shards.placement

    @property
    def has_qk_norm(self) -> bool:
        return qk_norm_modules(self.module) is not None

    def weights_copy(self) -> SimpleNamespace:
        """A CPU copy of the projection weights the candidates read (``(out, in)`` layout, whole
        where they are sharded), which ``layout.qk_weights`` reads like the module: values as they
        are now, for a check to come."""
        copy = SimpleNamespace()
        for path in self._copied_paths():
            weight, _ = projection(self.module, path)
            # a sharded weight is gathered (a collective every rank makes, as each copies its
            # layers at the same probe, its paths in the same order)
            weight = whole(weight)
            owner = copy
            *parents, leaf = path.split(".")
            for part in parents:
                owner = owner.__dict__.setdefault(part, SimpleNamespace())
            setattr(owner, leaf, weight.detach().to("cpu", copy=True))
        return copy

    def _copied_paths(self) -> tuple[str, ...]:
        """The projection paths :meth:`weights_copy` reads, each once, in the candidates' order
        (query, then key, candidate after candidate): an order that is the module's own, the same
        on every rank by construction, never a set's (its order follows the string hashes, which
        differ between processes started with different ``PYTHONHASHSEED``s, and each sharded
        weight's gather is a collective the ranks must make in one order)."""
        if self._paths is not None:
            pairs = [self._paths]
        else:
            pairs = [(layout.q, layout.k) for layout in self.layout_candidates]
        return tuple(dict.fromkeys(path for pair in pairs for path in pair if path))

    def _judge(self, evidence: LayoutEvidence) -> QKLayout | str:
        """The layout the evidence of one forward confirms, or why none (see
        :func:`check_layout`)."""
        if not all(id(w) in evidence.inputs for w in self._layout_sources()):
            inner = _sharded_inside(self.module)
            if inner is None:
                return _UNSEEN_PROJECTIONS
            return (
                f"{_UNSEEN_PROJECTIONS} with the weights the module holds: {inner!r} is sharded "
                "by FSDP2 on its own, which swaps its weight for the gathered one inside the "
                "forward (fully_shard the attention module or its block instead)"
            )
        candidates = self.layout_candidates
        sources = self._layout_sources()
        q_shard, k_shard = (
            evidence.shards.get(id(sources[0])),
            evidence.shards.get(id(sources[-1])),
        )
        if self._paths is not None:  # counts from the call: H from the queries, H_kv from the keys
            heads = (evidence.q if evidence.q is not None else evidence.logits).shape[1]
            kv = (
                evidence.k.shape[1]
                if evidence.k is not None and evidence.k.shape[1] < heads
                else None
            )
            local = heads
            if q_shard is not None:  # this rank's heads of tensor parallelism: all of them
                heads *= q_shard.ranks
                kv = None if kv is None else kv * (1 if k_shard is None else k_shard.ranks)
            candidates = infer_layouts(self.module, heads=heads, kv_heads=kv, paths=self._paths)
            if not candidates:
                return (
                    f"its projections {self._paths} do not split into the {local} heads of its "
                    "attention call"
                )
        if q_shard is not None:
            localized = [c.localized(q_shard, k_shard) for c in candidates]
            if all(isinstance(c, str) for c in localized):
                return f"{localized[0]} ({TENSOR_PARALLEL})"
            candidates = [c for c in localized if not isinstance(c, str)]
        return check_layout(self.module, candidates, evidence)

    def check_layout(self, result) -> str | None:
        """Keep the layout the first probed forward confirmed; a message when it confirmed none
        (the spectrum metrics are then NaN). Called once, when the first layout probe closes."""
        if self._checked:
            return None
        self._checked = True
        verdict, self._verdict = getattr(self, "_verdict", None), None
        if isinstance(verdict, QKLayout):
            self.layout, self.layout_error = verdict, None
            if verdict.scale_unknown is not None:  # the weights are read, their scale is not
                return (
                    f"layer {self.name!r}: the factor between its projections' q·kᵀ and the "
                    f"logits of its softmax is not known ({verdict.scale_unknown}); its "
                    "qk_spectral_norm (sigma_1 * scale) is NaN, its kappa and the other "
                    "scale-free spectrum metrics are read"
                )
            return None
        why = (
            verdict
            if verdict is not None
            else "no SDPA or 4-D softmax call was seen in its forward"
        )
        if verdict is None or verdict.startswith(_UNSEEN_PROJECTIONS):
            if self._trusted:
                return f"layer {self.name!r}: {why}, so its AttentionSpec layout is used unchecked"
            self.layout, self.layout_error = None, why
            return (
                f"layer {self.name!r}: {why}, so its weight layout cannot be checked; its "
                "spectrum metrics are NaN"
            )
        self.layout, self.layout_error = None, why
        return f"layer {self.name!r}: {why}; its spectrum metrics (kappa, ...) are NaN"


_UNSEEN_PROJECTIONS = "its projections were not called as F.linear, addmm or x @ W.T in its forward"


def _sharded_inside(module: nn.Module) -> str | None:
    """The name of the first module inside ``module`` (itself left out) that FSDP2 shards on its
    own (``fully_shard`` makes its class ``FSDP<name>``, with ``unshard``), or None."""
    for name, sub in module.named_modules():
        if name and type(sub).__name__.startswith("FSDP") and callable(getattr(sub, "unshard", 0)):
            return name
    return None


class LayoutUnknownError(ValueError):
    """A layer's W_Q/W_K layout is not (yet, or not at all) confirmed by its forward."""


class InterceptedAttentionLayer(LayoutChecked, AttentionLayer):
    """An attention module measured by interception, its weights read by layout.

    Args:
        name, module, index: as :class:`~qkmonitor.attention.adapters.AttentionLayer`.
        candidates: layouts its weights may have
        (:func:`qkmonitor.attention.layout_names.infer_layouts`);
            empty for a module whose projections are not recognised (statistics only).
        kind: the family, shown at discovery.
        trusted: the candidate was stated by the user (an :class:`AttentionSpec`): used until a
            forward checks it.
        heads_from_call: the projections are known, the head counts come from the first call.
        latent: a multi-head latent attention's reading (:mod:`qkmonitor.attention.latent`),
            used as it is: its queries and keys go through norms and RoPE between the
            projections and the call, which no layout check reproduces; its names and the
            shapes they must fit are the evidence.
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        index: int = 0,
        *,
        candidates: list[QKLayout] = (),
        kind: str = "intercepted",
        trusted: bool = False,
        heads_from_call: bool = False,
        latent: LatentLayout | None = None,
    ) -> None:
        AttentionLayer.__init__(self, name, module, index)
        self.kind = kind
        if latent is not None:
            self.set_layouts([latent], trusted=True)
            self._checked = True
        else:
            self.set_layouts(list(candidates), trusted=trusted, heads_from_call=heads_from_call)

    @property
    def supports_stats(self) -> bool:
        return True

    def install(self, probe: Probe) -> Callable[[], None]:
        def observe(call) -> None:
            probe.observe(self.placed(call))

        return route_probe(self.module, probe, observe=observe, heads=self._known_heads())


def adapt_intercepted(name: str, module: nn.Module, index: int) -> InterceptedAttentionLayer | None:
    """Any module that computes attention (SDPA or a softmax in its code or its children's) and
    has query/key projections of a recognised name, or an attention name and an SDPA call."""
    if isinstance(module, NOT_ATTENTION):
        return None
    own = computes_attention(type(module))
    named = bool(ATTENTION_NAME.search(type(module).__name__))
    kind = f"{library(module)}.{type(module).__name__}"
    latent = find_latent(module)
    if latent is not None and (own or named or child_computes(module)):
        return InterceptedAttentionLayer(name, module, index, kind=kind, latent=latent)
    paths = projections_of(module)
    if (
        paths is None
    ):  # statistics only (its weights are not found), if its own code computes attention
        inner = any(
            projections_of(child) is not None for child in module.modules() if child is not module
        )
        if not inner and (own == "sdpa" or (own and named)):
            return InterceptedAttentionLayer(name, module, index, kind=kind)
        return None
    # the attention call may sit in the module's code, a child's (x-transformers' `attend`), or a
    # module-level function its forward calls (GPT-NeoX and ModernBERT before transformers 5): an
    # attention-like name with projections of a known name is enough; the first probe checks it
    if not (own or named or child_computes(module)):
        return None
    candidates = infer_layouts(module)
    return InterceptedAttentionLayer(
        name, module, index, candidates=candidates, kind=kind, heads_from_call=not candidates
    )


def unmeasured_attention_like(
    model: nn.Module, layers: list[AttentionLayer]
) -> list[tuple[str, str]]:
    """``(name, class)`` of modules that look like attention (:func:`looks_like_attention`) but are
    neither a found layer, inside one, nor around one (a block holding a found layer)."""
    found = [layer.name for layer in layers]

    def related(name: str) -> bool:
        return any(
            name == f
            or name.startswith(f + ".")
            or f.startswith(name + ".")
            or name == ""
            or f == ""
            for f in found
        )

    return [
        (name, type(module).__name__)
        for name, module in model.named_modules()
        if name
        and not related(name)
        and not isinstance(module, NOT_ATTENTION)
        and looks_like_attention(module)
    ]


def register_attention(spec: AttentionSpec) -> None:
    """Recognise the modules ``spec`` matches, before every built-in rule (:class:`AttentionSpec`).

    Registering a spec of the same family name again replaces it.

    Raises:
        ValueError: if ``spec`` is not an :class:`AttentionSpec`.
    """
    if not isinstance(spec, AttentionSpec):
        raise ValueError(
            f"Expected `spec` to be a qkmonitor.AttentionSpec, got {type(spec).__name__}"
        )

    def adapt(name: str, module: nn.Module, index: int) -> InterceptedAttentionLayer | None:
        if not spec.matches(name, module):
            return None
        layout = spec.layout(module)
        if isinstance(layout, LatentLayout):
            return InterceptedAttentionLayer(name, module, index, kind=spec.family, latent=layout)
        return InterceptedAttentionLayer(
            name, module, index, candidates=[layout], kind=spec.family, trusted=True
        )

    register_family(
        spec.family,
        adapt,
        priority=0,
        looked_for=f"modules matching the AttentionSpec {spec.family!r}",
    )


register_family(
    "intercepted",
    adapt_intercepted,
    priority=90,
    looked_for=(
        "any module calling F.scaled_dot_product_attention, flex_attention or a 4-D softmax with "
        "query/key projections named q_proj/k_proj, query/key, to_q/to_k, wq/wk, q/k, q_lin/k_lin, "
        "or fused qkv, c_attn, query_key_value, Wqkv, qkv_proj (timm, litgpt, x-transformers, "
        "nanoGPT-style modules), or latent ones (kv_a_proj_with_mqa/kv_b_proj, wkv_a/wkv_b)"
    ),
)

"""A user's statement of how to read an attention module that no rule covers: :class:`AttentionSpec`
(registered with :func:`qkmonitor.register_attention`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from torch import Tensor, nn

from qkmonitor.attention.latent import LatentLayout, LatentNames, find_latent
from qkmonitor.attention.layout_names import infer_layouts, positive_int
from qkmonitor.attention.layouts import (
    FUSED_ORDERS,
    PAIRINGS,
    QKLayout,
    modulo_index,
    out_features,
    resolve,
)
from qkmonitor.validation import is_real

__all__ = ["AttentionSpec"]


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
            if value is not None and not isinstance(value, str) and positive_int(value) is None:
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
            return self._latent_layout(module)
        paths = (self.qkv, None) if self.qkv is not None else (self.q, self.k)
        for path in paths:
            if (
                path is not None
                and out_features(module, path) is None
                and not isinstance(resolve(module, path), Tensor)
            ):
                raise ValueError(
                    f"`{path}` is not a projection of {type(module).__name__} (expected a module "
                    "with a 2-D weight, or a 2-D parameter)"
                )
        scale = resolve(module, self.scale) if isinstance(self.scale, str) else self.scale
        heads = self._count(module, "num_heads")
        kv_heads = self._count(module, "num_kv_heads")
        candidates = infer_layouts(
            module,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=self._count(module, "head_dim"),
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

    def _latent_layout(self, module: nn.Module) -> LatentLayout:
        layout = find_latent(module, self.latent)
        if layout is None:
            raise ValueError(
                f"`latent`: {type(module).__name__} has no latent projections "
                f"{self.latent.kv_down!r}/{self.latent.kv_up!r} with a query projection, "
                "of shapes that split into the heads (give `num_heads`, `rope_dim`, "
                "`latent_dim`)"
            )
        return layout

    def _count(self, module: nn.Module, field_name: str) -> int | None:
        """A count as stated: an int, or the module's positive int at the path given."""
        value = getattr(self, field_name)
        if isinstance(value, str):
            found = positive_int(resolve(module, value))
            if found is None:
                raise ValueError(
                    f"`{field_name}={value!r}`: {type(module).__name__} has no positive int there"
                )
            return found
        return value

"""Computing a saved model's QK spectrum one layer at a time, and writing a series of them as one
TensorBoard run through the spectrum engine's own recording path.

Each layer's query and key weights are read (:mod:`qkmonitor.scanning.names`,
:mod:`qkmonitor.scanning.modules`), measured by :func:`~qkmonitor.measures.layer_spectra.
spectrum_of_layers` (the live :class:`~qkmonitor.engine.QKSpectrum`'s function: bf16 weights are
computed in float32) and released before the next layer is read. The values are recorded by a
:class:`~qkmonitor.engine.QKSpectrum` bound, in a :class:`~qkmonitor.engine.Monitoring`, to a
stand-in model whose attention modules have the saved layers' names and head counts: so the tags,
the custom-scalars layout, the κ heatmaps and the singular-value histograms are the ones a live run
writes, at each model's step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
from torch import Tensor, nn

from qkmonitor.measures.catalogue import SPECTRUM, names_of
from qkmonitor.measures.layer_spectra import (
    SPECTRUM_METRICS,
    LayerSpectra,
    QKWeights,
    spectrum_of_layers,
)
from qkmonitor.scanning.files import ModelFiles, ScanError, expand, open_model
from qkmonitor.scanning.names import LayerPlan, plan_layers

__all__ = ["LayerScan", "ModelScan", "layer_plans", "scan", "scan_model", "write_scan"]


@dataclass
class LayerScan:
    """One layer's QK spectrum, as the live monitor computes it.

    Attributes:
        name: the attention module's path in the model.
        metrics: metric (``kappa``, ``kappa_eig``, ``eig_mean``, ``eig_var``, ``qk_erank``,
            ``qk_spectral_norm``) -> (num_heads,) float32 tensor.
        singular_values: (num_heads, d_k) float32, descending.
        undefined: metric -> (num_heads,) bool, True where a NaN is NaN by definition.
        qk_norm: the layer normalizes q and k per head (QK-norm).
    """

    name: str
    metrics: dict[str, Tensor]
    singular_values: Tensor
    undefined: dict[str, Tensor]
    qk_norm: bool = False

    @property
    def num_heads(self) -> int:
        return self.singular_values.shape[0]


@dataclass
class ModelScan:
    """One saved model's scan: where it is, its step, its layers."""

    path: Path
    step: int
    layers: list[LayerScan]

    def spectra(self) -> LayerSpectra:
        """The layers' values as the spectrum engine records them."""
        out = LayerSpectra()
        for layer in self.layers:
            out.singular_values.append(layer.singular_values)
            for name in SPECTRUM_METRICS:
                out.metrics[name].append(layer.metrics[name])
                out.undefined[name].append(layer.undefined[name])
        return out


def layer_plans(model: ModelFiles, model_class: str | None = None) -> list[LayerPlan]:
    """The attention layers of an opened model: a Lightning checkpoint's from its module, a
    Hugging Face folder's from its tensor names and config."""
    if model.kind == "lightning":
        from qkmonitor.scanning.modules import plan_module_layers

        return plan_module_layers(model, model_class)
    return plan_layers(model)


def scan_model(model: ModelFiles, plans: Sequence[LayerPlan]) -> ModelScan:
    """Measure every layer of ``model``, reading one layer's weights at a time."""
    layers = []
    staging = Float32Staging()
    with torch.no_grad():
        for plan in plans:
            weights = staging.stage(plan.read(model.tensors))
            spectra = spectrum_of_layers([weights])
            qk_norm = weights.qk_norm
            del weights  # the next layer is read only after this one is released
            layers.append(
                LayerScan(
                    plan.name,
                    {m: spectra.metrics[m][0] for m in SPECTRUM_METRICS},
                    spectra.singular_values[0],
                    {m: spectra.undefined[m][0] for m in SPECTRUM_METRICS},
                    qk_norm,
                )
            )
    return ModelScan(model.path, model.step, layers)


class Float32Staging:
    """Two float32 buffers, reused from layer to layer, that a layer's bf16/fp16 query and key
    weights are copied into (exactly: every bf16/fp16 value is a float32 value).

    Converting with ``.float()`` allocates a fresh buffer per layer; the allocator hands a block
    that large back to the system when it is freed, so every layer pays the page faults of a new
    mapping again: 0.29 s against 0.05 s for the copy from the mapped file, for one 8192 x 8192
    bf16 weight (2026-12-04, 2-CPU VM; docs/benchmarks.md). float32 and float64 weights pass
    through untouched.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def stage(self, weights: QKWeights) -> QKWeights:
        w_q, w_k = self._copy("q", weights.w_q), self._copy("k", weights.w_k)
        return replace(weights, w_q=w_q, w_k=w_k)

    def _copy(self, slot: str, weight: Tensor) -> Tensor:
        if weight.dtype not in (torch.bfloat16, torch.float16) or weight.device.type != "cpu":
            return weight
        buffer = self._buffers.get(slot)
        if buffer is None or buffer.numel() < weight.numel():
            buffer = self._buffers[slot] = torch.empty(weight.numel(), dtype=torch.float32)
        return buffer[: weight.numel()].view(weight.shape).copy_(weight)


def scan(path: str | Path, *, model: str | None = None) -> list[LayerScan]:
    """The QK spectrum of one saved model, per layer: the numbers ``qkmonitor scan`` writes.

    Args:
        path: a Hugging Face model folder (``config.json`` and safetensors or
            ``pytorch_model.bin``), a Trainer ``checkpoint-N`` folder, or a Lightning ``.ckpt``.
        model: ``package.module:Class`` of the LightningModule of a ``.ckpt`` that is not a
            bundled model's.

    Returns:
        One :class:`LayerScan` per attention layer, in the model's order.

    Raises:
        ScanError: (a ValueError) what cannot be read, with the path and what was expected.

    Example::

        >>> import tempfile
        >>> from lightning.pytorch import Trainer
        >>> import qkmonitor
        >>> from qkmonitor.models import TransformerConfig
        >>> from qkmonitor.models.tasks import AssociativeRecallDataModule, CausalLMTask
        >>> data = AssociativeRecallDataModule(num_pairs=2, num_queries=2, batch_size=4,
        ...                                    train_size=8, val_size=4)
        >>> model = CausalLMTask(TransformerConfig(vocab_size=data.vocab_size, d_model=16,
        ...                                        n_heads=2, max_seq_len=data.seq_len))
        >>> trainer = Trainer(max_steps=1, logger=False, enable_checkpointing=False,
        ...                   enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(model, data)
        >>> folder = tempfile.TemporaryDirectory()
        >>> trainer.save_checkpoint(f"{folder.name}/last.ckpt")
        >>> for layer in qkmonitor.scan(f"{folder.name}/last.ckpt"):
        ...     kappa = layer.metrics["kappa"]  # one value per head, in [0, 1]
        ...     print(layer.name, kappa.shape, bool(0 <= kappa.min() and kappa.max() <= 1))
        blocks.0.attn torch.Size([2]) True
        blocks.1.attn torch.Size([2]) True
        >>> folder.cleanup()
    """
    found = expand([path])
    if len(found) != 1:
        raise ScanError(
            path, f"holds {len(found)} checkpoints; give one (qkmonitor scan writes a series)"
        )
    opened = open_model(found[0][0], found[0][1], 0)
    return scan_model(opened, layer_plans(opened, model)).layers


def write_scan(
    paths: Sequence[str | Path],
    log_dir: str | Path,
    *,
    per_head: bool = False,
    model_class: str | None = None,
    on_model: Callable[[ModelScan], None] | None = None,
) -> list[ModelScan]:
    """Scan every model of ``paths`` and write them as one TensorBoard run in ``log_dir``, each at
    its step (:func:`~qkmonitor.scanning.files.expand`).

    Args:
        per_head: log every head's values too (``{prefix}/{metric}/layer_LL_head_HH``).
        model_class: as :func:`scan`'s ``model``.
        on_model: called with each model's scan once it is written.

    Raises:
        ScanError: a path that cannot be read, or models whose layers differ.
    """
    from torch.utils.tensorboard import SummaryWriter

    from qkmonitor.engine.session import Monitoring

    found = expand(paths)
    scans: list[ModelScan] = []
    monitoring = engine = first = None
    try:
        for position, (path, step) in enumerate(found):
            opened = open_model(path, step, position)
            plans = layer_plans(opened, model_class)
            if first is None:
                first = plans
                engine = _engine_class()(
                    every_n_steps=1, per_head=per_head, visuals_every_n_probes=1
                )
                stand_in = _stand_in(plans, opened, model_class)
                hparams = {"scan": ", ".join(str(p) for p, _ in found)[:1000]}
                writer = SummaryWriter(str(log_dir))
                monitoring = Monitoring(
                    stand_in, [engine], writer=writer, hparams=hparams, hparams_metrics=()
                )
            _check_same_layers(first, plans, path)
            result = scan_model(opened, plans)
            engine.record_scan(monitoring.host, result.step, result.spectra())
            scans.append(result)
            if on_model is not None:
                on_model(result)
    finally:
        if monitoring is not None:
            monitoring.close()
    return scans


def _check_same_layers(first: list[LayerPlan], plans: list[LayerPlan], path: Path) -> None:
    if [(p.name, p.num_heads) for p in plans] != [(p.name, p.num_heads) for p in first]:
        raise ScanError(
            path,
            f"its attention layers ({len(plans)}) differ from the first model's ({len(first)}); "
            "expected checkpoints of one model",
        )


def _engine_class() -> type:
    """The spectrum engine recording values read from files (imported with the engines, when a
    run is written): the six spectrum metrics, no update metrics (no optimizer stepped between
    two saved models)."""
    from qkmonitor.engine.spectrum import QKSpectrum

    class ScanSpectrum(QKSpectrum):
        @property
        def metric_names(self) -> tuple[str, ...]:
            return tuple(n for n in names_of(SPECTRUM) if n in SPECTRUM_METRICS)

        def record_scan(self, host, step: int, spectra: LayerSpectra) -> None:
            self.record(
                host,
                spectra.metrics,
                step,
                undefined=spectra.undefined,
                histograms=partial(self._histograms, spectra.singular_values),
            )

    return ScanSpectrum


class SavedAttention(nn.Module):
    """An attention module with a saved layer's head count (``SupportsQKMonitor``): what the
    engine binds to, so that its layers carry the saved model's names."""

    def __init__(self, num_heads: int, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads, self.qk_norm = num_heads, qk_norm

    def qk_weights(self) -> QKWeights:
        w = torch.zeros(self.num_heads, 1)
        return QKWeights(w, w, self.num_heads, self.num_heads, 1.0, qk_norm=self.qk_norm)


def _stand_in(plans: list[LayerPlan], model: ModelFiles, model_class: str | None) -> nn.Module:
    """A module tree with one :class:`SavedAttention` at each layer's path."""
    root = nn.Module()
    for plan in plans:
        qk_norm = plan.read(model.tensors).qk_norm if model.kind == "lightning" else False
        qk_norm = qk_norm or any(
            f"{plan.name}.{n}.weight" in model.tensors for n in ("q_norm", "q_layernorm")
        )
        owner = root
        *parents, leaf = plan.name.split(".") if plan.name else ["attention"]
        for part in parents:
            child = dict(owner.named_children()).get(part)
            if child is None:
                child = nn.Module()
                owner.add_module(part, child)
            owner = child
        owner.add_module(leaf, SavedAttention(plan.num_heads, qk_norm))
    return root

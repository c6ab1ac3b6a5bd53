"""Lightning checkpoints: the module rebuilt from the checkpoint and its attention found as in a
live run (:func:`~qkmonitor.attention.adapters.find_attention_layers`).

A checkpoint of a bundled task (``qkmonitor train``) holds its model's config among its
hyper-parameters: the model is built from it (``qkmonitor.models``) and takes the checkpoint's
weights. A user's LightningModule is named as code (``--model package.module:Class``) and loaded
the Lightning way, ``Class.load_from_checkpoint``, with ``weights_only=True``.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from qkmonitor.attention.adapters import AttentionLayer, find_attention_layers
from qkmonitor.scanning.files import ModelFiles, ScanError, TensorSource
from qkmonitor.scanning.names import LayerPlan

__all__ = ["plan_module_layers"]


def plan_module_layers(model: ModelFiles, model_class: str | None = None) -> list[LayerPlan]:
    """The attention layers of a Lightning checkpoint's module.

    Args:
        model: the opened checkpoint.
        model_class: ``package.module:Class`` of its LightningModule; None for a bundled model.

    Raises:
        ScanError: the class cannot be imported or loaded, the checkpoint is no bundled model's,
            or the module has no attention.
    """
    module = _user_module(model, model_class) if model_class else _bundled_module(model)
    try:
        layers = find_attention_layers(module)
    except ValueError as err:
        raise ScanError(model.path, f"no attention found in its module: {err}") from None
    return [_plan(model, layer) for layer in layers]


def _plan(model: ModelFiles, layer: AttentionLayer) -> LayerPlan:
    def read(source: TensorSource):
        try:
            return layer.qk_weights()
        except Exception as err:  # noqa: BLE001 -- said in one line, with the layer
            raise ScanError(
                model.path, f"layer {layer.name!r}: its query/key weights cannot be read: {err}"
            ) from None

    try:
        heads = layer.num_heads_hint
    except Exception:  # noqa: BLE001 -- read when its weights are
        heads = 1
    return LayerPlan(layer.name, (), heads, read)


def _user_module(model: ModelFiles, spec: str) -> nn.Module:
    where, _, name = spec.partition(":")
    try:
        cls: Any = getattr(importlib.import_module(where), name) if name else None
    except (ImportError, AttributeError) as err:
        raise ScanError(spec, f"cannot import the model class: {err}") from None
    if cls is None or not callable(getattr(cls, "load_from_checkpoint", None)):
        raise ScanError(spec, "expected package.module:Class naming a LightningModule")
    try:
        module = cls.load_from_checkpoint(model.path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 -- the user's class: said in one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ScanError(model.path, f"{name}.load_from_checkpoint failed: {first}") from None
    return module


def _bundled_module(model: ModelFiles) -> nn.Module:
    from qkmonitor.models import (
        DecoderLM,
        EncoderClassifier,
        EncoderDecoder,
        TransformerConfig,
        VisionEncoder,
    )

    hint = (
        "expected a checkpoint of a bundled model (qkmonitor train); for your own "
        "LightningModule, give it with --model package.module:Class"
    )
    fields = model.config.get("config")
    if not isinstance(fields, dict):
        raise ScanError(model.path, f"no model config among its hyper-parameters; {hint}")
    try:
        config = TransformerConfig(**fields)
    except (TypeError, ValueError) as err:
        raise ScanError(model.path, f"its model config is not a bundled one ({err}); {hint}")
    state = {
        key.removeprefix("model."): value
        for key, value in model.tensors.state_items()
        if key.startswith("model.")
    }
    for cls in (DecoderLM, EncoderDecoder, VisionEncoder, EncoderClassifier):
        try:
            module = cls(config)
            module.load_state_dict(state, strict=True)
        except (RuntimeError, ValueError, TypeError, KeyError):
            continue
        return module
    raise ScanError(model.path, f"its weights fit none of the bundled models; {hint}")

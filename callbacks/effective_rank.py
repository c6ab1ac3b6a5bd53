"""EffectiveRankMonitor: how much rank the residual stream and the attention matrices keep."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor, nn

from qkmonitor.alerts import MALIGNANT_COLLAPSE_RULE, RANK_COLLAPSE_RULE
from qkmonitor.dashboards import attention_image
from qkmonitor.functional import effective_rank, hidden_state_metrics
from qkmonitor.metrics import HeadMean

from .base import ActivationMonitor

__all__ = ["EffectiveRankMonitor"]

HEAD_METRICS = ("attn_erank", "attn_erank_norm", "attn_entropy_norm")
LAYER_METRICS = ("hidden_erank", "hidden_collapse")


class EffectiveRankMonitor(ActivationMonitor):
    r"""Log the effective rank of each block's output and of each head's attention matrix.

    At probe steps, on a capped slice of the training forward — the first
    ``max_probe_sequences`` sequences and ``max_probe_tokens`` tokens:

    - ``hidden_erank``: :math:`\mathrm{erank}(X) = \exp(-\sum_i p_i \log p_i)`,
      :math:`p_i = \sigma_i / \sum_j \sigma_j`, of each sequence's block output ``X`` (n x d);
    - ``hidden_collapse``: :math:`\|X - \mathbf{1}\bar x^\top\|_F / \|X\|_F` (Dong et al. 2021):
      → 0 under rank collapse. ``hidden_erank`` alone misleads: a large mean direction in a healthy
      residual stream keeps it low, which is why the alert watches ``hidden_collapse``;
    - ``attn_erank``: erank of each head's attention matrix A (rows of the slice, all keys);
      ``attn_erank_norm`` = ``attn_erank / min(rows, keys)`` in (0, 1];
    - ``attn_entropy_norm``: the mean normalized row entropy of the same slice.

    Values are means over the probe sequences (and ranks, through torchmetrics). The block of an
    attention layer is its parent module (``blocks.3`` for ``blocks.3.attn``), or the attention
    module itself when the parent is a container or the model; ``blocks=`` overrides it.

    Logged keys: ``{prefix}/hidden_erank/layer_LL``, ``{prefix}/hidden_collapse/layer_LL`` (one
    value per layer), ``{prefix}/attn_erank/layer_LL``,
    ``{prefix}/attn_erank_norm/layer_LL``, ``{prefix}/attn_entropy_norm/layer_LL`` (each with
    ``_min`` and ``_max`` over heads), per head with ``per_head=True``,
    ``{prefix}/alerts/rank_collapse``, ``{prefix}/alerts/malignant_collapse``, and (TensorBoard
    only) images ``{prefix}/attention/layer_LL/head_HH`` of the first probe sequence's attention
    for the first ``pattern_heads`` heads.

    Default alerts: ``hidden_collapse <= 1e-3`` (rank collapse) and ``attn_entropy_norm <= 0.1``
    together with ``attn_erank_norm <= 0.2`` (malignant collapse: sparse *and* low rank; sparse,
    identity-like attention is benign and does not fire).

    Args:
        max_probe_sequences: sequences of the batch measured.
        max_probe_tokens: tokens (query rows) per sequence measured.
        blocks: the modules whose outputs are the residual stream after each layer, in layer
            order (a list, or a function of the model); default: derived from the layers.
        pattern_heads: heads per layer whose attention pattern is logged as an image (0: none).
        **kwargs: see :class:`~qkmonitor.callbacks.base.AttentionMonitor`.

    Example::

        trainer = Trainer(callbacks=[EffectiveRankMonitor(every_n_steps=100, max_probe_tokens=256)])
    """

    metric_names = (*LAYER_METRICS, *HEAD_METRICS)
    layer_metrics = frozenset(LAYER_METRICS)
    default_rules = (RANK_COLLAPSE_RULE, MALIGNANT_COLLAPSE_RULE)

    def __init__(self, *args, max_probe_sequences: int = 4, max_probe_tokens: int = 128,
                 blocks: Sequence[nn.Module] | Callable[[nn.Module], Sequence[nn.Module]] | None = None,
                 pattern_heads: int = 4, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for name, value in (("max_probe_sequences", max_probe_sequences), ("max_probe_tokens", max_probe_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Expected `{name}` to be a positive int, got {value!r}")
        if isinstance(pattern_heads, bool) or not isinstance(pattern_heads, int) or pattern_heads < 0:
            raise ValueError(f"Expected `pattern_heads` to be an int >= 0, got {pattern_heads!r}")
        self.pattern_heads = pattern_heads
        self._patterns: dict[int, Tensor] = {}
        self.max_probe_sequences = max_probe_sequences
        self.max_probe_tokens = max_probe_tokens
        self._blocks_spec = blocks
        self._hooks: list = []
        self._hidden: dict[int, Tensor] = {}

    def _setup_probes(self, pl_module: pl.LightningModule) -> None:
        self.blocks = self._find_blocks(pl_module)
        self._batch_first = [getattr(layer.module, "batch_first", True) for layer in self.layers]
        heads = [layer.qk_weights().num_heads for layer in self.layers]
        device = pl_module.device
        self._head_means = [{m: HeadMean(h).to(device) for m in HEAD_METRICS} for h in heads]
        self._layer_means = [{m: HeadMean(1).to(device) for m in LAYER_METRICS} for _ in heads]

    def _find_blocks(self, model: nn.Module) -> list[nn.Module]:
        if self._blocks_spec is not None:
            blocks = list(self._blocks_spec(model) if callable(self._blocks_spec) else self._blocks_spec)
            if len(blocks) != len(self.layers):
                raise ValueError(
                    f"Expected `blocks` to give one module per attention layer ({len(self.layers)}), got {len(blocks)}"
                )
            return blocks
        found = []
        for layer in self.layers:
            parent_name = layer.name.rpartition(".")[0]
            parent = model.get_submodule(parent_name) if layer.name else model
            container = isinstance(parent, (nn.ModuleList, nn.ModuleDict)) or parent is model
            found.append(layer.module if container else parent)
        return found

    def _set_probes(self, enabled: bool) -> None:
        slice_ = (self.max_probe_sequences, self.max_probe_tokens)
        for layer in self.layers:
            layer.set_probe(enabled, probs_slice=slice_ if enabled else None)
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._hidden = [], {}
        if enabled:
            self._hooks = [block.register_forward_hook(self._hidden_hook(i)) for i, block in enumerate(self.blocks)]

    def _hidden_hook(self, index: int):
        def hook(module: nn.Module, args, output) -> None:
            x = output[0] if isinstance(output, (tuple, list)) else output
            if not isinstance(x, Tensor) or x.dim() != 3:
                return
            if not self._batch_first[index]:  # (N, B, d) -> (B, N, d)
                x = x.transpose(0, 1)
            self._hidden[index] = x[: self.max_probe_sequences, : self.max_probe_tokens].detach().clone()

        return hook

    def _measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, list[Tensor]]:
        values: dict[str, list[Tensor]] = {m: [] for m in (*LAYER_METRICS, *HEAD_METRICS)}
        for i, layer in enumerate(self.layers):
            probs = layer.pop_probs()
            self._update_layer(i, probs, layer.pop_stats())
            if probs is not None:  # the first probe sequence's patterns, for the images
                self._patterns[i] = probs[0, : self.pattern_heads].detach().cpu()
            for name, metric in (*self._layer_means[i].items(), *self._head_means[i].items()):
                with warnings.catch_warnings():  # compute() on every rank: it is the collective
                    warnings.filterwarnings("ignore", message=".*was called before the ``update`` method.*")
                    values[name].append(metric.compute().reshape(-1))  # torchmetrics squeezes (1,)
                metric.reset()
        return values

    def _draws_visuals(self) -> bool:
        return self.pattern_heads > 0

    def _images(self, values: dict[str, list[Tensor]]) -> dict[str, np.ndarray]:
        """The attention patterns of the first probe sequence, for the first ``pattern_heads`` heads."""
        images = super()._images(values)
        for i, heads in self._patterns.items():
            for h, probs in enumerate(heads):
                images[f"{self.prefix}/attention/layer_{i:02d}/head_{h:02d}"] = attention_image(probs)
        self._patterns = {}
        return images

    def _update_layer(self, i: int, probs: Tensor | None, stats) -> None:
        hidden = self._hidden.get(i)
        if hidden is not None:
            erank, collapse = hidden_state_metrics(hidden)  # (S,)
            self._layer_means[i]["hidden_erank"].update(erank[:, None])
            self._layer_means[i]["hidden_collapse"].update(collapse[:, None])
        if probs is not None:  # (S, H, R, M)
            rank = effective_rank(torch.linalg.svdvals(torch.nan_to_num(probs.double())))  # (S, H)
            self._head_means[i]["attn_erank"].update(rank)
            self._head_means[i]["attn_erank_norm"].update(rank / min(probs.shape[-2:]))
        if stats is not None:
            s, r = self.max_probe_sequences, self.max_probe_tokens
            n = stats.attended[:s, :, :r].double()
            norm = torch.where(n > 1, stats.entropy[:s, :, :r].double() / n.clamp_min(2).log(), float("nan"))
            self._head_means[i]["attn_entropy_norm"].update(norm.nanmean(dim=-1))  # (S, H)

"""EffectiveRankMonitor: how much rank the residual stream and the attention matrices keep."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import lightning.pytorch as pl
from torch import nn

from qkmonitor.alerts import Alert, AlertRule
from qkmonitor.attention.adapters import LayerSpec
from qkmonitor.engine import EffectiveRank, MonitorOptions
from qkmonitor.engine.options import keyword_only
from qkmonitor.engine.rank import MAX_PROBE_SEQUENCES, MAX_PROBE_TOKENS, PATTERN_HEADS

from .base import ActivationMonitor

__all__ = ["EffectiveRankMonitor"]


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

    Values are means over the probe sequences of every call in the window (and ranks, through
    torchmetrics). The block of an
    attention layer is its parent module (``blocks.3`` for ``blocks.3.attn``), or the attention
    module itself when the parent is a container or the model; ``blocks=`` overrides it.

    Logged keys: ``{prefix}/hidden_erank/layer_LL``, ``{prefix}/hidden_collapse/layer_LL`` (one
    value per layer), ``{prefix}/attn_erank/layer_LL``,
    ``{prefix}/attn_erank_norm/layer_LL``, ``{prefix}/attn_entropy_norm/layer_LL`` (each with
    ``_min`` and ``_max`` over heads), per head with ``per_head=True``,
    ``{prefix}/alerts/rank_collapse``, ``{prefix}/alerts/malignant_collapse``, and (TensorBoard
    only) images ``{prefix}/attention/layer_LL_head_HH`` of the first probe sequence's attention
    for the first ``pattern_heads`` heads, at every ``visuals_every_n_probes``-th probe.

    Default alerts: ``hidden_collapse <= 1e-3`` (rank collapse) and ``attn_entropy_norm <= 0.1``
    together with ``attn_erank <= 1.5`` (malignant collapse: sparse *and* low rank; sparse,
    identity-like attention is benign and does not fire; quiet while the loss is falling or the task
    is solved), each for 2 probes in a row.

    Args:
        max_probe_sequences: sequences of the batch measured.
        max_probe_tokens: tokens (query rows) per sequence measured.
        blocks: the modules whose outputs are the residual stream after each layer, in layer
            order (a list, or a function of the model); default: derived from the layers.
        pattern_heads: heads per layer whose attention pattern is logged as an image (0: none).
        probe_validation: also measure the first validation batch (``{prefix}/val/...``).
        The others (keyword-only) as for :class:`~qkmonitor.callbacks.QKSpectrumMonitor`.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from qkmonitor.callbacks import EffectiveRankMonitor
        >>> from qkmonitor.models import TransformerConfig
        >>> from qkmonitor.models.tasks import AssociativeRecallDataModule, CausalLMTask
        >>> data = AssociativeRecallDataModule(num_pairs=2, num_queries=2, batch_size=4,
        ...                                    train_size=8, val_size=4)
        >>> model = CausalLMTask(TransformerConfig(vocab_size=data.vocab_size, d_model=16,
        ...                                        n_heads=2, max_seq_len=data.seq_len))
        >>> monitor = EffectiveRankMonitor(every_n_steps=1, max_probe_tokens=256)
        >>> trainer = Trainer(max_steps=2, callbacks=[monitor], logger=False,
        ...                   enable_checkpointing=False, enable_progress_bar=False,
        ...                   enable_model_summary=False)
        >>> trainer.fit(model, data)
        >>> sorted(monitor.latest)
        ['attn_entropy_norm', 'attn_erank', 'attn_erank_norm', 'hidden_collapse', 'hidden_erank']
        >>> all(1 <= r.item() <= 16 for r in monitor.latest["hidden_erank"])  # d_model = 16
        True
    """

    engine: EffectiveRank

    @keyword_only
    def __init__(
        self,
        *,
        every_n_steps: int | None = None,
        per_head: bool = MonitorOptions.per_head,
        log_key_prefix: str = MonitorOptions.log_key_prefix,
        alerts: Sequence[AlertRule] | None = None,
        alert_action: str = MonitorOptions.alert_action,
        on_alert: Callable[[pl.Trainer, Alert], None] | None = None,
        layers: LayerSpec | None = None,
        visuals_every_n_probes: int = MonitorOptions.visuals_every_n_probes,
        defer_reads: bool | None = MonitorOptions.defer_reads,
        probe_validation: bool = False,
        max_probe_sequences: int = MAX_PROBE_SEQUENCES,
        max_probe_tokens: int = MAX_PROBE_TOKENS,
        blocks: Sequence[nn.Module] | Callable[[nn.Module], Sequence[nn.Module]] | None = None,
        pattern_heads: int = PATTERN_HEADS,
    ) -> None:
        engine = EffectiveRank(
            options=MonitorOptions.pick(locals()),
            max_probe_sequences=max_probe_sequences,
            max_probe_tokens=max_probe_tokens,
            blocks=blocks,
            pattern_heads=pattern_heads,
        )
        super().__init__(engine, probe_validation=probe_validation)

    @property
    def blocks(self) -> list[nn.Module]:
        """The modules whose outputs are read as the residual stream, one per layer."""
        return self.engine.blocks

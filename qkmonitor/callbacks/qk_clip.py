"""QKClip: after each optimizer step, bound every head's attention logits (Kimi Team 2025)."""

from __future__ import annotations

from qkmonitor.attention.adapters import LayerSpec
from qkmonitor.engine import MonitorOptions, QKClipEngine
from qkmonitor.engine.clip import DEFAULT_TAU
from qkmonitor.engine.options import keyword_only

from .base import ActivationMonitor

__all__ = ["QKClip"]


class QKClip(ActivationMonitor):
    r"""QK-Clip as a callback: every head whose largest attention logit exceeded ``tau`` in a step
    has its query and key projections scaled in place after that step's optimizer update, so that
    its logits shrink by :math:`\gamma_h = \min(1, \tau / S_h)`.

    The forward, the backward and the optimizer state are untouched, and heads at or below ``tau``
    are not written (:mod:`qkmonitor.attention.clip` says how the factor is split between W_Q and
    W_K). Layers with QK-norm are left alone. Under DDP the largest logit is taken over the ranks,
    so every rank scales alike. With gradient accumulation the step's first micro-batch is measured
    and the clip follows it, before that step's update.

    Logged keys (``LL`` layer, ``HH`` head, ``prefix`` = ``log_key_prefix``), at every clip step:
    ``{prefix}/clip_max_logit/...`` (:math:`S_h` before the clip), ``{prefix}/clip_factor/...``
    (:math:`\gamma_h`, 1 where the head was left alone; ``_min`` is the hardest clip of the layer)
    and ``{prefix}/clip_count/...`` (steps at which a head was clipped so far; kept in checkpoints),
    each with ``layer_LL``, ``_min``/``_max`` and, with ``per_head=True``, ``layer_LL_head_HH``.

    Args (keyword-only):
        tau: the bound on the scaled logits (``scale · q·k``), > 0; the paper's 100.
        every_n_steps: clip after every this-many optimizer steps (1: after each, as the paper).
        per_head: also log every head's values.
        log_key_prefix: first part of every tag.
        layers: which attention layers (default: every one discovered).

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from qkmonitor.callbacks import AttentionEntropyMonitor, QKClip
        >>> from qkmonitor.models import TransformerConfig
        >>> from qkmonitor.models.tasks import AssociativeRecallDataModule, CausalLMTask
        >>> data = AssociativeRecallDataModule(num_pairs=2, num_queries=2, batch_size=4,
        ...                                    train_size=8, val_size=4)
        >>> model = CausalLMTask(TransformerConfig(vocab_size=data.vocab_size, d_model=16,
        ...                                        n_heads=2, max_seq_len=data.seq_len))
        >>> clip, entropy = QKClip(tau=100.0), AttentionEntropyMonitor(every_n_steps=1)
        >>> trainer = Trainer(max_steps=2, callbacks=[clip, entropy], logger=False,
        ...                   enable_checkpointing=False, enable_progress_bar=False,
        ...                   enable_model_summary=False)
        >>> trainer.fit(model, data)
        >>> clip.latest["clip_factor"]  # a fresh model's logits are far below tau: no head scaled
        [tensor([1., 1.]), tensor([1., 1.])]
        >>> clip.latest["clip_count"]
        [tensor([0., 0.]), tensor([0., 0.])]
    """

    engine: QKClipEngine

    @keyword_only
    def __init__(
        self,
        *,
        tau: float = DEFAULT_TAU,
        every_n_steps: int = 1,
        per_head: bool = MonitorOptions.per_head,
        log_key_prefix: str = MonitorOptions.log_key_prefix,
        layers: LayerSpec | None = None,
    ) -> None:
        options = MonitorOptions(
            every_n_steps=every_n_steps,
            per_head=per_head,
            log_key_prefix=log_key_prefix,
            layers=layers,
            visuals_every_n_probes=0,  # its values are scalars: no images to draw
        )
        super().__init__(QKClipEngine(options=options, tau=tau))

    @property
    def tau(self) -> float:
        return self.engine.tau

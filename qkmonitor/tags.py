"""TensorBoard tag names: the stable contract between the callbacks, dashboards and reports.

``{prefix}/{metric}/layer_{LL}`` — mean over heads; ``{prefix}/{metric}_{max|min}/layer_{LL}`` —
the worst head; ``{prefix}/{metric}/layer_{LL}_head_{HH}`` — one head; ``{prefix}/run/{name}`` —
a value of the run, not of a layer (the model's output logits); ``{prefix}/alerts/{rule}`` — how
many alerts of a rule have fired, written from the rule's first alert on (a rule that never fires
writes no series). LL and HH are zero-padded to two digits.

No scalar tag is a prefix (a parent "directory") of another, so that stores mapping tags to
paths (MLflow's file store) can hold them all. Until 2026-12 one head was
``{prefix}/{metric}/layer_{LL}/head_{HH}``, a child of its layer's tag; :mod:`qkmonitor.report`
reads both.
"""

from __future__ import annotations

__all__ = [
    "HF_HPARAMS_METRICS",
    "HPARAMS_METRICS",
    "LOSS_TAGS",
    "VAL_LOSS_TAGS",
    "alert_scalars",
    "alert_tag",
    "head_tag",
    "layer_tag",
    "run_tag",
    "worst_tag",
]

#: The training loss's tag, the first of these a run has: a LightningModule's
#: ``self.log("train_loss", ...)`` (``train_loss_step`` with ``on_epoch=True``), the Hugging Face
#: Trainer's ``train/loss``, a plain loop's ``loss``. qkmonitor does not write the loss itself.
LOSS_TAGS = ("train_loss", "train_loss_step", "train/loss", "loss")
#: The validation loss's tag: Lightning's convention (``val_loss``) and the Hugging Face Trainer's.
VAL_LOSS_TAGS = ("val_loss", "eval/loss")
#: What the HPARAMS tab compares runs by, besides the alert counters: Lightning's convention,
#: which ``qkmonitor train``'s tasks follow.
HPARAMS_METRICS = ("train_loss", "val_loss", "val_acc")
#: The same for the Hugging Face Trainer, whose TensorBoard callback writes ``train/loss``,
#: ``eval/loss``.
HF_HPARAMS_METRICS = ("train/loss", "eval/loss")


def layer_tag(prefix: str, metric: str, layer: int) -> str:
    """``{prefix}/{metric}/layer_{LL}``."""
    return f"{prefix}/{metric}/layer_{layer:02d}"


def worst_tag(prefix: str, metric: str, worst: str, layer: int) -> str:
    """``{prefix}/{metric}_{worst}/layer_{LL}`` with ``worst`` ``"max"`` or ``"min"``."""
    return f"{prefix}/{metric}_{worst}/layer_{layer:02d}"


def head_tag(prefix: str, metric: str, layer: int, head: int) -> str:
    """``{prefix}/{metric}/layer_{LL}_head_{HH}`` (a sibling of the layer's tag, not a child)."""
    return f"{prefix}/{metric}/layer_{layer:02d}_head_{head:02d}"


def run_tag(prefix: str, name: str) -> str:
    """``{prefix}/run/{name}``: a value of the run, not of a layer (the output logits')."""
    return f"{prefix}/run/{name}"


def alert_tag(prefix: str, rule: str) -> str:
    """``{prefix}/alerts/{rule}``."""
    return f"{prefix}/alerts/{rule}"


def alert_scalars(prefix: str, counts: dict[str, float]) -> dict[str, float]:
    """The alert counters of one probe: ``{prefix}/alerts/{rule}`` for each rule that has fired.

    A rule's series starts at its first alert, so TensorBoard shows no flat zero chart per rule;
    no series means the rule never fired (the CLI summary and the alert texts say so too).
    """
    return {alert_tag(prefix, rule): float(n) for rule, n in counts.items() if n}

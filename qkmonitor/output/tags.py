"""TensorBoard tag names: the stable contract between the callbacks, dashboards and reports.

``{prefix}/{metric}/layer_{LL}`` — mean over heads; ``{prefix}/{metric}_{max|min}/layer_{LL}`` —
the worst head; ``{prefix}/{metric}/layer_{LL}_head_{HH}`` — one head; ``{prefix}/run/{name}`` —
a value of the run, not of a layer (the model's output logits); ``{prefix}/alerts/{rule}`` — how
many alerts of a rule have fired, written from the rule's first alert on (a rule that never fires
writes no series). LL and HH are zero-padded to two digits.

No scalar tag is a prefix (a parent "directory") of another, so that stores mapping tags to
paths (MLflow's file store) can hold them all. The images follow the same grammar:
``{prefix}/attention/layer_{LL}_head_{HH}`` is one head's attention pattern.

This module builds every tag and parses them back (:func:`parse_layer_tag`,
:func:`parse_alert_tag`, :func:`layer_tag_regex`): the dashboards and :mod:`qkmonitor.output.runs`
read tags through it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = [
    "HF_HPARAMS_METRICS",
    "HPARAMS_METRICS",
    "LOSS_TAGS",
    "VAL_LOSS_TAGS",
    "alert_scalars",
    "alert_tag",
    "head_tag",
    "image_tag",
    "layer_prefixes",
    "layer_tag",
    "layer_tag_regex",
    "parse_alert_tag",
    "parse_layer_tag",
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


def image_tag(prefix: str, kind: str, layer: int, head: int) -> str:
    """``{prefix}/{kind}/layer_{LL}_head_{HH}``: one head's image (``kind`` ``"attention"``: its
    attention pattern)."""
    return head_tag(prefix, kind, layer, head)


#: after the prefix: ``{metric}/layer_{LL}`` (a mean, or a band ``{metric}_{max|min}``) or
#: ``{metric}/layer_{LL}_head_{HH}``; a validation probe's metric is ``val/{metric}``
_LAYER_TAG = re.compile(r"^(?P<metric>.+)/layer_(?P<layer>\d+)(?:_head_(?P<head>\d+))?$")


def parse_layer_tag(prefix: str, tag: str) -> tuple[str, int, int | None] | None:
    """``(metric, layer, head)`` of a tag :func:`layer_tag`, :func:`worst_tag` or :func:`head_tag`
    built under ``prefix`` (``head`` None but for a head's tag; a band's metric keeps its
    ``_max``/``_min``), or None for any other tag."""
    if not tag.startswith(f"{prefix}/"):
        return None
    match = _LAYER_TAG.match(tag[len(prefix) + 1 :])
    if match is None:
        return None
    head = match["head"]
    return match["metric"], int(match["layer"]), None if head is None else int(head)


def layer_tag_regex(prefix: str, metric: str) -> str:
    """A regular expression (TensorBoard's custom-scalars layout takes them) matching
    :func:`layer_tag` of ``metric`` under ``prefix`` for every layer."""
    return f"^{re.escape(prefix)}/{re.escape(metric)}/layer_\\d+$"


def layer_prefixes(tags: Iterable[str]) -> set[str]:
    """The prefixes under which ``tags`` hold a layer's tag (to name them when a run has none under
    the prefix asked for)."""
    return {m["prefix"] for tag in tags if (m := _PREFIXED_LAYER_TAG.match(tag))}


_PREFIXED_LAYER_TAG = re.compile(r"^(?P<prefix>.+?)/[^/]+/layer_\d+$")


def run_tag(prefix: str, name: str) -> str:
    """``{prefix}/run/{name}``: a value of the run, not of a layer (the output logits')."""
    return f"{prefix}/run/{name}"


def alert_tag(prefix: str, rule: str) -> str:
    """``{prefix}/alerts/{rule}``."""
    return f"{prefix}/alerts/{rule}"


def parse_alert_tag(prefix: str, tag: str) -> str | None:
    """The rule of :func:`alert_tag` under ``prefix``, or None for any other tag."""
    head = f"{prefix}/alerts/"
    rule = tag[len(head) :] if tag.startswith(head) else ""
    return rule if rule and "/" not in rule else None


def alert_scalars(prefix: str, counts: dict[str, float]) -> dict[str, float]:
    """The alert counters of one probe: ``{prefix}/alerts/{rule}`` for each rule that has fired.

    A rule's series starts at its first alert, so TensorBoard shows no flat zero chart per rule;
    no series means the rule never fired (the CLI summary and the alert texts say so too).
    """
    return {alert_tag(prefix, rule): float(n) for rule, n in counts.items() if n}

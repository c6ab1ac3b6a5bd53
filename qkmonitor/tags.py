"""TensorBoard tag names: the stable contract between the callbacks, dashboards and reports.

``{prefix}/{metric}/layer_{LL}`` — mean over heads; ``{prefix}/{metric}_{max|min}/layer_{LL}`` —
the worst head; ``{prefix}/{metric}/layer_{LL}_head_{HH}`` — one head; ``{prefix}/alerts/{rule}``
— how many alerts of a rule have fired. LL and HH are zero-padded to two digits.

No scalar tag is a prefix (a parent "directory") of another, so that stores mapping tags to
paths (MLflow's file store) can hold them all. Until 2026-12 one head was
``{prefix}/{metric}/layer_{LL}/head_{HH}``, a child of its layer's tag; :mod:`qkmonitor.report`
reads both.
"""

from __future__ import annotations

__all__ = ["alert_tag", "head_tag", "layer_tag", "worst_tag"]


def layer_tag(prefix: str, metric: str, layer: int) -> str:
    """``{prefix}/{metric}/layer_{LL}``."""
    return f"{prefix}/{metric}/layer_{layer:02d}"


def worst_tag(prefix: str, metric: str, worst: str, layer: int) -> str:
    """``{prefix}/{metric}_{worst}/layer_{LL}`` with ``worst`` ``"max"`` or ``"min"``."""
    return f"{prefix}/{metric}_{worst}/layer_{layer:02d}"


def head_tag(prefix: str, metric: str, layer: int, head: int) -> str:
    """``{prefix}/{metric}/layer_{LL}_head_{HH}`` (a sibling of the layer's tag, not a child)."""
    return f"{prefix}/{metric}/layer_{layer:02d}_head_{head:02d}"


def alert_tag(prefix: str, rule: str) -> str:
    """``{prefix}/alerts/{rule}``."""
    return f"{prefix}/alerts/{rule}"

"""Runs read back from their TensorBoard event files: the series of every metric, layer and head the
monitors logged, the alert counters and messages, and the training loss.

Metrics are discovered from the tags of :mod:`qkmonitor.output.tags`, not from a fixed list; the
known ones come first, in the catalogue's order (docs/metrics.md). Reading needs TensorBoard's
``EventAccumulator``, imported when a run is first read, so importing this module is cheap and
torch-free. :mod:`qkmonitor.output.report` tells a run's story from what this reads.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from qkmonitor.measures.catalogue import CATALOGUE
from qkmonitor.output.layer_runs import is_layer_run
from qkmonitor.output.tags import LOSS_TAGS, layer_prefixes, parse_alert_tag, parse_layer_tag

__all__ = [
    "KNOWN_METRICS",
    "RUN_LETTERS",
    "AlertEntry",
    "RunData",
    "Series",
    "metric_order",
    "read_run",
    "resolve_run_dir",
]

#: Display order of the metrics the bundled monitors log (the catalogue's); any other follows,
#: sorted.
KNOWN_METRICS = tuple(spec.name for spec in CATALOGUE)
#: The letters that name runs compared side by side, in the order given (A, B, ...).
RUN_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_EVENT_MARKER = "tfevents"


def metric_order(metric: str) -> tuple[bool, int, str]:
    """The sort key of a metric: known ones in the catalogue's order, then the others by name;
    validation metrics (``val/...``) after the rest."""
    validation = metric.startswith("val/")
    name = metric[4:] if validation else metric
    rank = KNOWN_METRICS.index(name) if name in KNOWN_METRICS else len(KNOWN_METRICS)
    return validation, rank, name


@dataclass(frozen=True)
class Series:
    """One scalar tag over steps, in the order TensorBoard stored it."""

    steps: tuple[int, ...]
    values: tuple[float, ...]

    @property
    def final(self) -> float:
        return self.values[-1]

    @property
    def final_step(self) -> int:
        return self.steps[-1]

    @property
    def min(self) -> float:
        """The smallest value over steps, NaN left out (NaN if every value is NaN)."""
        finite = [v for v in self.values if not math.isnan(v)]
        return min(finite) if finite else math.nan

    @property
    def max(self) -> float:
        """The largest value over steps, NaN left out (NaN if every value is NaN)."""
        finite = [v for v in self.values if not math.isnan(v)]
        return max(finite) if finite else math.nan


@dataclass(frozen=True)
class AlertEntry:
    """One alert message as the monitors wrote it to TensorBoard text."""

    step: int
    message: str
    #: the rule, from the message's tag ``{prefix}/alerts/{rule}``
    rule: str | None = None


@dataclass
class RunData:
    """Everything a report needs from one run.

    Attributes:
        path: the folder (or event file) that was read.
        given: the path as the caller gave it.
        note: how ``given`` became ``path`` when that was a choice (several runs below it).
        layers: metric -> layer -> the ``{prefix}/{metric}/layer_{LL}`` series (mean over heads).
        bands: metric -> layer -> ``"min"``/``"max"`` -> the lowest/highest-head series.
        heads: metric -> layer -> head -> the ``{prefix}/{metric}/layer_{LL}_head_{HH}`` series.
        alert_counts: rule -> the ``{prefix}/alerts/{rule}`` counter series.
        alerts: the alert messages, by step.
        loss: the training loss, read from ``loss_tag`` (None: the run has none of the tags).
    """

    path: Path
    given: Path
    prefix: str
    note: str | None = None
    layers: dict[str, dict[int, Series]] = field(default_factory=dict)
    bands: dict[str, dict[int, dict[str, Series]]] = field(default_factory=dict)
    heads: dict[str, dict[int, dict[int, Series]]] = field(default_factory=dict)
    alert_counts: dict[str, Series] = field(default_factory=dict)
    alerts: list[AlertEntry] = field(default_factory=list)
    loss: Series | None = None
    loss_tag: str | None = None

    @property
    def metrics(self) -> list[str]:
        """The metrics found, known ones first; validation metrics (``val/...``) after the rest."""
        return sorted(self.layers, key=metric_order)

    @property
    def final_step(self) -> int:
        return max(s.final_step for per_layer in self.layers.values() for s in per_layer.values())

    @property
    def first_step(self) -> int:
        return min(s.steps[0] for per_layer in self.layers.values() for s in per_layer.values())

    @property
    def num_layers(self) -> int:
        return 1 + max(layer for per_layer in self.layers.values() for layer in per_layer)

    @property
    def alerts_fired(self) -> int:
        return int(sum(s.final for s in self.alert_counts.values() if not math.isnan(s.final)))


def _has_events(folder: Path) -> bool:
    return any(_EVENT_MARKER in p.name and p.is_file() for p in folder.iterdir())


def _newest_mtime(folder: Path) -> float:
    return max(
        p.stat().st_mtime for p in folder.iterdir() if _EVENT_MARKER in p.name and p.is_file()
    )


def _natural_key(path: Path) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.as_posix())]


def resolve_run_dir(path: str | Path) -> tuple[Path, str | None]:
    """The event folder to read for ``path``, and a note when that had to be chosen.

    ``path`` may be an event file, a folder holding event files (``runs/recall/version_0``), or a
    folder above such folders (``runs/recall``); with several below it, the one whose event files
    were written last is taken. The layers' runs inside a run (``version_0/layers/layer_LL``,
    :mod:`qkmonitor.output.layer_runs`) are part of it: one given is read as its run.

    Raises:
        ValueError: ``path`` does not exist or there is no event file in or below it.
    """
    given = Path(path)
    if not given.exists():
        raise ValueError(
            f"Run directory `{given}` does not exist; expected a TensorBoard run folder such as "
            "`runs/recall/version_0` or a folder above one."
        )
    if given.is_file():
        if _EVENT_MARKER not in given.name:
            raise ValueError(
                f"`{given}` is a file but not a TensorBoard event file (events.out.tfevents.*)."
            )
        return given, None
    if _has_events(given):
        run = given.parent.parent
        if is_layer_run(given) and _has_events(run):
            return run, f"`{given}` is one layer's run of `{run}`; reporting `{run}`."
        return given, None
    found = sorted(
        (
            Path(root)
            for root, _, files in os.walk(given)
            if any(_EVENT_MARKER in name for name in files) and not is_layer_run(Path(root))
        ),
        key=_natural_key,
    )
    if not found:
        raise ValueError(
            f"Run directory `{given}` holds no TensorBoard event files (events.out.tfevents.*) in "
            "it or below it; expected the folder a TensorBoardLogger wrote, such as "
            "`runs/recall/version_0`."
        )
    if len(found) == 1:
        return found[0], None
    newest = max(found, key=lambda folder: (_newest_mtime(folder), _natural_key(folder)))
    names = [str(folder.relative_to(given)) for folder in found]
    listed = ", ".join(names) if len(names) <= 6 else ", ".join(names[:3] + ["..."] + names[-2:])
    note = (
        f"`{given}` holds {len(found)} runs ({listed}); reporting the newest, "
        f"`{newest.relative_to(given)}` (give its folder to report another)."
    )
    return newest, note


def _accumulator(path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # 0 keeps every event: the defaults sample scalars down to 10,000 and tensors (text) to 10
    keep = {
        "scalars": 0,
        "tensors": 0,
        "images": 1,
        "histograms": 1,
        "compressedHistograms": 1,
        "audio": 1,
    }
    acc = EventAccumulator(str(path), size_guidance=keep)
    acc.Reload()
    return acc


def read_run(
    path: str | Path, prefix: str = "qkmonitor", loss_tags: Sequence[str] = LOSS_TAGS
) -> RunData:
    """Read one run's qkmonitor scalars, alert messages and training loss.

    Args:
        path: a run folder, a folder above one, or an event file (see :func:`resolve_run_dir`).
        prefix: the monitors' ``log_key_prefix``.
        loss_tags: the training loss is read from the first of these tags the run has.

    Returns:
        The run's series, grouped by metric, layer and head.

    Raises:
        ValueError: no run at ``path``, or it holds no ``{prefix}/...`` layer scalars.
    """
    folder, note = resolve_run_dir(path)
    acc = _accumulator(folder)
    run = RunData(path=folder, given=Path(path), prefix=prefix, note=note)
    scalar_tags = acc.Tags().get("scalars", [])
    means: dict[tuple[str, int], Series] = {}
    for tag in scalar_tags:
        rule, parsed = parse_alert_tag(prefix, tag), parse_layer_tag(prefix, tag)
        if rule is None and parsed is None:
            continue
        events = acc.Scalars(tag)
        series = Series(tuple(e.step for e in events), tuple(float(e.value) for e in events))
        if rule is not None:
            run.alert_counts[rule] = series
            continue
        if not series.steps:
            continue
        metric, layer, head = parsed
        if head is None:
            means[metric, layer] = series
        else:
            run.heads.setdefault(metric, {}).setdefault(layer, {})[head] = series
    metrics = {metric for metric, _ in means}
    for (metric, layer), series in sorted(means.items()):
        base, _, worst = metric.rpartition("_")
        if worst in ("min", "max") and base in metrics:  # the lowest/highest head of `base`
            run.bands.setdefault(base, {}).setdefault(layer, {})[worst] = series
        else:
            run.layers.setdefault(metric, {})[layer] = series
    if not run.layers:
        raise ValueError(_no_scalars_message(folder, prefix, scalar_tags))
    run.alerts = _read_alerts(acc, prefix)
    run.loss_tag = next((tag for tag in loss_tags if tag in scalar_tags), None)
    if run.loss_tag is not None:
        events = acc.Scalars(run.loss_tag)
        run.loss = Series(tuple(e.step for e in events), tuple(float(e.value) for e in events))
    return run


def _no_scalars_message(folder: Path, prefix: str, tags: Sequence[str]) -> str:
    message = (
        f"Run directory `{folder}` holds no qkmonitor scalars: expected tags like "
        f"`{prefix}/kappa/layer_00` (written by the qkmonitor callbacks with `log_key_prefix="
        f"'{prefix}'`)"
    )
    others = sorted(layer_prefixes(tags))
    if others:
        return (
            message
            + f"; found layer tags under the prefix {', '.join(f'`{p}`' for p in others)} (try "
            "`--prefix`)."
        )
    shown = ", ".join(f"`{t}`" for t in sorted(tags)[:5]) or "none"
    return message + f"; its scalar tags: {shown}{', ...' if len(tags) > 5 else ''}."


def _read_alerts(acc, prefix: str) -> list[AlertEntry]:
    """The alert messages, each under ``{prefix}/alerts/{rule}``: the rule is read from the tag."""
    from tensorboard.util import tensor_util

    try:
        text_tags = set(acc.PluginTagToContent("text"))
    except KeyError:  # no text plugin data in this run
        text_tags = set()
    entries = []
    for tag in sorted(text_tags & set(acc.Tags().get("tensors", []))):
        # torch's SummaryWriter.add_text(tag) stores the string tensor under `{tag}/text_summary`
        rule = parse_alert_tag(prefix, tag.removesuffix("/text_summary"))
        if rule is None:
            continue
        for event in acc.Tensors(tag):
            cells = tensor_util.make_ndarray(event.tensor_proto).reshape(-1)
            text = "\n".join(
                c.decode("utf-8", "replace") if isinstance(c, bytes) else str(c) for c in cells
            )
            entries.append(AlertEntry(step=int(event.step), message=text, rule=rule))
    return sorted(
        entries, key=lambda entry: entry.step
    )  # stable: same-step alerts keep their order

"""The summary ``qkmonitor train`` prints at its end: a per-layer table of each monitor's last
probe, which probe each column comes from, a legend of the columns (from the metric catalogue),
the alerts and the task's final validation scores."""

from __future__ import annotations

import math
import textwrap

__all__ = ["format_summary", "summary_columns"]


def summary_columns() -> list[tuple[str, str, str]]:
    """(monitor, metric, over heads) columns of the summary table, from the metric catalogue."""
    from qkmonitor.measures.catalogue import CATALOGUE

    return [(spec.monitor, spec.name, agg) for spec in CATALOGUE for agg in spec.summary]


def format_summary(
    engines: list,
    final: dict[str, float],
    log_dir: str,
    step: int | None = None,
    lost: dict[str, int] | None = None,
    legend: bool = True,
) -> str:
    """A per-layer table of each monitor engine's last probe, which probe each column comes from, a
    legend of the columns (from the metric catalogue), the alerts and the task's final
    validation scores; ``step``: the optimizer steps trained; ``lost``: the monitors' writes a
    destination lost (``callbacks.base.lost_writes``), a line when any was; ``legend``: with the
    columns' legend."""
    by_kind = {e.monitor: e for e in engines}
    columns = [c for c in summary_columns() if c[0] in by_kind]
    header = ["layer", "name"] + [m if agg == "mean" else f"{m} {agg}" for _, m, agg in columns]
    rows = []
    for i, layer in enumerate(engines[0].layers):
        cells = [str(i), layer.name]
        for monitor, metric, agg in columns:
            latest = by_kind[monitor].latest.get(metric)
            if latest is None:
                cells.append("-")
                continue
            heads = latest[i]
            value = {"mean": heads.mean(), "max": heads.max(), "min": heads.min()}[agg].item()
            cells.append("nan" if math.isnan(value) else f"{value:.4g}")
        rows.append(cells)
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    counts = {name: n for e in engines for name, n in e.alerting.tracker.counts.items()}
    fired = ", ".join(f"{name}: {n}" for name, n in counts.items() if n)
    alerts = fired or f"none (rules watched: {', '.join(counts) or 'none'})"
    scores = ", ".join(f"{k} {v:.4f}" for k, v in sorted(final.items()))
    after = f" after step {step}" if step is not None else ""
    return "\n".join(
        [
            f"\nqkmonitor summary{after} ({log_dir})",
            *_sources(engines, columns),
            line(header),
            line(["-" * w for w in widths]),
            *map(line, rows),
            *(_legend(columns) if legend else []),
            f"alerts fired: {alerts}",
            *[
                f"writes lost: {n} to {where} (see the warnings above)"
                for where, n in (lost or {}).items()
            ],
            f"final validation: {scores}",
        ]
    )


def _sources(engines: list, columns: list[tuple[str, str, str]]) -> list[str]:
    """Which probe each column comes from: the spectrum reads the weights after a step, the
    activation monitors the batch of their last probe step (up to ``every_n_steps`` earlier)."""
    from qkmonitor.measures.catalogue import SPECTRUM

    groups: dict[str, list[str]] = {}
    for e in engines:
        names = list(
            dict.fromkeys(metric for monitor, metric, _ in columns if monitor == e.monitor)
        )
        if not names or e.schedule.latest_step is None:
            continue
        source = (
            f"the weights after step {e.schedule.latest_step}"
            if e.monitor == SPECTRUM
            else f"the last probed batch, at step {e.schedule.latest_step}"
        )
        groups.setdefault(source, []).extend(names)
    return [f"  {', '.join(names)}: {source}" for source, names in groups.items()]


def _legend(columns: list[tuple[str, str, str]]) -> list[str]:
    """One line per metric of the table: unit, range, which end is worse, how to read it."""
    from qkmonitor.measures.catalogue import metric

    names = list(dict.fromkeys(name for _, name, _ in columns))
    if not names:
        return []
    width = max(len(name) for name in names)
    lines = ["columns: a layer's mean over its heads; 'max'/'min': its highest/lowest head"]
    for name in names:
        spec = metric(name)
        worse = f"{spec.worse} is worse" if spec.worse else "neither end is worse"
        lo, hi = spec.range
        text = f"{spec.unit} in [{lo:g}, {hi:g}], {worse}" + (
            f"; {spec.reading}" if spec.reading else ""
        )
        lines.append(
            textwrap.fill(
                text,
                width=100,
                initial_indent=f"  {name.ljust(width)}  ",
                subsequent_indent=" " * (width + 4),
            )
        )
    return lines

"""docs/qk_clip.md's sweep figures are the ones ``benchmarks/instability.py --arms`` wrote to
``docs/qk_clip_sweep.json`` (tau 100) and ``docs/qk_clip_sweep_tau30.json``, not numbers pasted
from an earlier run."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def block() -> str:
    text = (ROOT / "docs" / "qk_clip.md").read_text()
    start, end = "<!-- qk-clip-sweep:start -->", "<!-- qk-clip-sweep:end -->"
    return " ".join(text[text.index(start) + len(start) : text.index(end)].split())


def sweep(name: str) -> dict:
    return json.loads((ROOT / "docs" / name).read_text())


def percent(x: float) -> str:
    return f"{100 * x:+.2f} %".replace("-", "−")


def test_the_tau_100_figures_are_the_sweeps():
    data = sweep("qk_clip_sweep.json")
    summary, text = data["summary"], block()
    assert data["settings"] == {"seeds": [2], "warmups": [50], "tau": 100.0, "quick": False}
    failed = summary["failed"]
    assert f"**{summary['rescued']} of {len(failed)}** ends within 10 %" in text
    clipped = [r for r in failed if r["clips"] > 0]
    better = sum(r["clipped_ratio"] < r["ratio"] for r in failed)
    worse = sum(r["clipped_ratio"] > r["ratio"] for r in failed)
    assert (
        f"Of the {len(failed)} failed runs, {len(clipped)} are clipped; {better} end better and "
        f"{worse} worse" in text
    )
    assert f"{len(failed) - len(clipped)} failed runs are never clipped" in text
    missed = [r["clipped_ratio"] for r in failed if r["clipped_ratio"] > 1.1]
    assert f"The others miss by {min(missed):.2f} × to {max(missed):.0f} ×" in text
    changes = summary["healthy_changes"]
    assert (
        f"The {len(changes)} healthy runs end within **{percent(min(changes))} to "
        f"{percent(max(changes))}**" in text
    )
    unclipped = [r for r in data["runs"] if r["clip_tau"] is None and r["lr"] == 0.1]
    top = {
        opt: [r["max_logit"] for r in unclipped if r["optimizer"] == opt]
        for opt in ("adamw", "muon")
    }
    assert f"AdamW's largest logits reach {min(top['adamw']):,.0f}–{max(top['adamw']):,.0f}" in text
    assert f"Muon's {min(top['muon']):,.0f}–{max(top['muon']):,.0f}" in text
    clipped_logits = [r["clipped_max_logit"] for r in failed if r["clips"] > 0]
    assert f"at most {max(clipped_logits):.0f} at a probe" in text


def test_the_tau_30_figures_are_the_reruns():
    summary, text = sweep("qk_clip_sweep_tau30.json")["summary"], block()
    failed, changes = summary["failed"], summary["healthy_changes"]
    better = sum(r["clipped_ratio"] < r["ratio"] for r in failed)
    assert f"{better} of {len(failed)} failed runs end better" in text
    assert f"still {summary['rescued']} of {len(failed)} within 10 %" in text
    assert f"from {percent(min(changes))} to **{percent(max(changes))}**" in text


def test_the_readmes_sentence_on_the_sweep_is_the_sweeps():
    summary = sweep("qk_clip_sweep.json")["summary"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert max(summary["healthy_changes"]) < 0.01  # "costs healthy runs under 1 %"
    assert "costs healthy runs under 1 %" in readme
    assert f"brings {summary['rescued']} of {len(summary['failed'])} failed runs back" in readme
    missed = [r["clipped_ratio"] for r in summary["failed"] if r["clipped_ratio"] > 1.1]
    assert f"(the others miss by {min(missed):.2f} × to {max(missed):.0f} ×)" in readme

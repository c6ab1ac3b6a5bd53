"""``benchmarks/instability.py``'s round-4 split and its records: the validation set is seeds 5
and 6 of every family, the calibration set every run read before (seeds 0-4, and 3-4 of
``sorting``, which starts at seed 3), and a recorded probe's run values (the output logits') reach
the rules again when the run is replayed."""

from __future__ import annotations

import pytest

from qkmonitor.alerts import AlertRule, Condition, LogitGrowthWarning


def test_the_split_keeps_seeds_5_and_6_of_every_family_for_validation(instability, sweep_args):
    specs = instability.sweep(sweep_args())
    calibration = {(s.family, s.seed) for s in specs if s.split == "calibration"}
    validation = {(s.family, s.seed) for s in specs if s.split == "validation"}
    assert {seed for _, seed in calibration} == {0, 1, 2, 3, 4}
    assert {seed for _, seed in validation} == {5, 6}
    assert (
        {f for f, _ in validation}
        == {f for f, _ in calibration}
        == set(instability.FAMILIES) - set(instability.FAULTS)
    )
    sorting = [s for s in specs if s.family == "sorting"]
    assert {s.seed for s in sorting} == {3, 4, 5, 6} and {s.warmup for s in sorting} == {0}
    assert {s.seed for s in sorting if s.split == "calibration"} == {3, 4}
    assert len(sorting) == 4 * len(instability.FAMILIES["sorting"].lrs)
    quick = instability.sweep(sweep_args(quick=True, seeds=[0]))
    assert {s.seed for s in quick if s.family == "sorting"} == {3}


def test_a_replayed_run_gives_its_run_values_to_the_rules(instability):
    rule = AlertRule(
        name="outputs", metric="max_logit", threshold=-1e9, above=True, patience=1, margin=0.0,
        warning=LogitGrowthWarning, meaning="test", advice="test",
        also=(Condition("output_logit_max", 50.0, above=True),),
    )  # fmt: skip
    spec = instability.RunSpec("induction", 0.01, False, 0, 0, 21)
    heads = instability.FAMILIES["induction"].n_heads
    layers = instability.FAMILIES["induction"].n_layers

    def probe(logit_max: float) -> dict:
        return {
            "max_logit": [[1.0] * heads] * layers,
            instability.RUN: {"output_logit_max": logit_max},
        }

    probes = {0: probe(10.0), 10: probe(20.0), 20: probe(80.0)}
    record = instability.RunRecord(spec, [1.0] * 21, [1.0] * 21, probes, [], 0.0)
    alerts = instability.replay(record, {"AttentionEntropyMonitor": [rule]})
    assert {a["step"] for a in alerts} == {20}


def test_trajectory_prints_a_calibration_runs_evidence_and_refuses_a_validation_run(
    instability, tmp_path
):
    heads, layers = 4, 2
    probes = {
        0: {
            "max_logit": [[1.0] * heads] * layers,
            "q_update_ratio": [[float("nan")] * heads] * layers,
        },
        10: {
            "max_logit": [[1.0, 2.0, 3.0, 4.0], [5.0, 60.0, 7.0, 8.0]],
            "q_update_ratio": [[0.01] * heads, [0.02, 0.03, 0.04, 0.05]],
            instability.RUN: {"output_lse_rms": 6.5, "output_logit_max": 9.0},
        },
    }
    for seed in (0, 5):
        spec = instability.RunSpec("induction", 0.01, False, seed, 0, 11)
        losses = [float(i) for i in range(11)]
        instability._save(instability.RunRecord(spec, losses, losses, probes, [], 0.0), tmp_path)
    text = instability.trajectory("induction-lr0.01-qk0-s0-w0-n11", tmp_path)
    header, first, second = text.splitlines()
    assert header.startswith("induction-lr0.01-qk0-s0-w0-n11: step | loss | max_logit")
    cells = [c.strip() for c in second.split("|")]
    assert cells[:4] == ["10", "5.500", "60", "0.05"]  # the mean of losses 1..10, the largest heads
    assert cells[-2:] == ["6.5", "9"]
    assert [c.strip() for c in first.split("|")][3] == "nan"  # no update before step 0
    with pytest.raises(SystemExit, match="validation run"):
        instability.trajectory("induction-lr0.01-qk0-s5-w0-n11", tmp_path)

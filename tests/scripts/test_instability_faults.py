"""``benchmarks/instability.py``'s fault families (issue 61, item 2): held out from every fit and
from the validation figures, a twin per seed, the fault's step drawn within its window, the
learning-rate jump and the injected gradient error as documented, and the verdicts taken against
the twin."""

from __future__ import annotations

import torch

from qkmonitor.models import DecoderLM, TransformerConfig


def test_the_fault_families_are_held_out_with_a_twin_per_seed(instability, sweep_args):
    specs = instability.sweep(sweep_args())
    for name, fault in instability.FAULTS.items():
        runs = [s for s in specs if s.family == name]
        assert {s.split for s in runs} == {instability.HELD_OUT}
        assert {s.seed for s in runs} == set(fault.seeds)
        for seed in fault.seeds:
            arms = [(s.fault, s.magnitude) for s in runs if s.seed == seed]
            assert arms == fault.arms() and arms[0] == (None, None)
            (start,) = {s.fault_step for s in runs if s.seed == seed}
            assert fault.window[0] <= start <= fault.window[1]
        assert {(s.lr, s.warmup, s.steps) for s in runs} == {(fault.lr, fault.warmup, fault.steps)}
    assert len({s.key for s in specs}) == len(specs)
    # the rest of the sweep: round 3's 240 runs (seeds 0-4) and round 4's validation (seeds 5, 6)
    assert sum(s.split == "calibration" for s in specs) == 240
    assert sum(s.split == "validation" for s in specs) == 102
    quick = instability.sweep(sweep_args(quick=True, seeds=[0]))
    numfault = [(s.fault, s.magnitude) for s in quick if s.family == "numfault"]
    assert numfault == [(None, None), ("inject", 1.0)]


def test_the_learning_rate_jumps_by_its_factor_from_the_fault_step(instability):
    fault = instability.FAULTS["lrjump"]
    twin = instability.RunSpec("lrjump", fault.lr, False, 1, fault.warmup, fault.steps)
    jump = instability.RunSpec(
        "lrjump", fault.lr, False, 1, fault.warmup, fault.steps, fault="lr_jump", magnitude=30.0
    )
    start = jump.fault_step
    healthy, faulty = instability._lr_lambda(twin), instability._lr_lambda(jump)
    assert [faulty(s) for s in range(start)] == [healthy(s) for s in range(start)]
    assert faulty(start) == faulty(fault.steps - 1) == 30.0 * healthy(start) == 30.0


def test_the_injected_error_is_the_gradients_norm_times_one_rank_one_direction(instability):
    fault = instability.FAULTS["numfault"]
    spec = instability.RunSpec(
        "numfault", fault.lr, False, 2, fault.warmup, 30, fault="inject", magnitude=0.5
    )
    config = TransformerConfig(
        vocab_size=16, d_model=16, n_layers=1, n_heads=2, max_seq_len=8, attention_backend="torch"
    )
    torch.manual_seed(0)
    model = DecoderLM(config)
    injection = instability.Injection(model, spec)
    tokens = torch.randint(16, (2, 8))

    def grads(step: int) -> list[torch.Tensor]:
        model.zero_grad()
        injection.step = step
        torch.manual_seed(1)
        model(tokens).square().mean().backward()
        (layer,) = [m for m in model.modules() if isinstance(m, instability.MultiHeadAttention)]
        return [layer.q_proj.weight.grad.clone(), layer.k_proj.weight.grad.clone()]

    clean, faulty = grads(spec.fault_step - 1), grads(spec.fault_step)
    errors = [f - c for c, f in zip(clean, faulty)]
    for c, e in zip(clean, errors):
        torch.testing.assert_close(e.norm(), 0.5 * c.norm())
        assert torch.linalg.matrix_rank(e) == 1
    torch.testing.assert_close(errors[0] / errors[0].norm(), errors[1] / errors[1].norm())


def test_a_faulted_run_is_scored_against_its_twin_from_the_faults_step(instability):
    fault = instability.FAULTS["numfault"]
    steps = 300

    def record(name: str | None, losses: list[float], alert_steps: list[int]):
        spec = instability.RunSpec(
            "numfault", fault.lr, False, 0, fault.warmup, steps, fault=name,
            magnitude=None if name is None else 1.0,
        )  # fmt: skip
        alerts = [{"rule": "kappa", "step": s} for s in alert_steps]
        return instability.RunRecord(spec, losses, losses, {}, alerts, 0.0, alerts=alerts)

    start = instability.RunSpec("numfault", fault.lr, False, 0, 50, steps).fault_step
    twin = record(None, [2.0] * steps, [])
    bad = record("inject", [2.0] * 250 + [3.0] * 50, [100, start + 17])
    scored = {s.record.spec.fault: s for s in instability.score([twin, bad])}
    assert scored[None].status == "healthy" and scored[None].first_alert is None
    hit = scored["inject"]
    assert hit.status == "failed" and hit.separation == 252  # its 10-step mean past 1.1 x 2.05
    assert hit.first_alert == start + 17  # the alert at step 100 is before the fault: the twin's
    row = instability.fault_row(hit)
    assert row["in_time"] and row["halfway"] == (start + 17 <= start + (252 - start) / 2)

"""The default alert rules and the opt-in ones, each with the evidence of its calibration.

The rules are fitted on the calibration set of ``benchmarks/instability.py`` and scored on its
held-out validation set (docs/alerts.md, "Does it warn in time?"); each quotes that evidence in
its message. The engines take theirs from here (``default_rules``).
"""

from __future__ import annotations

from qkmonitor.alerts.rules import (
    AlertRule,
    Condition,
    EntropyCollapseWarning,
    LogitGrowthWarning,
    LowRankUpdateWarning,
    MalignantCollapseWarning,
    OverLocalizationWarning,
    RankCollapseWarning,
)

__all__ = [
    "DEFAULT_RULES",
    "ENTROPY_COLLAPSE_RULE",
    "FAST_UPDATES_RULE",
    "KAPPA_RULE",
    "LOGIT_BURST_RULE",
    "LOGIT_GROWTH_RULE",
    "LOGIT_JUMP_RULE",
    "LOGIT_PLATEAU_RULE",
    "LOW_RANK_UPDATES_RULE",
    "MALIGNANT_COLLAPSE_RULE",
    "RANK_COLLAPSE_RULE",
    "SPECTRAL_GROWTH_RULE",
]

# The defaults below are fitted on the calibration set of ``benchmarks/instability.py`` (round 4,
# issue 61: seeds 0-4 of six task/architecture families, warmup and none, a learning-rate sweep
# each, and seeds 3-4 of a seventh) so that no healthy run at a safe setting comes within 20 % of
# firing one (``benchmarks/margins.py``, one and two torch threads), and scored once on the
# validation set, seeds 5 and 6, never seen while fitting. docs/alerts.md has both sets' figures;
# ``evidence`` quotes the calibration figures in every message.

_SWEEP = "benchmarks/instability.py"
_REMEDY = (
    "lower the peak learning rate or lengthen warmup; add QK-norm ({qk_norm}) or "
    "sigma-reparametrization; weight decay on the query/key projections"
)


#: round 4's calibration set (issue 61): seeds 0-4 of the sweep's six families and seeds 3-4 of
#: sorting, scored with the validation set (docs/instability.json): its failed and healthy runs
_HEALTHY_RUNS = 90
_FAILED_RUNS = 110


def _calibration(in_time: int, healthy: int, margin: int) -> str:
    """The figures every default rule's evidence opens with, on round 4's calibration set (checked
    against docs/instability.json by tests/docs/test_rule_evidence.py): failed runs it flagged
    in time alone, healthy runs it fired on, and its margin (benchmarks/margins.py: how far the
    closest healthy run at a safe setting, in either environment, stayed from firing it)."""
    return (
        f"on round 4's calibration set of {_SWEEP} (seeds 0-4), alone it flagged {in_time} of "
        f"{_FAILED_RUNS} failed runs in time and fired on {healthy} of {_HEALTHY_RUNS} healthy "
        f"runs{' (each at a rate where other seeds failed)' if healthy else ''}; healthy runs at "
        f"safe settings stayed {margin} % or more short of firing it"
    )


#: Learning, not failing: the trend rules stay quiet while the training loss falls by 5 % per 10
#: steps, or is below a tenth of the run's first loss (the task is solved; its heads are sharp
#: because that is the solution). On the calibration set this alone took the healthy runs alerted
#: from 4 to 0 (induction-head formation), and lost no failed run flagged in time.
_LEARNING = {"learning_drop": 0.05, "learning_window": 10, "solved_fraction": 0.1}
#: the level of logit_growth and fast_updates: a head's largest logit past 30 (recovering below 25)
_LOGIT_PAST_30 = {
    "metric": "max_logit",
    "threshold": 30.0,
    "above": True,
    "patience": 1,
    "margin": 5.0,
    "warning": LogitGrowthWarning,
}

KAPPA_RULE = AlertRule(
    name="kappa",
    metric="kappa",
    threshold=0.2,
    above=True,
    patience=1,
    margin=0.05,
    warning=OverLocalizationWarning,
    meaning=(
        "the head's query-key spectrum is concentrating on one direction fast (kappa = sigma_1 / "
        "sum sigma_i of W_QK rising), its largest logit per unit input (sigma_1 * scale) is at "
        "least 1, and the loss is not improving: the weight-side precursor of attention-logit "
        "growth"
    ),
    advice=_REMEDY,
    also=(Condition("qk_spectral_norm", 1.0, above=True),),
    growth=3.0,
    window=30,
    skip_qk_norm=True,
    evidence=(
        _calibration(18, 2, 24)
        + ". Round 4 raised its rate from x2.5 to x3 per 30 steps: healthy recall runs at lr 0.03 "
        "reached x2.27 while sigma_1 * scale >= 1 and the loss was flat. Without the loss gate it "
        "fired on healthy induction-head formation; without the qk_spectral_norm >= 1 condition "
        "on examples/hf_llama.py at step 40, where kappa rose x3.5 while sigma_1(W_QK) * scale "
        "was 0.1 and attention nearly uniform. It flags the injected numerical faults of the "
        "sweep (magnitudes 1 and 3) 17-28 steps after they start"
    ),
    **_LEARNING,
)

LOGIT_GROWTH_RULE = AlertRule(
    name="logit_growth",
    **_LOGIT_PAST_30,
    meaning=(
        "the head's largest attention logit is growing exponentially (attention-logit growth, "
        "Dehghani et al. 2023; Wortsman et al. 2023) while the loss is not improving: the softmax "
        "is saturating and the loss will follow"
    ),
    advice=_REMEDY,
    growth=8.0,
    window=20,
    evidence=(
        _calibration(22, 5, 39)
        + ". Healthy induction heads grow their logits x7 to x10 per 20 steps while the loss "
        "falls: the loss gate, not the rate, tells them apart. At the former level 20 it fired on "
        "a healthy vision run whose head went from 2.3 to 21 during a transient loss spike"
    ),
    **_LEARNING,
)

LOGIT_BURST_RULE = AlertRule(
    name="logit_burst",
    metric="max_logit",
    threshold=55.0,
    above=True,
    patience=1,
    margin=10.0,
    warning=LogitGrowthWarning,
    meaning=(
        "the head's largest attention logit jumped past 55 by a factor of 10 or more within 10 "
        "steps: an immediate blow-up, typically at a high learning rate without warmup, before "
        "any trend can be measured"
    ),
    advice=_REMEDY,
    growth=10.0,
    window=10,
    evidence=(
        _calibration(40, 3, 22)
        + ". Without warmup, failing runs jump x10 to x440 within their first 10 steps; a healthy "
        "induction run at lr 0.03 jumped x9.9 to 42, so round 4 raised the level from 50 to 55. "
        "It has no loss gate (the loss may still be falling from its first value)"
    ),
)

LOGIT_JUMP_RULE = AlertRule(
    name="logit_jump",
    metric="max_logit",
    threshold=22.0,
    above=True,
    patience=1,
    margin=5.0,
    warning=LogitGrowthWarning,
    meaning=(
        "the head's largest attention logit rose past 22 by a factor of 6.5 or more within 10 "
        "steps while the loss was not falling: a fast early rise that learning does not explain"
    ),
    advice=_REMEDY,
    growth=6.5,
    window=10,
    evidence=(
        _calibration(38, 3, 23)
        + ". Vision runs without warmup jumped x8 to x34 at step 10 while their loss rose; round "
        "4 raised it from past 20 after x5 to past 22 after x6.5, where healthy induction and "
        "grokking runs came within 4 %. Healthy induction heads rise as fast while their loss "
        "falls: the loss gate tells them apart"
    ),
    **_LEARNING,
)

FAST_UPDATES_RULE = AlertRule(
    name="fast_updates",
    **_LOGIT_PAST_30,
    meaning=(
        "the optimizer moved the head's query projection by 10 % or more of its RMS in one step "
        "while the head's largest attention logit is already past 30: the updates are driving "
        "the logits up faster than learning needs (update-to-weight ratio and logit growth, "
        "Wortsman et al. 2023)"
    ),
    advice=(
        "lower the peak learning rate or lengthen warmup; check AdamW's epsilon (too small "
        "amplifies the updates of weights with small gradients); add QK-norm ({qk_norm})"
    ),
    also=(Condition("q_update_ratio", 0.1, above=True),),
    solved_fraction=0.1,
    evidence=(
        _calibration(16, 4, 25)
        + ". It flags induction runs at lr 0.1 with warmup, whose logits grow while the loss "
        "still falls (no loss-waiting gate: those runs fail while their loss falls fastest). "
        "Round 4 raised the ratio from 0.08 to 0.1 and exempts solved runs: healthy induction "
        "runs at lr 0.03 reached 0.074 while learning, and 0.081-0.090 once solved in fresh "
        "installs. Fitted with AdamW: Muon's and SGD's update ratios have other typical sizes"
    ),
)

LOGIT_PLATEAU_RULE = AlertRule(
    name="logit_plateau",
    metric="max_logit",
    threshold=150.0,
    above=True,
    patience=1,
    margin=25.0,
    warning=LogitGrowthWarning,
    meaning=(
        "the head's largest attention logit is past 150 and its attention entropy under 2 % of "
        "its maximum (its softmax is saturated: the gradient through it has all but vanished) "
        "and the training loss is no lower than at an earlier probe: the logits kept growing "
        "after the loss stopped improving"
    ),
    advice=_REMEDY,
    also=(
        Condition("loss_vs_best", 1.0, above=True),
        Condition("entropy_norm", 0.02, above=False),
    ),
    evidence=(
        _calibration(20, 4, 21)
        + ". It flags char-LM runs at lr 0.03 with warmup, whose loss stalls 100 steps before it "
        "separates while their logits pass 150. Round 4 added the entropy condition: healthy "
        "recall runs at lr 0.03 reached logits of 183 with the loss 3 % above its best (two "
        "torch threads), with their heads' entropy at 2.4 % or more of its maximum"
    ),
    **_LEARNING,
)

#: A default of QKSpectrumMonitor where its metric is measured (``update_spectrum=True``): the
#: update's own spectrum (Huang et al. 2026), read at the probe's step, with no loss gate (the
#: fault is seen before the loss moves).
LOW_RANK_UPDATES_RULE = AlertRule(
    name="low_rank_updates",
    metric="qk_update_top_share",
    threshold=0.7,
    above=True,
    patience=2,
    margin=0.1,
    warning=LowRankUpdateWarning,
    meaning=(
        "the update to the head's query-key form is concentrated on one direction (its largest "
        "singular value carries 70 % or more of the spectrum at two probes in a row: the update's "
        "spectral entropy collapsed) while the loss is not improving, a consistently biased "
        "low-rank error in the gradients rather than learning "
        "(Huang et al. 2026); low-precision attention's biased rounding makes such errors (Qiu & "
        "Yao 2025), as can a faulty gradient hook, compression or all-reduce"
    ),
    advice=(
        "if attention runs in bf16 or fp16, take the bias out of its rounding: {rounding}; check "
        "custom gradient hooks, gradient compression and the gradients' all-reduce; lower the "
        "learning rate if the run is also at a high one"
    ),
    evidence=(
        _calibration(7, 0, 21)
        + ". On the sweep's numerical faults (a consistently signed rank-one error added to the "
        "W_Q/W_K gradients, docs/alerts.md) the update's top share went from 0.2-0.4 to 0.6-0.9 "
        "at the first probe after the fault; healthy runs at high rates reach 0.6-0.86 late in "
        "training once solved or still learning, hence the level 0.7, two probes and the loss gate"
    ),
    **_LEARNING,
)

#: Not a default: on the calibration set of the sweep it fired on healthy induction-head formation
#: and on runs that did not fail, and flagged no failed run in time that the default rules missed;
#: it stays for users who want to see a head go one-hot (replace it into ``alerts=``).
ENTROPY_COLLAPSE_RULE = AlertRule(
    name="entropy_collapse",
    metric="entropy_norm",
    threshold=0.05,
    above=False,
    patience=1,
    margin=0.05,
    warning=EntropyCollapseWarning,
    meaning=(
        "the head's attention is near one-hot and still sharpening (logits growing): entropy "
        "collapse under logit growth. A sharp head with steady logits (previous-token, induction) "
        "is not flagged"
    ),
    advice=_REMEDY,
    also=(Condition("max_logit", 10.0, above=True, growth=2.0, window=30),),
    evidence=(
        f"in {_SWEEP} (validation set), it fired on 25 of 27 failed runs but also on 7 that did "
        "not fail, 6 of them healthy, mostly induction-head formation; on the calibration set it "
        "flagged no failed run in time that the default rules missed"
    ),
)


RANK_COLLAPSE_RULE = AlertRule(
    name="rank_collapse",
    metric="hidden_collapse",
    threshold=1e-3,
    above=False,
    patience=2,
    margin=1e-3,
    warning=RankCollapseWarning,
    meaning=(
        "the block's token representations have collapsed to (nearly) one vector: "
        "||X - 1 mean(X)||_F / ||X||_F is close to 0 (rank collapse, Dong et al. 2021)"
    ),
    advice=(
        "check the residual (skip) connections and the normalization, lower the depth or the "
        "learning rate"
    ),
    per_head=False,
    evidence=(
        _calibration(2, 0, 3837)
        + ". The logit-growth instability is not a rank collapse; Dong et al. 2021 show the "
        "collapse without skip connections (examples/rank_collapse.py)"
    ),
)

MALIGNANT_COLLAPSE_RULE = AlertRule(
    name="malignant_collapse",
    metric="attn_entropy_norm",
    threshold=0.1,
    above=False,
    patience=2,
    margin=0.05,
    warning=MalignantCollapseWarning,
    meaning=(
        "the head's attention is near one-hot and its attention matrix is low-rank: most "
        "queries attend the same few keys (sparse and low-rank, the malignant kind; sparse but "
        "identity-like attention is benign — Qi et al. 2025)"
    ),
    advice=_REMEDY,
    also=(Condition("attn_erank", 1.5, above=False, margin=0.5),),
    evidence=(
        _calibration(0, 0, 96)
        + ". Solved vision runs (every query reads the two marked cells: sparse and low-rank, yet "
        "correct) fired it until the loss gate was added; a bound in directions (about one) "
        "means the same at any probe size. It fires only after the loss has separated: it "
        "confirms rather than warns"
    ),
    **_LEARNING,
)

#: An opt-in rule on Zhai et al.'s sigmaReparam quantity (not a default: on the sweep it flagged
#: fewer failed runs in time than ``kappa`` and nothing that ``kappa`` and ``logit_growth`` missed).
SPECTRAL_GROWTH_RULE = AlertRule(
    name="spectral_growth",
    metric="qk_spectral_norm",
    threshold=1.0,
    above=True,
    patience=1,
    margin=0.1,
    warning=LogitGrowthWarning,
    meaning=(
        "the head's largest possible logit per unit input (sigma_1(W_QK) * scale, Zhai et al. "
        "2023's sigmaReparam quantity) is growing fast: nothing in the weights stops the logits "
        "from following"
    ),
    advice=_REMEDY,
    growth=4.0,
    window=30,
    skip_qk_norm=True,
    evidence=(
        f"in {_SWEEP}, it fired on 4 of the 5 failed runs (2 of them 20 or more steps ahead) and "
        "on no other run; kappa and logit_growth flagged the same runs as early"
    ),
)


#: Every default rule, in the order of the table in docs/alerts.md.
DEFAULT_RULES = (
    KAPPA_RULE,
    LOGIT_GROWTH_RULE,
    LOGIT_BURST_RULE,
    LOGIT_JUMP_RULE,
    FAST_UPDATES_RULE,
    LOGIT_PLATEAU_RULE,
    MALIGNANT_COLLAPSE_RULE,
    RANK_COLLAPSE_RULE,
    LOW_RANK_UPDATES_RULE,  # QKSpectrumMonitor's where update_spectrum=True
)

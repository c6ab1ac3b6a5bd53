"""Constructors as LightningCLI and IDEs see them, and every argument check."""

from __future__ import annotations

import inspect

import lightning
import lightning.pytorch as pl
import pytest
import torch
from packaging.version import Version
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from qkmonitor.alerts import ENTROPY_COLLAPSE_RULE, KAPPA_RULE
from qkmonitor.callbacks import (
    AttentionEntropyMonitor,
    EffectiveRankMonitor,
    QKClip,
    QKMonitor,
    QKSpectrumMonitor,
)
from qkmonitor.models import DecoderLM, TransformerConfig

COMMON = [
    "every_n_steps",
    "per_head",
    "log_key_prefix",
    "alerts",
    "alert_action",
    "on_alert",
    "layers",
    "visuals_every_n_probes",
    "defer_reads",
]


@pytest.mark.parametrize(
    "cls, extra",
    [
        (QKSpectrumMonitor, ["background_weights", "update_spectrum"]),
        (AttentionEntropyMonitor, ["probe_validation", "sink_tokens"]),
        (
            EffectiveRankMonitor,
            [
                "probe_validation",
                "max_probe_sequences",
                "max_probe_tokens",
                "blocks",
                "pattern_heads",
            ],
        ),
    ],
)
def test_every_parameter_is_explicit_and_keyword_only(cls, extra):
    params = inspect.signature(cls).parameters
    assert list(params) == COMMON + extra
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())


class TinyLM(pl.LightningModule):
    """A LightningModule whose constructor LightningCLI can fill from YAML."""

    def __init__(self, d_model: int = 16) -> None:
        super().__init__()
        self.model = DecoderLM(
            TransformerConfig(vocab_size=16, d_model=d_model, n_layers=1, n_heads=2, max_seq_len=8)
        )

    def training_step(self, batch, batch_idx):
        tokens = batch[0]
        logits = self.model(tokens)
        return nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, 16), tokens[:, 1:].reshape(-1)
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randint(16, (16, 8))), batch_size=4)


def test_a_lightning_cli_yaml_config_builds_and_runs_the_monitor(tmp_path):
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(f"""
trainer:
  default_root_dir: {tmp_path}
  max_steps: 3
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: qkmonitor.callbacks.AttentionEntropyMonitor
      init_args: {{every_n_steps: 2, per_head: true, log_key_prefix: attn}}
""")
    cli = LightningCLI(TinyLM, args=["fit", "--config", str(config)], save_config_callback=None)
    (monitor,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, AttentionEntropyMonitor)]
    engine = monitor.engine
    assert (engine.schedule.every_n_steps, engine.options.per_head, engine.prefix) == (
        2,
        True,
        "attn",
    )
    assert monitor.latest_step == 2 and monitor.latest["entropy_norm"][0].shape == (2,)


def test_bad_prefixes_are_refused():
    for prefix in (" ", "/x", "a//b", "x/", "", "a b", 3):
        with pytest.raises(ValueError, match="Expected `log_key_prefix` to be a tag-safe string"):
            QKSpectrumMonitor(log_key_prefix=prefix)
    assert QKSpectrumMonitor(log_key_prefix="runs/enc-1.v2").engine.prefix == "runs/enc-1.v2"


@pytest.mark.parametrize(
    "field, value",
    [
        ("name", ""),
        ("name", "a b"),
        ("metric", ""),
        ("threshold", "high"),
        ("threshold", float("nan")),
        ("above", "yes"),
        ("patience", 0),
        ("patience", 1.5),
        ("margin", -1.0),
        ("warning", int),
        ("meaning", None),
        ("advice", 3),
        ("also", [1]),
        ("per_head", 1),
    ],
)
def test_every_alert_rule_field_is_checked_by_name(field, value):
    with pytest.raises(ValueError, match=f"Expected `{field}`"):
        KAPPA_RULE.replace(**{field: value})


def test_a_rule_for_a_metric_the_monitor_does_not_log_lists_the_ones_it_does():
    with pytest.raises(
        ValueError,
        match=(
            r"'entropy_norm', which QKSpectrumMonitor does not log; it logs kappa, "
            r"kappa_eig"  # (its condition on max_logit may read AttentionEntropyMonitor's)
        ),
    ):
        QKSpectrumMonitor(alerts=[ENTROPY_COLLAPSE_RULE])
    with pytest.raises(ValueError, match="'kapa'"):
        QKSpectrumMonitor(alerts=[KAPPA_RULE.replace(metric="kapa")])
    with pytest.raises(ValueError, match="'sink_mass'"):  # logged only with sink_tokens > 0
        AttentionEntropyMonitor(
            alerts=[ENTROPY_COLLAPSE_RULE.replace(name="sink", metric="sink_mass")]
        )
    AttentionEntropyMonitor(
        sink_tokens=1, alerts=[ENTROPY_COLLAPSE_RULE.replace(name="sink", metric="sink_mass")]
    )


@pytest.mark.parametrize("cls", [QKSpectrumMonitor, AttentionEntropyMonitor, EffectiveRankMonitor])
def test_a_class_in_the_callbacks_instead_of_an_instance_says_to_pass_an_instance(tmp_path, cls):
    name = cls.__name__
    try:
        trainer = pl.Trainer(
            default_root_dir=tmp_path,
            max_steps=1,
            callbacks=[cls],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
    except ValueError as err:
        # Lightning before 2.6 refuses a class itself, inside Trainer(...), before any qkmonitor
        # code
        assert str(err) == "Expected a parent" and Version(lightning.__version__) < Version("2.6")
        return
    with pytest.raises(
        TypeError,
        match=rf"Trainer's `callbacks`, got the class `{name}`: pass an instance: `{name}\(\)`",
    ):
        trainer.fit(TinyLM())


def fit_with(tmp_path, monitor, model=None):
    task = TinyLM()
    if model is not None:
        task.model = model
    pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=1,
        callbacks=[monitor],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    ).fit(task)
    return task


def test_layers_takes_one_module_or_a_list_and_refuses_modules_outside_the_model(tmp_path):
    task = TinyLM()
    one = QKSpectrumMonitor(layers=task.model.blocks[0].attn)
    pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=1,
        callbacks=[one],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    ).fit(task)
    assert [layer.name for layer in one.engine.layers] == ["model.blocks.0.attn"]

    stranger = nn.MultiheadAttention(16, 2)
    with pytest.raises(
        ValueError,
        match=r"`layers\[0\]` \(MultiheadAttention\) is not a submodule of the monitored TinyLM",
    ):
        fit_with(tmp_path, QKSpectrumMonitor(layers=[stranger]))
    with pytest.raises(
        ValueError, match="Expected `layers` to be a module, an AttentionLayer, a list"
    ):
        QKSpectrumMonitor(layers=3)


def test_prefixes_that_read_as_other_paths_are_refused_as_mlflow_refuses_them():
    """A prefix is refused where some logger would refuse its tags: MLflow's own check of a
    metric name (``mlflow.utils.validation``) is the reference; every prefix accepted makes
    tags it takes."""
    validation = pytest.importorskip("mlflow.utils.validation")
    from mlflow.exceptions import MlflowException

    def mlflow_takes(tag: str) -> bool:
        try:
            validation._validate_metric_name(tag)
        except MlflowException:
            return False
        return True

    for prefix in ("../x", "..", ".", "a/./b", "a/../b", "x/..", "..a", "a/...", "./x"):
        assert not mlflow_takes(f"{prefix}/kappa/layer_00") or prefix in ("a/...",)
        with pytest.raises(ValueError, match=r"no part '\.' or '\.\.' or beginning with '\.\.'"):
            QKSpectrumMonitor(log_key_prefix=prefix)
    for prefix in ("qkmonitor", "runs/enc-1.v2", ".hidden", "a..b", "v1.", "a/.b/c_d"):
        assert QKSpectrumMonitor(log_key_prefix=prefix).engine.prefix == prefix
        assert mlflow_takes(f"{prefix}/kappa/layer_00_head_00"), prefix


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ([], r"Expected `layers` to be a non-empty list .* got an empty list: leave it out"),
        ((), r"Expected `layers` to be a non-empty list"),
        ([1], r"Expected `layers\[0\]` to be a module or an AttentionLayer .* got int 1: an index"),
        (
            ["blocks.0.attn"],
            (
                r"Expected `layers\[0\]` to be a module .* got str 'blocks.0.attn': a name is "
                r"not looked up; .* a function of the model, called when training starts"
            ),
        ),
        ([nn.Linear(2, 2), None], r"Expected `layers\[1\]` to be a module .* got NoneType None"),
    ],
)
def test_layer_lists_that_cannot_be_layers_are_refused_at_construction(layers, message):
    for cls in (QKSpectrumMonitor, QKMonitor):
        with pytest.raises(ValueError, match=message):
            cls(layers=layers)


@pytest.mark.parametrize("cls", [QKMonitor, QKSpectrumMonitor, AttentionEntropyMonitor, QKClip])
def test_a_positional_argument_says_the_parameters_are_keyword_only(cls):
    name, first = cls.__name__, next(iter(inspect.signature(cls).parameters))  # QKClip: tau
    with pytest.raises(
        TypeError,
        match=rf"^{name} takes keyword arguments only: {name}\({first}=50\), got 1 "
        "positional argument$",
    ):
        cls(50)
    assert inspect.signature(cls).parameters["every_n_steps"].kind is inspect.Parameter.KEYWORD_ONLY
    assert cls(every_n_steps=50).engines[0].schedule.every_n_steps == 50

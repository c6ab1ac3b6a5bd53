"""Every tag is valid for every logger: no scalar tag is a prefix (a parent folder) of another, so
stores that map tags to paths hold them all; the values arrive in MLflow's file store, a CSV, W&B
offline and two loggers at once, read back by each store's own reader. Images reach the loggers
that take them (W&B's media, MLflow's artifacts), and a logger that takes none is named once."""

from __future__ import annotations

import csv
import json
import struct
import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger
from torch.utils.tensorboard import SummaryWriter

from qkmonitor.alerts import KAPPA_RULE
from qkmonitor.callbacks import AttentionEntropyMonitor, EffectiveRankMonitor, QKSpectrumMonitor
from qkmonitor.measures.catalogue import metric
from qkmonitor.output.dashboards import HeatmapScale, grid_of, heatmap_image
from qkmonitor.output.runs import read_run
from qkmonitor.output.tags import head_tag


def monitors(**kwargs):
    return [
        QKSpectrumMonitor(every_n_steps=2, per_head=True, **kwargs),
        AttentionEntropyMonitor(every_n_steps=2, per_head=True, **kwargs),
        EffectiveRankMonitor(
            every_n_steps=2, per_head=True, max_probe_tokens=6, pattern_heads=2, **kwargs
        ),
    ]


def drawing_monitors():
    """Visuals at every probe, and a kappa rule that fires at every probe (an alert text to
    write)."""
    always = KAPPA_RULE.replace(
        threshold=0.0,
        margin=0.0,
        growth=None,
        window=None,
        also=(),
        learning_drop=None,
        learning_window=None,
        solved_fraction=None,
    )
    callbacks = monitors(visuals_every_n_probes=1)
    callbacks[0] = QKSpectrumMonitor(
        every_n_steps=2, per_head=True, visuals_every_n_probes=1, alerts=[always]
    )
    return callbacks


def fit(tmp_path, make_task, loggers, callbacks, quiet=True):
    task, data = make_task()
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")
        pl.Trainer(
            default_root_dir=tmp_path,
            max_steps=3,
            logger=loggers,
            callbacks=callbacks,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            limit_val_batches=0,
            log_every_n_steps=1,
        ).fit(task, datamodule=data)


class KappaGrids(pl.Callback):
    """Keeps the κ grid of each of a spectrum monitor's probes (put after the monitor)."""

    def __init__(self, monitor) -> None:
        self.monitor, self.grids = monitor, {}

    def _keep(self) -> None:
        if self.monitor.latest_step is not None:
            self.grids.setdefault(self.monitor.latest_step, grid_of(self.monitor.latest["kappa"]))

    def on_train_batch_start(self, *args) -> None:
        self._keep()

    def on_train_batch_end(self, *args) -> None:
        self._keep()

    def on_train_end(self, *args) -> None:
        self._keep()


def kappa_heatmap(recorded: KappaGrids):
    """The κ heatmap of the last probe drawn again from the values: coloured on the run's range
    (every probe drawn, the range widened over them in order, as the dashboards say)."""
    scale = HeatmapScale(metric("kappa").heatmap)
    for step in sorted(recorded.grids):
        colours = scale.update(recorded.grids[step])
    return heatmap_image(recorded.grids[step], *colours, title=f"kappa at step {step}")


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B offline, everything it writes under ``tmp_path``, no network (offline mode, no error
    reporting); no global run or service is left to the next test."""
    wandb = pytest.importorskip("wandb")
    settings = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_DIR": tmp_path,
        "WANDB_CONFIG_DIR": tmp_path / "wandb-config",
        "WANDB_CACHE_DIR": tmp_path / "wandb-cache",
        "WANDB_DATA_DIR": tmp_path / "wandb-data",
    }
    for name, value in settings.items():
        monkeypatch.setenv(name, str(value))
    yield wandb
    wandb.finish()
    wandb.teardown()


def wandb_history(wandb, save_dir) -> tuple[Path, list[dict]]:
    """The offline run's directory and its history rows (one dict per ``log`` call), read from the
    run's ``.wandb`` log with W&B's own record protobuf: a LevelDB-style log of 32 KiB blocks after
    a 7-byte ``:W&B`` header, each chunk ``crc32 (4) | length (2) | type (1)`` (1 full, 2 first,
    3 middle, 4 last). W&B 0.31 has no offline reader and writes no summary file offline.

    The run is finished and W&B's service shut down first: ``finish`` alone returns before the
    service has written the whole log.
    """
    from wandb.proto.wandb_internal_pb2 import Record

    wandb.finish()
    wandb.teardown()
    (path,) = Path(save_dir).glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    rows, pos, chunk = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = Record.FromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                row: dict = {}
                for item in record.history.item:
                    *parents, last = list(item.nested_key) or [item.key]
                    node = row
                    for key in parents:
                        node = node.setdefault(key, {})
                    node[last] = json.loads(item.value_json)
                rows.append(row)
    return path.parent, rows


def head_value(monitor, metric, layer, head):
    return float(monitor.latest[metric][layer][head])


def test_no_scalar_tag_is_a_prefix_of_another(tmp_path, make_task, scalars_of):
    fit(tmp_path, make_task, TensorBoardLogger(tmp_path, "run", 0), monitors())
    tags = sorted(
        t for t in scalars_of(tmp_path / "run" / "version_0") if t.startswith("qkmonitor/")
    )
    assert "qkmonitor/kappa/layer_00_head_01" in tags and "qkmonitor/kappa/layer_00" in tags
    parents = [t for t in tags if any(other.startswith(t + "/") for other in tags)]
    assert parents == []


def test_mlflow_file_store_takes_every_tag_and_its_values_arrive(tmp_path, make_task, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    logger = MLFlowLogger(experiment_name="qk", tracking_uri=uri)
    callbacks = monitors()
    fit(tmp_path, make_task, logger, callbacks)  # crashed at step 0 with the old per-head tags
    client = MlflowClient(tracking_uri=uri)
    history = client.get_metric_history(logger.run_id, "qkmonitor/kappa/layer_01_head_02")
    assert [m.step for m in history] == [0, 2]
    assert history[-1].value == pytest.approx(head_value(callbacks[0], "kappa", 1, 2), rel=1e-6)
    entropy = client.get_metric_history(logger.run_id, "qkmonitor/entropy_norm/layer_00_head_03")
    assert entropy[-1].value == pytest.approx(
        head_value(callbacks[1], "entropy_norm", 0, 3), rel=1e-6
    )


def test_csv_and_two_loggers_at_once_get_the_same_values(tmp_path, make_task, scalars_of):
    callbacks = monitors()
    fit(
        tmp_path,
        make_task,
        [TensorBoardLogger(tmp_path, "tb", 0), CSVLogger(tmp_path, "csv", 0)],
        callbacks,
    )
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    tag = "qkmonitor/attn_erank/layer_01_head_00"
    from_csv = [(int(r["step"]), float(r[tag])) for r in rows if r.get(tag)]
    from_tb = scalars_of(tmp_path / "tb" / "version_0")[tag]
    assert [s for s, _ in from_csv] == [s for s, _ in from_tb] == [0, 2]
    assert [v for _, v in from_csv] == pytest.approx([v for _, v in from_tb], rel=1e-6)
    assert from_csv[-1][1] == pytest.approx(head_value(callbacks[2], "attn_erank", 1, 0), rel=1e-6)


def test_wandb_offline_takes_every_tag_and_its_values_arrive(tmp_path, make_task, wandb_offline):
    from lightning.pytorch.loggers import WandbLogger

    callbacks = monitors()
    fit(tmp_path, make_task, WandbLogger(offline=True, save_dir=tmp_path, project="qk"), callbacks)
    _, rows = wandb_history(wandb_offline, tmp_path)
    for monitor, name, layer, head in (
        (callbacks[0], "kappa", 1, 2),
        (callbacks[1], "entropy_norm", 0, 3),
        (callbacks[2], "attn_erank", 1, 0),
    ):
        tag = f"qkmonitor/{name}/layer_{layer:02d}_head_{head:02d}"
        logged = [(row["trainer/global_step"], row[tag]) for row in rows if tag in row]
        assert [s for s, _ in logged] == [0, 2], tag
        assert logged[-1][1] == pytest.approx(head_value(monitor, name, layer, head), rel=1e-6), tag


def test_images_and_histograms_reach_wandb_under_the_loggers_prefix(
    tmp_path, make_task, wandb_offline
):
    from lightning.pytorch.loggers import WandbLogger
    from PIL import Image

    callbacks = drawing_monitors()
    recorded = KappaGrids(callbacks[0])
    fit(
        tmp_path,
        make_task,
        WandbLogger(offline=True, save_dir=tmp_path, project="qk", prefix="train"),
        [*callbacks, recorded],
    )
    run_dir, rows = wandb_history(wandb_offline, tmp_path)
    heatmaps = [
        (row["trainer/global_step"], row["train-qkmonitor/heatmap/kappa"])
        for row in rows
        if "train-qkmonitor/heatmap/kappa" in row
    ]
    assert [s for s, _ in heatmaps] == [
        0,
        2,
    ]  # once a probe, under the logger's prefix as the scalars
    expected = kappa_heatmap(recorded)
    entry = heatmaps[-1][1]
    assert (entry["height"], entry["width"]) == expected.shape[:2] and entry["count"] == 1
    (filename,) = entry["filenames"]
    assert np.array_equal(
        np.asarray(Image.open(run_dir / "files" / filename).convert("RGB")), expected
    )
    logged = {key for row in rows for key in row}
    assert {
        "train-qkmonitor/heatmap/entropy_norm",
        "train-qkmonitor/attention/layer_01_head_01",
    } <= logged
    histograms = [
        row["train-qkmonitor/qk_singular_values/layer_00"]
        for row in rows
        if "train-qkmonitor/qk_singular_values/layer_00" in row
    ]
    assert len(histograms) == 2 and histograms[0]["_type"] == "histogram"
    assert not any(key.startswith(("qkmonitor/", "train-train-")) for key in logged)


def test_images_and_alert_texts_reach_mlflow_as_artifacts_under_the_loggers_prefix(
    tmp_path, make_task, monkeypatch
):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from PIL import Image

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    logger = MLFlowLogger(experiment_name="qk", tracking_uri=uri, prefix="train")
    callbacks = drawing_monitors()
    recorded = KappaGrids(callbacks[0])
    fit(tmp_path, make_task, logger, [*callbacks, recorded])
    client = MlflowClient(tracking_uri=uri)
    heatmaps = [
        a.path for a in client.list_artifacts(logger.run_id, "train-qkmonitor/heatmap/kappa")
    ]
    assert heatmaps == [
        "train-qkmonitor/heatmap/kappa/step_000000.png",
        "train-qkmonitor/heatmap/kappa/step_000002.png",
    ]
    local = client.download_artifacts(logger.run_id, heatmaps[-1], str(tmp_path / "download"))
    assert np.array_equal(np.asarray(Image.open(local).convert("RGB")), kappa_heatmap(recorded))
    patterns = [
        a.path
        for a in client.list_artifacts(logger.run_id, "train-qkmonitor/attention/layer_01_head_01")
    ]
    assert patterns == [
        "train-qkmonitor/attention/layer_01_head_01/step_000000.png",
        "train-qkmonitor/attention/layer_01_head_01/step_000002.png",
    ]
    alerts = [a.path for a in client.list_artifacts(logger.run_id, "train-qkmonitor/alerts/kappa")]
    assert alerts == [
        "train-qkmonitor/alerts/kappa/step_000000.txt"
    ]  # fired at step 0, held (hysteresis) at 2
    text = Path(
        client.download_artifacts(logger.run_id, alerts[0], str(tmp_path / "download"))
    ).read_text()
    assert "kappa" in text
    assert [a.path for a in client.list_artifacts(logger.run_id)] == ["train-qkmonitor"]


def test_a_logger_that_takes_no_images_is_named_once_beside_one_that_does(tmp_path, make_task):
    with pytest.warns(UserWarning) as caught:
        fit(
            tmp_path,
            make_task,
            [TensorBoardLogger(tmp_path, "tb", 0), CSVLogger(tmp_path, "csv", 0)],
            drawing_monitors(),
            quiet=False,
        )
    notices = [str(w.message) for w in caught if "no images for" in str(w.message)]
    assert len(notices) == 1 and "CSVLogger" in notices[0], (
        notices
    )  # one for the run, not per monitor or image


def test_the_report_reads_head_tags_as_tags_builds_them(tmp_path):
    """One head's tag is ``layer_LL_head_HH`` (tags.head_tag); the form of the first weeks of
    development (``layer_LL/head_HH``, never released) is no layer's and no head's."""
    writer = SummaryWriter(str(tmp_path / "run"))
    for step, value in ((0, 0.25), (10, 0.5)):
        writer.add_scalar("qkmonitor/kappa/layer_00", value, step)
        writer.add_scalar(head_tag("qkmonitor", "kappa", 0, 1), 2 * value, step)
        writer.add_scalar("qkmonitor/kappa/layer_00/head_02", 3 * value, step)
    writer.close()
    run = read_run(tmp_path / "run")
    assert run.heads["kappa"][0].keys() == {1}
    assert run.heads["kappa"][0][1].values == (0.5, 1.0)
    assert run.layers["kappa"][0].values == (0.25, 0.5)

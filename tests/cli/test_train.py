"""`qkmonitor train`: the main job, end to end on this CPU."""

from __future__ import annotations

import functools
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qkmonitor.cli import main


def read_tags(run_dir) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return set(acc.Tags()["scalars"])


def test_short_run_writes_logs_and_prints_summary(tmp_path, capsys):
    code = main(
        [
            "train",
            "--steps",
            "12",
            "--every-n-steps",
            "4",
            "--log-dir",
            str(tmp_path / "runs"),
            "--no-progress-bar",
            "--layers",
            "3",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--per-head",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    run_dir = tmp_path / "runs" / "recall" / "version_0"
    assert f"qkmonitor summary after step 12 ({run_dir})" in out
    # one line per source: the weights after the last step, the batch of the last probe
    assert "\n  kappa, qk_erank: the weights after step 12\n" in out
    assert (
        "\n  entropy_norm, max_logit, hidden_collapse, attn_erank: the last probed batch, at step "
        "8\n" in out
    )
    header = next(line for line in out.splitlines() if line.lstrip().startswith("layer"))
    assert header.split()[2:] == [
        "kappa",
        "kappa",
        "max",
        "qk_erank",
        "entropy_norm",
        "entropy_norm",
        "min",
        "max_logit",
        "max",
        "hidden_collapse",
        "attn_erank",
    ]
    for layer in range(3):
        row = re.search(
            rf"^\s+{layer}\s+model\.blocks\.{layer}\.attn((\s+[0-9.e+-]+){{8}})$", out, re.MULTILINE
        )
        assert row and all(float(v) == float(v) for v in row.group(1).split())  # numbers, not NaN
    assert "tensorboard --logdir " + str(tmp_path / "runs") in out
    assert "qkmonitor report " + str(run_dir) in out
    tags = read_tags(run_dir)
    # the alerts the summary names are the counters TensorBoard has, and only those
    fired = re.search(r"^alerts fired: (.*)$", out, re.MULTILINE).group(1)
    counted = {t.removeprefix("qkmonitor/alerts/") for t in tags if "/alerts/" in t}
    assert counted == set(re.findall(r"(\w+): [1-9]", fired))
    assert bool(counted) != fired.startswith("none (rules watched: kappa, ")
    assert {
        "qkmonitor/kappa/layer_02",
        "qkmonitor/kappa_max/layer_02",
        "qkmonitor/kappa/layer_02_head_01",
        "qkmonitor/entropy_norm/layer_02_head_01",
        "qkmonitor/hidden_collapse/layer_02",
        "train_loss",
        "val_acc",
    } <= tags

    # one hparams record: the task's hyper-parameters and the monitors' thresholds (HPARAMS tab)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(tmp_path / "runs" / "recall" / "version_0"))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["lr"].number_value == 3e-3 and hparams["config/n_layers"].number_value == 3
    assert hparams["qkmonitor/alert_kappa/threshold"].number_value > 0
    content = acc.PluginTagToContent("hparams")["_hparams_/experiment"]
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content).experiment
    metrics = {info.name.tag for info in experiment.metric_infos}
    assert {"train_loss", "val_loss", "val_acc"} <= metrics & tags  # the task's, with values

    # and read it back: `qkmonitor report`
    assert (
        main(
            [
                "report",
                str(tmp_path / "runs" / "recall" / "version_0"),
                "--out",
                str(tmp_path / "report"),
            ]
        )
        == 0
    )
    report = capsys.readouterr().out
    assert re.search(r"^kappa\s+0\s+12\s", report, re.MULTILINE) and "alerts:" in report
    assert (tmp_path / "report" / "kappa.png").is_file() and (
        tmp_path / "report" / "entropy_norm_heads.png"
    ).is_file()
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bad_options_are_rejected_with_the_option_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--steps", "0"])
    assert "--steps: expected a positive integer" in capsys.readouterr().err
    assert main(["train", "--d-model", "30", "--heads", "4", "--log-dir", str(tmp_path)]) == 2
    assert "`d_model` (30) to be divisible by `n_heads`" in capsys.readouterr().err


def test_console_script_is_installed():
    exe = shutil.which("qkmonitor")
    command = [exe] if exe else [sys.executable, "-m", "qkmonitor.cli"]
    result = subprocess.run(
        [*command, "train", "--help"], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0 and "--steps" in result.stdout


ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


@functools.cache
def block_script():
    """``scripts/readme_train_block.py``, which writes the README's train-output block: its
    normaliser and structure are what these tests compare with."""
    path = ROOT / "scripts" / "readme_train_block.py"
    spec = importlib.util.spec_from_file_location("readme_train_block", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def summary_figures(text: str) -> dict:
    """What a ``qkmonitor train`` summary states: its columns, each layer's figures, the alerts
    that fired (rule -> count, rules at 0 left out) and the final validation scores."""
    header = re.search(r"^\s*layer\s+name\s+(.+)$", text, re.MULTILINE)
    rows = re.findall(r"^\s*(\d+)\s+(\S+)((?:\s+(?:[-+0-9.e]+|nan))+)\s*$", text, re.MULTILINE)
    alerts = re.search(r"^alerts fired: (.*)$", text, re.MULTILINE)
    scores = re.search(r"^final validation: (.*)$", text, re.MULTILINE)
    assert header and rows and alerts and scores, text
    fired = {rule: int(n) for rule, n in re.findall(r"(\w+): (\d+)", alerts.group(1))}
    watched = re.search(r"rules watched: ([\w, ]+)\)", alerts.group(1))
    return {
        "watched": watched.group(1).split(", ") if watched else None,
        "columns": header.group(1).split(),
        "layers": {(int(i), name): [float(v) for v in cells.split()] for i, name, cells in rows},
        "alerts": {rule: n for rule, n in fired.items() if n},
        "scores": {k: float(v) for k, v in re.findall(r"(\w+) ([-0-9.e]+)", scores.group(1))},
    }


def readme_block() -> str:
    return block_script().read_block(README.read_text())


def readme_quick_start() -> tuple[dict, dict]:
    """The README's quick-start output block, and the ranges the README says a fresh run keeps."""
    ranges = re.search(
        r"val_acc ≥ ([0-9.]+), val_loss ≤ ([0-9.]+), the same alerts, and every per-layer figure "
        r"within (\d+) %",
        " ".join(README.read_text().split()),
    )
    assert ranges, "README.md no longer states the ranges this test checks"
    acc, loss, percent = ranges.groups()
    limits = {"val_acc": float(acc), "val_loss": float(loss), "tolerance": int(percent) / 100}
    return summary_figures(readme_block()), limits


def test_the_readme_quick_start_block_keeps_its_own_ranges():
    shown, limits = readme_quick_start()
    assert shown["scores"]["val_acc"] >= limits["val_acc"]
    assert shown["scores"]["val_loss"] <= limits["val_loss"]


def raw_run(block: str, log_root: str = "/tmp/qs3", version: int = 2) -> str:
    """``block`` as a terminal's run prints it: the bar's states joined by carriage returns, with
    times and rates, and the log directory elsewhere (a ``--log-dir``, a later version)."""
    states = [
        "step: |          | 0/? [00:00<?, ?it/s]",
        "step:   0%|          | 0/1500 [00:00<?, ?it/s]",
        "step:  50%|█████     | 750/1500 [00:31<00:31, 24.0it/s, loss=0.912, acc=0.600]",
        "step: 100%|██████████| 1500/1500 [01:02<00:00, 24.1it/s, loss=0.0312, acc=0.994]",
    ]
    run_dir = f"{log_root}/recall/version_{version}"
    text = block.replace("step: 100%|██████████| 1500/1500 [...]", "\r" + "\r".join(states))
    text = text.replace("runs/recall/version_0", run_dir)
    text = text.replace("tensorboard --logdir runs ", f"tensorboard --logdir {log_root} ")
    width = len(f"qkmonitor report {run_dir}")
    realign = lambda m: f"  {m.group(1).ljust(width)}  # "
    return re.sub(r"^  (\S.*?)\s+# ", realign, text, flags=re.MULTILINE)


def test_the_block_script_reads_a_raw_run_as_the_readme_shows_it():
    """The script's normaliser on a captured output: the README's block is its own normal form,
    and the same run printed with its bar's updates, elsewhere and as a later version (with the
    bar's carriage returns kept, or read as new lines by a text-mode pipe) reads as the block."""
    script, block = block_script(), readme_block()
    assert script.normalise(block) == block
    raw = raw_run(block)
    assert "/tmp/qs3/recall/version_2/checkpoints" in raw and "\r" in raw
    assert script.normalise(raw) == block
    assert script.normalise(raw.replace("\r", "\n")) == block
    assert script.normalise(raw_run(block, log_root="runs", version=0)) == block


def test_the_block_script_replaces_the_block_and_nothing_else():
    script, readme = block_script(), README.read_text()
    assert script.replace_block(readme, readme_block()) == readme
    other = "qkmonitor train: another run\n"
    replaced = script.replace_block(readme, other)
    assert script.read_block(replaced) == other
    before, after = readme.split(script.START)[0], readme.split(script.END)[1]
    assert replaced.startswith(before) and replaced.endswith(after)
    with pytest.raises(ValueError, match="expected a fenced code block between"):
        script.replace_block(readme.replace(script.END, ""), other)


def test_the_block_structure_is_every_line_but_its_numbers():
    """What ``--check`` and the slow test call a structural difference: any word of any line
    (the rules watched, which alerts fired, a legend line, a column), not a number or the bar."""
    script, block = block_script(), readme_block()
    assert not script.differences(re.sub(r"\d", "7", block), block)
    assert not script.differences(block.replace("1500/1500", "20/20"), block)
    watched = "(rules watched: kappa, logit_growth, "
    assert watched in block
    changes = {
        "a rule watched": block.replace(watched, "(rules watched: logit_growth, "),
        "an alert fired": block.replace("alerts fired: none", "alerts fired: kappa: 2"),
        "a legend line": block.replace("it falls as heads specialise", "it falls"),
        "a column": block.replace("qk_erank  entropy_norm", "qk_rank  entropy_norm"),
        "a layer": block.replace("model.blocks.1.attn", "model.blocks.1.mixer"),
        "a validation field": block.replace("val_loss", "val_ppl"),
        "Next:": block.replace("Next:", "Then:"),
    }
    for what, changed in changes.items():
        assert script.differences(changed, block), what


def test_the_block_script_checks_and_rewrites_from_a_run(tmp_path, monkeypatch, capsys):
    """``--check`` exits 1 on a structural difference and writes nothing; without it, the block
    is rewritten from the run (the run itself replaced by a captured output here)."""
    script, block = block_script(), readme_block()
    readme = tmp_path / "README.md"
    readme.write_text(README.read_text())
    printed = {"run": raw_run(block)}
    monkeypatch.setattr(script, "run_train", lambda args: printed["run"])
    assert script.main(["--check", "--readme", str(readme)]) == 0
    printed["run"] = raw_run(block.replace("logit_jump, ", ""))
    assert script.main(["--check", "--readme", str(readme)]) == 1
    assert "-alerts fired: none (rules watched: kappa, logit_growth, logit_burst, logit_jump" in (
        capsys.readouterr().out
    )
    assert readme.read_text() == README.read_text()
    assert script.main(["--readme", str(readme)]) == 0
    assert "logit_jump" not in script.read_block(readme.read_text())


@pytest.mark.slow
def test_default_run_learns_associative_recall(tmp_path):
    """The README's quick start: the default job, run as ``scripts/readme_train_block.py`` runs
    it (a subprocess in the environment the README states), prints what the README shows: the
    whole block's structure line by line (header, columns, rows, legend, the alerts fired and the
    rules watched, the validation line's fields, ``Next:``), within the ranges the README states
    (val_acc and val_loss bounds, per-layer figures within a relative tolerance); it also reaches
    >= 99% recall accuracy."""
    script = block_script()
    fresh = script.normalise(script.run_train(["--log-dir", str(tmp_path)]))
    printed = summary_figures(fresh)
    shown, limits = readme_quick_start()
    assert not script.differences(fresh, readme_block()), "\n".join(
        script.differences(fresh, readme_block())
    )
    assert printed["watched"] == shown["watched"]
    assert printed["scores"]["val_acc"] >= max(limits["val_acc"], 0.99), printed["scores"]
    assert printed["scores"]["val_loss"] <= limits["val_loss"], printed["scores"]
    assert printed["alerts"] == shown["alerts"]
    assert printed["columns"] == shown["columns"]
    assert printed["layers"].keys() == shown["layers"].keys()
    for layer, figures in shown["layers"].items():
        assert len(printed["layers"][layer]) == len(figures)
        for cell, (value, got) in enumerate(zip(figures, printed["layers"][layer])):
            assert got == pytest.approx(value, rel=limits["tolerance"]), (layer, cell, got, value)


def test_the_terminal_shows_progress_summary_checkpoint_and_tensorboard_and_no_warnings(tmp_path):
    """What a newcomer sees: the CLI in a subprocess, as they would run it."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "qkmonitor.cli",
            "train",
            "--steps",
            "20",
            "--every-n-steps",
            "10",
            "--log-dir",
            str(tmp_path / "runs"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == ""  # no warnings, no tips, no device report
    out = result.stdout.replace("\r", "\n")
    assert re.search(r"^step: +100%\|.*\| 20/20 .*loss=[0-9.]+, acc=[0-9.]+", out, re.MULTILINE)
    for noise in ("Epoch", "v_num", "Tip", "GPU available", "Warning", "Validation"):
        assert noise not in out, noise
    run_dir = tmp_path / "runs" / "recall" / "version_0"
    # before the bar: what trains and where it logs
    head = out[: out.index("step:")]
    assert head.startswith("qkmonitor train: associative recall (6 key-value pairs a sequence)\n")
    assert re.search(
        r"model: decoder, 2 layers x 4 heads, d_model 64, .* [0-9.]+ M parameters", head
    )
    assert f"20 steps on cpu, the monitors probing every 10; logs: {run_dir}\n" in head
    tail = out[out.index("qkmonitor summary") :].splitlines()
    assert tail[-5].startswith("checkpoint: ") and tail[-5].endswith(".ckpt")
    assert (run_dir / "checkpoints").is_dir()
    assert tail[-3] == "Next:"
    commands = [line.split("#")[0].split() for line in tail[-2:]]
    assert commands == [
        ["tensorboard", "--logdir", str(tmp_path / "runs")],
        ["qkmonitor", "report", str(run_dir)],
    ]
    # the report offered runs, on this run
    report = subprocess.run(
        [sys.executable, "-m", "qkmonitor.cli", *commands[1][1:], "--no-plots"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert report.returncode == 0 and str(run_dir) in report.stdout, report.stderr


def test_the_summary_legend_says_what_each_column_is_and_which_end_is_worse():
    """The legend under the table comes from the metric catalogue: one line per metric shown."""
    from qkmonitor.cli.summary import _legend, summary_columns
    from qkmonitor.measures.catalogue import metric

    lines = "\n".join(_legend(summary_columns()))
    assert "'max'/'min': its highest/lowest head" in lines
    entries = re.split(r"\n  (?=\S)", lines)[1:]
    names = [entry.split()[0] for entry in entries]
    assert names == list(dict.fromkeys(m for _, m, _ in summary_columns()))
    for name, entry in zip(names, entries):
        spec = metric(name)
        text = " ".join(entry.split()[1:])
        worse = {"high": "high is worse", "low": "low is worse"}[spec.worse]
        assert text.startswith(f"{spec.unit} in [{spec.range[0]:g}, {spec.range[1]:g}], {worse}; ")
        assert text.endswith(" ".join(spec.reading.split())), name


def test_help_shows_each_default_once_explains_every_option_and_lists_choices(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    options = re.findall(r"^  (--[a-z-]+)", text, re.MULTILINE)
    assert len(options) > 20
    blocks = re.split(r"\n(?=  --)", text[text.index("  --task") : text.index("per-task defaults")])
    for block in blocks:
        assert block.count("default") <= 1, block  # each default shown once
        assert len(block.split(None, 2)) > 2, block  # every option has help text
    assert "{none,learned,sinusoidal,rope,rope_interleaved,rope_2d,rope_3d}" in text
    assert "{32-true,bf16-mixed,16-mixed}" in text and "``" not in text


def test_bad_values_are_reported_in_plain_words(capsys):
    for argv, message in (
        (["--steps", "abc"], "argument --steps: expected a positive integer, got 'abc'"),
        (["--steps", "0"], "argument --steps: expected a positive integer, got '0'"),
        (["--lr", "-1"], "argument --lr: expected a positive number, got '-1'"),
        (["--train-fraction", "2"], "expected a number between 0 and 1, got '2'"),
    ):
        with pytest.raises(SystemExit):
            main(["train", *argv])
        assert message in capsys.readouterr().err


def test_the_positional_choices_are_the_models():
    from qkmonitor.cli import build_parser
    from qkmonitor.models.config import POSITIONAL

    commands = next(a for a in build_parser()._actions if a.dest == "command")
    train = commands.choices["train"]
    (positional,) = (a for a in train._actions if a.dest == "positional")
    assert positional.choices == POSITIONAL


def test_version_prints_the_package_version(capsys):
    import qkmonitor

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert (
        exit_.value.code == 0
        and capsys.readouterr().out.strip() == f"qkmonitor {qkmonitor.__version__}"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_a_gpu_asked_for_on_a_machine_without_one_is_one_line_not_a_traceback(tmp_path, capsys):
    assert main(["train", "--accelerator", "gpu", "--steps", "1", "--log-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("qkmonitor train: ")
        and "Traceback" not in err
        and len(err.strip().splitlines()) == 1
    )


def test_report_help_shows_each_default_once(capsys):
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    text = capsys.readouterr().out
    blocks = re.split(r"\n(?=  --)", text[text.index("  --out") :])
    assert len(blocks) >= 3 and all(block.count("default") <= 1 for block in blocks), blocks


def test_a_log_directory_that_fails_mid_run_is_counted_in_the_summary(
    tmp_path, capsys, monkeypatch
):
    """Every event the run's TensorBoard writer is handed from the first of step 4 on raises (a
    full disk): the monitors' writes and the logger's own alike. The run ends normally, and the
    summary's `writes lost` line gives the count the fit's end warned, and the final validation's
    writes lost after it."""
    from torch.utils.tensorboard.writer import FileWriter

    add_event, full_from = FileWriter.add_event, []

    def full(self, event, step=None, walltime=None):
        if step is not None and step >= 4:  # the event's step is set from it
            full_from.append(step)
        if full_from:  # then every event, with a step or without (a layout, hparams)
            raise OSError(28, "No space left on device")
        return add_event(self, event, step, walltime)

    monkeypatch.setattr(FileWriter, "add_event", full)
    with pytest.warns(RuntimeWarning) as caught:
        code = main(
            ["train", "--steps", "12", "--every-n-steps", "4", "--no-progress-bar",
             "--log-dir", str(tmp_path / "runs"), "--no-checkpoint"]
        )  # fmt: skip
    assert code == 0
    run_dir = tmp_path / "runs" / "recall" / "version_0"
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "writes lost" in line]
    lost = int(re.fullmatch(rf"writes lost: (\d+) to {re.escape(str(run_dir))} \(.*\)", line)[1])
    assert lost >= 3 + 2 + 2  # at least the scalars of the probes at 4, 8 (12 for the spectrum)
    messages = [str(w.message) for w in caught if "qkmonitor: " in str(w.message)]
    assert next(m for m in messages if "failed at" in m).startswith(
        f"qkmonitor: writing to {run_dir} failed at step 4 (OSError: [Errno 28]"
    )
    # the fit's end warned the count until then; the line adds the final validation's writes
    report = next(m for m in messages if " were lost (steps" in m and "resumed" not in m)
    warned = int(re.match(rf"qkmonitor: (\d+) write\(s\) to {re.escape(str(run_dir))} ", report)[1])
    assert report.endswith(
        " were lost (steps 4 to 12); it still fails (OSError: [Errno 28] No space left on device)."
    )
    assert warned <= lost


#: ``qkmonitor train`` with its run directory broken as step AT starts (deleted, replaced by a
#: file, or read-only: as root, where chmod stops no write, every open for writing under it fails
#: with EACCES and os.access says so), run as the console script's ``main`` in a fresh process.
BREAK_THE_LOG_DIRECTORY = r"""
import builtins, errno, io, os, shutil, sys
import lightning.pytorch as pl

MODE, AT = sys.argv[1], int(sys.argv[2])
read_only = []

class Break(pl.Callback):
    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step != AT:
            return
        run_dir = trainer.logger.log_dir
        if MODE == "delete":
            shutil.rmtree(run_dir)
        elif MODE == "file":
            shutil.rmtree(run_dir)
            open(run_dir, "w").close()
        else:
            read_only.append(os.path.realpath(run_dir))

def _refused(path, mode):
    if not isinstance(path, (str, bytes, os.PathLike)):
        return False
    path = os.path.realpath(os.fsdecode(path))
    return any(path.startswith(d) for d in read_only) and any(c in mode for c in "wax+")

_open, _access = builtins.open, os.access

def guarded_open(file, mode="r", *args, **kwargs):
    if _refused(file, mode):
        raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(file))
    return _open(file, mode, *args, **kwargs)

def guarded_access(path, how, *args, **kwargs):
    if how & os.W_OK and _refused(path, "w"):
        return False
    return _access(path, how, *args, **kwargs)

builtins.open = io.open = guarded_open
os.access = guarded_access
_Trainer = pl.Trainer
pl.Trainer = lambda *a, callbacks=(), **k: _Trainer(*a, callbacks=[*callbacks, Break()], **k)

from qkmonitor.cli import main
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.parametrize("mode", ["delete", "file", "read-only"])
def test_the_train_command_survives_its_log_directory_failing_mid_run(tmp_path, mode):
    """`qkmonitor train` in a process of its own, its run directory deleted, replaced by a file or
    made read-only at step 8 of 20: it ends with exit 0, no traceback, the `writes lost` line (the
    monitors' writes and its logger's own) and says that the checkpoint was not saved; a deleted
    directory is not made again."""
    script = tmp_path / "break_the_log_directory.py"
    script.write_text(BREAK_THE_LOG_DIRECTORY)
    root = tmp_path / "runs"
    result = subprocess.run(
        [sys.executable, str(script), mode, "8", "train", "--steps", "20", "--every-n-steps",
         "5", "--log-dir", str(root), "--no-progress-bar"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    run_dir = root / "recall" / "version_0"
    out = result.stdout
    lost = re.search(rf"^writes lost: (\d+) to {re.escape(str(run_dir))} \(", out, re.MULTILINE)
    assert lost and int(lost[1]) >= 4, out  # at least the scalars of the probes at 10, 15, 20
    assert re.search(r"^checkpoint: not saved \(.*\)$", out, re.MULTILINE), out
    assert "final validation: val_acc" in out and "Next:" in out
    assert f"qkmonitor: writing to {run_dir} failed at step" in result.stderr
    if mode == "delete":
        assert not run_dir.exists()  # neither the logger nor the monitors made it again
    elif mode == "file":
        assert run_dir.is_file()


def test_a_file_as_a_directory_and_a_name_that_leaves_the_log_dir_are_one_line(tmp_path, capsys):
    """`train --log-dir FILE`, `report --out FILE` and `train --name ../../x` (which wrote outside
    the log directory): argparse's one error line naming the argument, exit 2, nothing made."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for argv, message in (
        (
            ["train", "--log-dir", str(a_file)],
            f"argument --log-dir: expected a directory, got '{a_file}': it is a file",
        ),
        (
            ["train", "--log-dir", str(a_file / "runs")],
            (
                f"argument --log-dir: expected a directory, got '{a_file / 'runs'}': "
                f"'{a_file}' in it is a file"
            ),
        ),
        (
            ["report", str(tmp_path), "--out", str(a_file)],
            f"argument --out: expected a directory, got '{a_file}': it is a file",
        ),
        *(
            (
                ["train", "--log-dir", str(tmp_path / "runs"), "--name", name],
                (
                    f"argument --name: expected a run name without '/' that is not '.' or '..' (a "
                    f"folder under --log-dir), got '{name}'"
                ),
            )
            for name in ("../../x", "a/b", "..", ".", "")
        ),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "Traceback" not in err
        assert err.strip().splitlines()[-1].endswith(message), (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing made


@pytest.mark.parametrize("where", ["the log dir", "the run's folder"])
def test_a_log_directory_on_a_read_only_mount_is_one_line_naming_it(tmp_path, read_only_dir, where):
    """Issue 59, item 7: `qkmonitor train --log-dir DIR` where DIR (or the run's folder under it)
    is a read-only mount, run as a user runs it (the console script, in a process of its own): one
    line on stderr naming the folder, exit 2, no traceback (it was a 72-line double traceback and
    exit 1), and nothing trained."""
    if where == "the log dir":  # its `recall` folder cannot be made
        log_dir, name, failing = read_only_dir, [], read_only_dir / "recall"
    else:  # the run's folder exists, on the mount: nothing can be made in it
        log_dir, name, failing = tmp_path, ["--name", read_only_dir.name], read_only_dir
    script = shutil.which("qkmonitor", path=str(Path(sys.executable).parent))
    result = subprocess.run(
        [script, "train", "--steps", "4", "--log-dir", str(log_dir), "--no-progress-bar", *name],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    line = f"qkmonitor train: argument --log-dir: cannot write into '{log_dir}' "
    assert result.stderr.splitlines() == [f"{line}(Read-only file system: '{failing}')"]
    assert result.stdout == ""


def test_every_option_of_every_command_is_named_in_docs_cli_md():
    """Issue 59, item 11: `train --help` listed `--legend/--no-legend`, which no doc named."""
    import argparse

    from qkmonitor.cli import build_parser

    doc = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    missing = [
        f"{name} {option}"
        for name, parser in commands.choices.items()
        for action in parser._actions
        for option in action.option_strings
        if option not in ("-h", "--help")
        and not re.search(rf"`[^`]*{re.escape(option)}(?![\w-])", doc)
    ]
    assert missing == []

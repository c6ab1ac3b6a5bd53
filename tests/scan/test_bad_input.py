"""What ``qkmonitor scan`` cannot read is one line naming the path and what was expected, exit
code 2, no traceback."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from safetensors.torch import save_file

from qkmonitor.cli import main


def scan_fails(capsys, *args: str) -> str:
    assert main(["scan", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if not line.startswith("qkmonitor: ")]
    assert len(lines) == 1, err
    return lines[0]


def config(folder, **fields) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    fields = {"model_type": "llama", "num_attention_heads": 2, **fields}
    (folder / "config.json").write_text(json.dumps(fields))


def test_a_missing_path(tmp_path, capsys):
    line = scan_fails(capsys, str(tmp_path / "nope"), "--log-dir", str(tmp_path / "run"))
    assert f"{tmp_path / 'nope'}: no such file or folder; expected a Hugging Face model" in line


def test_a_folder_with_no_config(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    line = scan_fails(capsys, str(tmp_path / "empty"), "--log-dir", str(tmp_path / "run"))
    assert "empty: holds no config.json and no checkpoints" in line


def test_a_folder_with_no_weights(tmp_path, capsys):
    config(tmp_path / "model")
    line = scan_fails(capsys, str(tmp_path / "model"), "--log-dir", str(tmp_path / "run"))
    assert "holds config.json but no weights; expected model.safetensors" in line


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_corrupt_safetensors_file(tmp_path, capsys, damage):
    config(tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8)}, weights)
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x00" * 64)
    line = scan_fails(capsys, str(tmp_path / "model"), "--log-dir", str(tmp_path / "run"))
    assert "model.safetensors: not a readable safetensors file (truncated or corrupt?)" in line


def test_a_model_with_no_attention(tmp_path, capsys):
    config(tmp_path / "mlp", model_type="mlp")
    save_file({"layers.0.fc.weight": torch.randn(4, 4)}, tmp_path / "mlp" / "model.safetensors")
    line = scan_fails(capsys, str(tmp_path / "mlp"), "--log-dir", str(tmp_path / "run"))
    assert "no attention found (model_type 'mlp'); looked for query/key projections" in line


def test_an_architecture_whose_projections_cannot_be_placed(tmp_path, capsys):
    config(tmp_path / "odd", model_type="odd")
    save_file(
        {"blocks.0.attn.proj_in.weight": torch.randn(12, 4)}, tmp_path / "odd" / "model.safetensors"
    )
    line = scan_fails(capsys, str(tmp_path / "odd"), "--log-dir", str(tmp_path / "run"))
    assert "cannot place the query/key projections of model_type 'odd'" in line
    assert "blocks.0.attn.proj_in.weight" in line and "looked for" in line
    assert "qkmonitor.AttentionSpec" in line and "--model package.module:Class" in line


class Payload:
    def __reduce__(self):
        return (print, ("pickled code ran",))


def test_a_pickle_with_code_is_refused(tmp_path, capsys):
    config(tmp_path / "model")
    with open(tmp_path / "model" / "pytorch_model.bin", "wb") as out:
        pickle.dump({"w": Payload()}, out)
    line = scan_fails(capsys, str(tmp_path / "model"), "--log-dir", str(tmp_path / "run"))
    assert "pytorch_model.bin: not a readable torch checkpoint" in line
    assert "pickled code ran" not in capsys.readouterr().out


def test_a_lightning_checkpoint_of_no_bundled_model(tmp_path, capsys):
    torch.save({"state_dict": {"w": torch.zeros(2)}, "global_step": 3}, tmp_path / "x.ckpt")
    line = scan_fails(capsys, str(tmp_path / "x.ckpt"), "--log-dir", str(tmp_path / "run"))
    assert "x.ckpt: no model config among its hyper-parameters" in line
    assert "--model package.module:Class" in line


def test_a_log_dir_that_already_holds_a_run(tmp_path, capsys, llama_saver):
    llama_saver(tmp_path / "model")
    assert main(["scan", str(tmp_path / "model"), "--log-dir", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    line = scan_fails(capsys, str(tmp_path / "model"), "--log-dir", str(tmp_path / "run"))
    assert "already holds a TensorBoard run; expected a new or empty folder" in line


def scan_in(folder, *args: str):
    """``qkmonitor scan ARGS`` as a user runs it: the console script, in ``folder``, in a process
    of its own (no ``PYTHONPATH``)."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    script = shutil.which("qkmonitor", path=str(Path(sys.executable).parent))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [script, "scan", *args], capture_output=True, text=True, timeout=300, cwd=folder,
        env=env, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (
            b"here: loss 1.2 at step 300\n",  # `he`: the legacy reader said 101 (`e`)
            (
                "not a torch checkpoint: its first bytes are text ('here: loss 1.2 at step 3'), "
                "neither a zip archive (torch.save's format) nor a pickle"
            ),
        ),
        (b"", "not a torch checkpoint: the file is empty"),
        (
            bytes(range(16)),
            (
                "not a torch checkpoint: its first bytes (00 01 02 03 04 05 06 07) are neither a "
                "zip archive (torch.save's format) nor a pickle"
            ),
        ),
    ],
    ids=["text", "empty", "binary"],
)
def test_a_file_named_ckpt_that_is_no_checkpoint_says_what_it_is(tmp_path, content, said):
    """Issue 59, item 9: a text file named ``.ckpt`` was "not a readable torch checkpoint
    (weights only): 101" (the pickle opcode ``e`` the legacy reader met)."""
    (tmp_path / "notes.ckpt").write_bytes(content)
    done = scan_in(tmp_path, "notes.ckpt", "--log-dir", "run")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    # qkmonitor's own lines (an older matplotlib, CI's minimums, warns about its styles on stderr)
    ours = [line for line in done.stderr.splitlines() if line.startswith("qkmonitor")]
    assert ours == [f"qkmonitor scan: notes.ckpt: {said}"], done.stderr

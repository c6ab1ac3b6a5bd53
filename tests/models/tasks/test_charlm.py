"""Character-level LM on the standard library's source: the text's origin, the split, learning."""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from qkmonitor.models import TransformerConfig
from qkmonitor.models.tasks import CharLMTask, PythonSourceDataModule, python_source_files

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def test_text_is_whole_stdlib_files_in_a_seeded_order_and_the_split_is_by_file():
    data = PythonSourceDataModule(
        max_chars=60_000, seq_len=32, train_size=50, val_size=20, max_file_chars=5_000, seed=3
    )
    data.setup()
    files = data.val_files + data.train_files
    assert all(
        f.suffix == ".py" and STDLIB in f.parents and "site-packages" not in f.parts for f in files
    )
    assert not set(data.val_files) & set(data.train_files)
    # read independently: the texts are the files' bytes back to back, the last one cut at max_chars
    raw = b"".join(f.read_bytes()[:5_000] for f in files)[:60_000]
    val = bytes(data.val_text.tolist())
    assert bytes(data.val_text.tolist()) + bytes(data.train_text.tolist()) == raw
    assert len(files) >= 12
    assert val == b"".join(f.read_bytes()[:5_000] for f in data.val_files)  # no file is split
    assert len(val) >= 0.1 * 60_000
    x, y = data.train_set[7]
    assert x.shape == y.shape == (32,) and torch.equal(x[1:], y[:-1])
    assert bytes(x.tolist()) + bytes(y[-1:].tolist()) in raw
    again = PythonSourceDataModule(
        max_chars=60_000, seq_len=32, train_size=50, val_size=20, max_file_chars=5_000, seed=3
    )
    again.setup()
    assert again.train_files == data.train_files and torch.equal(
        again.train_set.offsets, data.train_set.offsets
    )
    other = PythonSourceDataModule(max_chars=60_000, seq_len=32, seed=4)
    other.setup()
    assert other.val_files + other.train_files != files


def test_root_selects_py_files_and_skips_third_party_packages(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "a.py").write_text("a" * 300)
    (tmp_path / "pkg" / "b.py").write_text("b" * 300)
    (tmp_path / "site-packages" / "c.py").write_text("c" * 300)
    (tmp_path / "notes.txt").write_text("d" * 300)
    assert python_source_files(tmp_path) == [tmp_path / "a.py", tmp_path / "pkg" / "b.py"]
    data = PythonSourceDataModule(max_chars=500, val_fraction=0.4, seq_len=16, root=str(tmp_path))
    data.setup()
    assert (
        len(data.val_text) == 300 and len(data.train_text) == 200
    )  # whole file held out, then cut at max_chars
    assert sorted(set(bytes(data.train_text.tolist()) + bytes(data.val_text.tolist()))) == [
        ord("a"),
        ord("b"),
    ]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_chars": 0}, "`max_chars` to be a positive int"),
        ({"val_fraction": 0.0}, "`val_fraction` in \\(0, 1\\)"),
        (
            {"max_chars": 1000, "seq_len": 128},
            "`max_chars` \\(1000\\) to leave more than `seq_len`",
        ),
        ({"root": "/nonexistent/dir"}, "`root` to be a directory"),
        ({"max_file_chars": 0}, "`max_file_chars` to be a positive int"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PythonSourceDataModule(**kwargs)


def test_empty_root_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="`root` to hold .py files"):
        PythonSourceDataModule(root=str(tmp_path))


def test_bits_per_char_is_the_loss_in_base_two():
    task = CharLMTask(TransformerConfig(vocab_size=256, d_model=16, n_heads=2, max_seq_len=8))
    logged = {}
    task.log = lambda name, value, **_: logged.__setitem__(name, float(value))
    tokens = torch.randint(256, (2, 8))
    loss = task._step((tokens, tokens.roll(-1, 1)), "val")
    assert math.isclose(logged["val_bpc"], float(loss) / math.log(2), rel_tol=1e-6)
    assert logged["val_loss"] > 4.0  # untrained: near ln 256 = 5.5 nats


@pytest.mark.slow
def test_small_decoder_learns_python_source(fit):
    """300 steps reach ~2.3 bits/char: far below the byte unigram entropy of Python source
    (~4.8)."""
    pl.seed_everything(0, verbose=False)
    data = PythonSourceDataModule(
        max_chars=300_000, seq_len=64, batch_size=32, val_size=128, seed=0
    )
    config = TransformerConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=64)
    last = fit(
        CharLMTask(config, lr=3e-3, warmup_steps=30, decay_steps=300),
        data,
        steps=300,
        val_every=150,
    ).history[-1]
    assert last["val_bpc"] <= 3.0
    assert math.isclose(last["val_bpc"], last["val_loss"] / math.log(2), rel_tol=1e-4)

"""Character-level language modelling on the Python standard library's own source code.

The text is read from the local installation (``sysconfig.get_paths()["stdlib"]``; nothing is
downloaded): every ``.py`` file below it except third-party packages (``site-packages``,
``dist-packages``), in a seeded random order, concatenated file by file (at most the first
``max_file_chars`` of each) until ``max_chars``.
Whole files go to validation (the first ones, about ``val_fraction`` of the text) or training
(the rest), so validation is code the model has never seen. The exact text depends on the
Python version installed; the same version and seed give the same text.

Characters are bytes: the files are read as bytes and each byte is a token (vocabulary 256), so
nothing is ever unknown or lost to decoding. The standard library's sources are nearly all
ASCII, where a byte is a character; "per character" below means per byte. Training samples
are random windows of ``seq_len + 1`` bytes (input and its next-byte targets); validation tiles
the held-out text with non-overlapping windows, ``val_size`` of them evenly spread. Metrics:
``val_loss`` in nats per character and ``val_bpc = val_loss / ln 2`` in bits per character.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

from qkmonitor.validation import check_fraction

from .base import SIZES, TaskDataModule
from .lm import CausalLMTask

__all__ = ["VOCAB_SIZE", "CharLMTask", "PythonSourceDataModule", "python_source_files"]

VOCAB_SIZE = 256  # one token per byte
THIRD_PARTY = frozenset({"site-packages", "dist-packages"})  # not the standard library


def python_source_files(root: str | Path | None = None) -> list[Path]:
    """The ``.py`` files below ``root`` (default: the standard library), sorted, third-party
    excluded.

    Raises:
        ValueError: if ``root`` is not a directory or holds no ``.py`` file.
    """
    root = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    if not root.is_dir():
        raise ValueError(f"Expected `root` to be a directory, got {str(root)!r}")
    files = sorted(
        p
        for p in root.rglob("*.py")
        if p.is_file() and not THIRD_PARTY.intersection(p.relative_to(root).parts)
    )
    if not files:
        raise ValueError(f"Expected `root` to hold .py files, found none below {str(root)!r}")
    return files


class _Windows(Dataset):
    """``(x, y)`` pairs of ``seq_len`` bytes starting at each offset; ``y`` is ``x`` shifted by
    one."""

    def __init__(self, text: Tensor, offsets: Tensor, seq_len: int) -> None:
        self.text, self.offsets, self.seq_len = text, offsets, seq_len

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = int(self.offsets[index])
        window = self.text[start : start + self.seq_len + 1]
        return window[:-1], window[1:]


class PythonSourceDataModule(TaskDataModule):
    """Byte-level windows of the standard library's source, selected from ``seed``.

    Args:
        max_chars: characters (bytes) read in all, train and validation together.
        val_fraction: share of ``max_chars`` held out for validation, in whole files.
        seq_len: context length of a window.
        batch_size: windows per training batch.
        train_size: random training windows per epoch.
        val_size: most validation windows (non-overlapping, evenly spread over the held-out text).
        max_file_chars: the most characters taken from one file (its beginning), so that the text
            samples many files rather than a few large ones.
        seed: chooses the file order and the training windows.
        root: read ``.py`` files below this directory instead of the standard library.
    """

    val_batch_size = 64

    def __init__(
        self,
        max_chars: int = 1_000_000,
        val_fraction: float = 0.1,
        seq_len: int = 128,
        batch_size: int = 32,
        train_size: int = 100_000,
        val_size: int = 256,
        max_file_chars: int = 20_000,
        seed: int = 0,
        root: str | None = None,
    ) -> None:
        super().__init__("max_chars", "seq_len", "max_file_chars", *SIZES)
        check_fraction("val_fraction", val_fraction)
        if min(val_fraction, 1 - val_fraction) * max_chars <= seq_len:
            raise ValueError(
                f"Expected `max_chars` ({max_chars}) to leave more than `seq_len` ({seq_len}) "
                f"characters to both training and validation with `val_fraction`={val_fraction}"
            )
        self.vocab_size = VOCAB_SIZE
        self.seq_len = seq_len
        self.files = python_source_files(root)  # fails early on a bad root

    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        order = torch.randperm(
            len(self.files), generator=torch.Generator().manual_seed(hp.seed)
        ).tolist()
        val_budget = round(hp.val_fraction * hp.max_chars)
        chunks: dict[str, list[bytes]] = {"val": [], "train": []}
        used: dict[str, list[Path]] = {"val": [], "train": []}
        total = 0
        for index in order:
            if total >= hp.max_chars:
                break
            split = "val" if total < val_budget else "train"
            data = self.files[index].read_bytes()[: min(hp.max_file_chars, hp.max_chars - total)]
            chunks[split].append(data)
            used[split].append(self.files[index])
            total += len(data)
        self.train_files, self.val_files = used["train"], used["val"]
        self.train_text = _as_tokens(b"".join(chunks["train"]))
        self.val_text = _as_tokens(b"".join(chunks["val"]))
        for split, text in (("training", self.train_text), ("validation", self.val_text)):
            if len(text) <= hp.seq_len:
                raise ValueError(
                    f"The {split} text ({len(text)} characters) is shorter than `seq_len`+1; "
                    f"raise `max_chars` or lower `seq_len`"
                )
        gen = torch.Generator().manual_seed(hp.seed + 1)
        train_offsets = torch.randint(
            len(self.train_text) - hp.seq_len, (hp.train_size,), generator=gen
        )
        tiles = torch.arange(0, len(self.val_text) - hp.seq_len, hp.seq_len)  # non-overlapping
        pick = torch.linspace(0, len(tiles) - 1, min(hp.val_size, len(tiles))).round().long()
        val_offsets = tiles[pick]  # spread over every held-out file, not just the first
        self.train_set = _Windows(self.train_text, train_offsets, hp.seq_len)
        self.val_set = _Windows(self.val_text, val_offsets, hp.seq_len)


def _as_tokens(data: bytes) -> Tensor:
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        if data
        else torch.zeros(0, dtype=torch.long)
    )


class CharLMTask(CausalLMTask):
    """:class:`~qkmonitor.models.tasks.CausalLMTask` that also logs ``{stage}_bpc``, bits per
    character.

    ``{stage}_loss`` is in nats per character (every position scored), ``{stage}_bpc`` the same
    in bits, ``{stage}_acc`` the next-character accuracy.
    """

    def _step(self, batch: tuple[Tensor, Tensor], stage: str) -> Tensor:
        loss = super()._step(batch, stage)
        self.log(f"{stage}_bpc", loss / math.log(2), prog_bar=stage == "val")
        return loss

"""Copy / reverse with the encoder–decoder: the data's layout, decoding, and that it learns."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from qkmonitor.models import TransformerConfig
from qkmonitor.models.tasks import CopyReverseDataModule, Seq2SeqTask, make_copy_batch
from qkmonitor.models.tasks.base import IGNORE_INDEX
from qkmonitor.models.tasks.copy_reverse import BOS, EOS, NUM_SPECIAL, PAD


def unpadded(row: torch.Tensor) -> list[int]:
    return [t for t in row.tolist() if t != PAD]


@pytest.mark.parametrize("reverse", [False, True])
def test_target_is_the_source_copied_or_reversed_then_eos(reverse):
    source, decoder_input, targets = make_copy_batch(
        300, 2, 9, 5, reverse, torch.Generator().manual_seed(0)
    )
    assert source.shape == (300, 9) and decoder_input.shape == targets.shape == (300, 10)
    lengths = set()
    for src, inp, tgt in zip(source, decoder_input, targets):
        string = unpadded(src)
        lengths.add(len(string))
        assert src.tolist() == string + [PAD] * (9 - len(string))  # right-padded, no gaps
        assert all(NUM_SPECIAL <= t < NUM_SPECIAL + 5 for t in string)
        expected = string[::-1] if reverse else string
        scored = [t for t in tgt.tolist() if t != IGNORE_INDEX]
        assert scored == expected + [EOS]
        assert tgt.tolist()[: len(scored)] == scored  # scored positions come first
        assert unpadded(inp) == [BOS] + expected  # teacher forcing: the target shifted right
    assert lengths == set(range(2, 10))


def test_data_is_reproducible_from_the_seed():
    a, b, c = (CopyReverseDataModule(reverse=True, train_size=16, seed=s) for s in (4, 4, 5))
    for data in (a, b, c):
        data.setup()
    assert all(torch.equal(x, y) for x, y in zip(a.train_set.tensors, b.train_set.tensors))
    assert not torch.equal(a.train_set.tensors[0], c.train_set.tensors[0])
    assert not torch.equal(a.train_set.tensors[0], a.val_set.tensors[0][:16])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_symbols": 0}, "`num_symbols` to be a positive int"),
        ({"min_len": 0}, "`min_len` to be a positive int"),
        ({"min_len": 6, "max_len": 5}, "`min_len` <= `max_len`"),
        ({"batch_size": 1.5}, "`batch_size`"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CopyReverseDataModule(**kwargs)


def test_task_checks_its_arguments_and_masks_padding():
    config = TransformerConfig(
        vocab_size=8, d_model=16, n_heads=2, max_seq_len=6, positional="learned"
    )
    with pytest.raises(ValueError, match="`decay_steps` to be a positive int"):
        Seq2SeqTask(config, decay_steps=0)
    with pytest.raises(ValueError, match="`lr` >= 0"):
        Seq2SeqTask(config, lr=-1.0)
    task = Seq2SeqTask(config).eval()
    source = torch.tensor([[3, 4, 5, PAD, PAD]])
    changed = torch.tensor([[3, 4, 5, 7, 6]])
    decoder_input = torch.tensor([[BOS, 5, 4]])
    with torch.no_grad():  # padding is invisible: only unmasked source tokens change the output
        torch.testing.assert_close(
            task(source, decoder_input), task(source, decoder_input), rtol=0, atol=0
        )
        masked = task.model(changed, decoder_input, torch.tensor([[True] * 3 + [False] * 2]))
        torch.testing.assert_close(task(source, decoder_input), masked, rtol=1e-5, atol=1e-5)
    assert task.greedy_decode(source, 4).shape == (1, 4)


@pytest.mark.slow
@pytest.mark.parametrize("reverse", [False, True])
def test_encoder_decoder_learns_to_copy_and_reverse(fit, reverse):
    """Lengths 3-10 over 10 symbols, 500 steps each: greedy decoding gets whole strings right."""
    pl.seed_everything(0, verbose=False)
    data = CopyReverseDataModule(reverse=reverse, val_size=512, seed=0)
    config = TransformerConfig(
        vocab_size=data.vocab_size,
        d_model=64,
        n_layers=2,
        n_heads=4,
        max_seq_len=data.seq_len,
        positional="learned",
    )
    task = Seq2SeqTask(config, lr=3e-3, warmup_steps=50, decay_steps=500)
    last = fit(task, data, steps=500, val_every=250).history[-1]
    assert last["val_acc"] >= 0.97  # teacher-forced tokens; chance is 1/10
    assert last["val_seq_acc"] >= 0.85  # greedy, whole string and EOS

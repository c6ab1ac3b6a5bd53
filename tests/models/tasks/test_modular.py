"""Modular addition (grokking): the equations, the split, and that a small model groks."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from qkmonitor.models import TransformerConfig
from qkmonitor.models.tasks import CausalLMTask, ModularAdditionDataModule, make_modular_addition
from qkmonitor.models.tasks.base import IGNORE_INDEX


def test_every_equation_appears_once_with_the_sum_mod_p_as_its_only_target():
    p = 7
    tokens, targets = make_modular_addition(p)
    assert tokens.shape == targets.shape == (p * p, 4)
    assert (tokens[:, 1] == p).all() and (tokens[:, 3] == p + 1).all()  # "+" and "="
    assert {(a, b) for a, b in tokens[:, [0, 2]].tolist()} == {
        (a, b) for a in range(p) for b in range(p)
    }
    assert (targets[:, :3] == IGNORE_INDEX).all()
    for (a, _, b, _), c in zip(tokens.tolist(), targets[:, 3].tolist()):
        assert c == (a + b) % p and 0 <= c < p


def test_split_is_a_seeded_partition_of_all_pairs():
    data = ModularAdditionDataModule(modulus=11, train_fraction=0.3, seed=5)
    data.setup()
    train, val = data.train_set.tensors[0], data.val_set.tensors[0]
    assert len(train) == round(0.3 * 121) and len(train) + len(val) == 121
    pairs = lambda t: {tuple(row) for row in t[:, [0, 2]].tolist()}
    assert not pairs(train) & pairs(val)
    again = ModularAdditionDataModule(modulus=11, train_fraction=0.3, seed=5)
    again.setup()
    assert torch.equal(again.train_set.tensors[0], train)
    other = ModularAdditionDataModule(modulus=11, train_fraction=0.3, seed=6)
    other.setup()
    assert not torch.equal(other.train_set.tensors[0], train)
    assert data.vocab_size == 13 and data.seq_len == 4
    batch = next(iter(data.train_dataloader()))[0]
    assert len(batch) == len(train)  # full batch by default


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"modulus": 0}, "`modulus` to be a positive int"),
        ({"modulus": 1}, "`modulus` >= 2"),
        ({"train_fraction": 1.0}, "`train_fraction` in \\(0, 1\\)"),
        ({"modulus": 2, "train_fraction": 0.01}, "`train_fraction` to leave both sets non-empty"),
        ({"batch_size": 0}, "`batch_size`"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModularAdditionDataModule(**kwargs)


@pytest.mark.slow
def test_small_transformer_groks_modular_addition(fit):
    """p = 23, 60% of the pairs, weight decay 1.0: memorizes first, then generalizes."""
    pl.seed_everything(0, verbose=False)
    data = ModularAdditionDataModule(modulus=23, train_fraction=0.6, seed=0)
    config = TransformerConfig(
        vocab_size=data.vocab_size, d_model=64, n_layers=1, n_heads=4, max_seq_len=4
    )
    history = fit(
        CausalLMTask(config, lr=3e-3, weight_decay=1.0, warmup_steps=50),
        data,
        steps=2000,
        val_every=250,
    )
    assert history.history[0]["train_acc"] == 1.0  # memorized at the first check ...
    assert history.history[0]["val_acc"] < 0.8  # ... while held-out pairs are mostly wrong
    assert history.best("val_acc") >= 0.95  # chance is 1/23

"""The 2-D grid task: labels from the marked cells, and only 2-D positions can learn it."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from qkmonitor.models import TransformerConfig
from qkmonitor.models.tasks import GridRelationDataModule, VisionClassificationTask, make_grid_batch
from qkmonitor.models.tasks.grid import NEITHER, SAME_COLUMN, SAME_ROW


def relation(patches: torch.Tensor, width: int) -> int:
    """The label, recomputed from where the two marked cells are."""
    (a, b) = patches[:, 1].nonzero().flatten().tolist()
    (ra, ca), (rb, cb) = divmod(a, width), divmod(b, width)
    return SAME_ROW if ra == rb else SAME_COLUMN if ca == cb else NEITHER


def test_labels_match_the_marked_cells_and_every_grid_holds_the_same_bag_of_patches():
    labels = torch.arange(600) % 3
    patches = make_grid_batch(labels, 3, 5, torch.Generator().manual_seed(0))
    assert patches.shape == (600, 15, 2)
    assert ((patches == 0) | (patches == 1)).all() and (patches.sum(-1) == 1).all()  # one-hot
    assert (patches[:, :, 1].sum(1) == 2).all()  # exactly two marked cells: the same bag every time
    assert [relation(p, 5) for p in patches] == labels.tolist()
    for label in (SAME_ROW, SAME_COLUMN, NEITHER):  # every cell gets marked in every class
        assert (patches[labels == label][:, :, 1].sum(0) > 0).all()


def test_data_is_seeded_and_validation_is_balanced():
    a, b, c = (GridRelationDataModule(3, 4, train_size=30, val_size=99, seed=s) for s in (1, 1, 2))
    for data in (a, b, c):
        data.setup()
    assert torch.equal(a.train_set.tensors[0], b.train_set.tensors[0])
    assert not torch.equal(a.train_set.tensors[0], c.train_set.tensors[0])
    assert torch.bincount(a.val_set.tensors[1]).tolist() == [33, 33, 33]
    assert [relation(p, 4) for p in a.train_set.tensors[0]] == a.train_set.tensors[1].tolist()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"height": 1}, "`height` >= 2"),
        ({"width": 0}, "`width` to be a positive int"),
        ({"val_size": 100}, "`val_size` to be a multiple of 3"),
        ({"batch_size": None}, "`batch_size`"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GridRelationDataModule(**kwargs)


def _task(positional: str, size: int) -> VisionClassificationTask:
    config = TransformerConfig(
        vocab_size=1,
        d_model=64,
        n_layers=2,
        n_heads=4,
        positional=positional,
        grid_size=(size, size),
        patch_dim=2,
        num_classes=3,
    )
    return VisionClassificationTask(config, lr=3e-3, warmup_steps=50, decay_steps=300)


def test_without_positions_the_model_cannot_tell_the_grids_apart():
    torch.manual_seed(0)
    task = _task("none", 4).eval()
    patches = make_grid_batch(torch.arange(30) % 3, 4, 4, torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = task(patches)
    torch.testing.assert_close(logits, logits[:1].expand_as(logits), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_rope_2d_learns_the_relation_while_no_positions_stay_at_chance(fit):
    """6 x 6 grids, 300 steps each: axial RoPE solves it, a set model cannot."""
    pl.seed_everything(0, verbose=False)
    rope = fit(
        _task("rope_2d", 6), GridRelationDataModule(6, 6, seed=0), steps=300, val_every=150
    ).history[-1]
    pl.seed_everything(0, verbose=False)
    bag = fit(
        _task("none", 6), GridRelationDataModule(6, 6, seed=0), steps=300, val_every=150
    ).history[-1]
    assert rope["val_acc"] >= 0.95
    assert bag["val_acc"] <= 1 / 3 + 0.01  # exactly a third: it outputs one class for every grid

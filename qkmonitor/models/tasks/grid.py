"""Same row, same column, or neither: a grid task that only 2-D positions can solve.

Each example is an ``H x W`` grid of patches, flattened row-major for the
:class:`~qkmonitor.models.VisionEncoder`. Exactly two cells are *marked*; every other cell is
background. A patch is the one-hot code of its cell's kind (``patch_dim = 2``: background,
marked). The label says how the two marked cells lie::

    0: same row        1: same column        2: neither (different row and column)

Classes are drawn uniformly, then the two cells uniformly among the pairs of that class. Every
example holds the same bag of patches (two marked, ``H*W - 2`` background), so a
permutation-invariant model — ``positional="none"``: attention and mean pooling commute with
any reordering of the patches — sees identical inputs for every label and cannot beat chance
(1/3; exactly 1/3 on the validation set, whose classes are balanced). With axial RoPE
(``positional="rope_2d"``) the score between the two marked cells depends on their row offset
and column offset separately, which is what the label asks for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import TensorDataset

from ..transformer import VisionEncoder
from .base import SIZES, TaskDataModule, TaskModule

__all__ = [
    "NEITHER",
    "PATCH_DIM",
    "SAME_COLUMN",
    "SAME_ROW",
    "GridRelationDataModule",
    "VisionClassificationTask",
    "make_grid_batch",
]

SAME_ROW, SAME_COLUMN, NEITHER = 0, 1, 2
NUM_CLASSES = 3
PATCH_DIM = 2  # one-hot: background, marked


def _distinct_pair(n: int, size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Two different indices in ``0 .. size-1``, uniform over ordered pairs."""
    first = torch.randint(size, (n,), generator=generator)
    second = (first + torch.randint(1, size, (n,), generator=generator)) % size
    return first, second


def make_grid_batch(labels: Tensor, height: int, width: int, generator: torch.Generator) -> Tensor:
    """Patches (n, height * width, 2) whose two marked cells lie as ``labels`` (n,) say.

    Args:
        labels: SAME_ROW, SAME_COLUMN or NEITHER per example.
        height: grid rows (>= 2).
        width: grid columns (>= 2).
        generator: the random source.
    """
    n = len(labels)
    same_r, same_c = (
        torch.randint(height, (n,), generator=generator),
        torch.randint(width, (n,), generator=generator),
    )
    r1, r2 = _distinct_pair(n, height, generator)
    c1, c2 = _distinct_pair(n, width, generator)
    row_a = torch.where(labels == SAME_ROW, same_r, r1)
    row_b = torch.where(labels == SAME_ROW, same_r, r2)
    col_a = torch.where(labels == SAME_COLUMN, same_c, c1)
    col_b = torch.where(labels == SAME_COLUMN, same_c, c2)
    marked = torch.zeros(n, height * width, dtype=torch.bool)
    rows = torch.arange(n)
    marked[rows, row_a * width + col_a] = True
    marked[rows, row_b * width + col_b] = True
    return F.one_hot(marked.long(), PATCH_DIM).float()


class GridRelationDataModule(TaskDataModule):
    """Train and validation grids, generated once from ``seed``; validation classes are balanced.

    Args:
        height: grid rows (>= 2).
        width: grid columns (>= 2).
        batch_size: grids per batch.
        train_size: training grids (an epoch).
        val_size: validation grids, a multiple of 3 so that each class has exactly a third.
        seed: generator seed; the same seed gives the same data.
    """

    val_batch_size = 512

    def __init__(
        self,
        height: int = 4,
        width: int = 4,
        batch_size: int = 64,
        train_size: int = 50_000,
        val_size: int = 1_023,
        seed: int = 0,
    ) -> None:
        super().__init__("height", "width", *SIZES)
        for name, value in (("height", height), ("width", width)):
            if value < 2:
                raise ValueError(
                    f"Expected `{name}` >= 2 (two cells must fit in a row and a column), got "
                    f"{value}"
                )
        if val_size % NUM_CLASSES:
            raise ValueError(
                f"Expected `val_size` to be a multiple of {NUM_CLASSES} (balanced classes), got "
                f"{val_size}"
            )
        self.grid_size = (height, width)
        self.patch_dim, self.num_classes = PATCH_DIM, NUM_CLASSES

    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        gen = torch.Generator().manual_seed(hp.seed)
        train_labels = torch.randint(NUM_CLASSES, (hp.train_size,), generator=gen)
        self.train_set = TensorDataset(
            make_grid_batch(train_labels, hp.height, hp.width, gen), train_labels
        )
        gen = torch.Generator().manual_seed(hp.seed + 1)
        val_labels = torch.arange(hp.val_size) % NUM_CLASSES
        self.val_set = TensorDataset(
            make_grid_batch(val_labels, hp.height, hp.width, gen), val_labels
        )


class VisionClassificationTask(TaskModule):
    """Cross-entropy for a :class:`~qkmonitor.models.VisionEncoder` classifier.

    Batches are ``(patches, labels)``: (B, P, patch_dim) and (B,). Logs ``{stage}_loss`` and
    ``{stage}_acc``.

    Args: see :class:`~qkmonitor.models.tasks.TaskModule`; ``config`` must set ``grid_size``,
    ``patch_dim`` and ``num_classes``.
    """

    model_class = VisionEncoder

    def forward(self, patches: Tensor) -> Tensor:
        return self.model(patches)

    def _step(self, batch: tuple[Tensor, Tensor], stage: str) -> Tensor:
        patches, labels = batch
        logits = self(patches)  # (B, C)
        loss = F.cross_entropy(logits, labels)
        self.log(f"{stage}_loss", loss, prog_bar=True)
        self.log(f"{stage}_acc", (logits.argmax(-1) == labels).float().mean(), prog_bar=True)
        return loss

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

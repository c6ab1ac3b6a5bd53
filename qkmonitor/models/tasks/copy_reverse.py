"""Copy and reverse: sequence to sequence with the :class:`~qkmonitor.models.EncoderDecoder`.

The source is a random string of ``min_len .. max_len`` symbols, right-padded; the target is the
same string (copy) or the string reversed (reverse), ended by EOS. The decoder is trained with
teacher forcing on the target shifted right behind BOS::

    source          s_1 s_2 ... s_L PAD ... PAD                 (B, max_len)
    decoder input   BOS y_1 ... y_L PAD ... PAD                 (B, max_len + 1)
    targets         y_1 y_2 ... EOS -100 ... -100               (B, max_len + 1)

with ``y = s`` (copy) or ``y = reversed(s)`` (reverse). Token ids: PAD = 0, BOS = 1, EOS = 2,
symbols ``3 .. 3 + num_symbols - 1``. Variable lengths make the model find the end (EOS) and,
for reverse, the source's length before it can emit the first token. The cross-attention has no
positions of its own (RoPE is self-attention only), so the task's default model uses learned
absolute positions, added to source and target embeddings alike.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..transformer import EncoderDecoder
from .base import IGNORE_INDEX, SIZES, TaskDataModule, TaskModule

__all__ = [
    "BOS",
    "EOS",
    "NUM_SPECIAL",
    "PAD",
    "CopyReverseDataModule",
    "Seq2SeqTask",
    "make_copy_batch",
]

PAD, BOS, EOS = 0, 1, 2
NUM_SPECIAL = 3  # symbols start after PAD, BOS, EOS


def make_copy_batch(
    n: int, min_len: int, max_len: int, num_symbols: int, reverse: bool, generator: torch.Generator
) -> tuple[Tensor, Tensor, Tensor]:
    """``n`` copy (or reverse) examples.

    Returns:
        source (n, max_len), decoder input (n, max_len + 1) and targets (n, max_len + 1), laid out
        as in the module docstring.
    """
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=generator)
    symbols = NUM_SPECIAL + torch.randint(num_symbols, (n, max_len), generator=generator)
    positions = torch.arange(max_len)
    real = positions < lengths[:, None]  # (n, max_len)
    source = torch.where(real, symbols, PAD)
    if reverse:  # y_t = s_{L-1-t}: gather with the index clamped, then re-pad
        index = (lengths[:, None] - 1 - positions).clamp_min(0)
        output = torch.where(real, source.gather(1, index), PAD)
    else:
        output = source
    bos = torch.full((n, 1), BOS)
    decoder_input = torch.cat((bos, output), dim=1)
    targets = torch.cat((output, torch.full((n, 1), PAD)), dim=1)
    targets[torch.arange(n), lengths] = EOS
    targets[targets == PAD] = IGNORE_INDEX
    return source, decoder_input, targets


class CopyReverseDataModule(TaskDataModule):
    """Train and validation sets of copy (or reverse) examples, generated once from ``seed``.

    Args:
        reverse: the target is the reversed source (otherwise a copy).
        num_symbols: size of the symbol alphabet (vocabulary ``num_symbols + 3``).
        min_len: shortest source.
        max_len: longest source; sources are right-padded to it.
        batch_size, train_size, val_size, seed: as :class:`~.base.TaskDataModule`.
    """

    def __init__(
        self,
        reverse: bool = False,
        num_symbols: int = 10,
        min_len: int = 3,
        max_len: int = 10,
        batch_size: int = 64,
        train_size: int = 50_000,
        val_size: int = 1_024,
        seed: int = 0,
    ) -> None:
        super().__init__("num_symbols", "min_len", "max_len", *SIZES)
        if min_len > max_len:
            raise ValueError(f"Expected `min_len` <= `max_len` ({max_len}), got {min_len}")
        self.vocab_size = num_symbols + NUM_SPECIAL
        self.seq_len = max_len + 1  # the decoder's length; the source is one shorter

    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        shape = (hp.min_len, hp.max_len, hp.num_symbols, hp.reverse)
        self.generate_sets(lambda n, generator: make_copy_batch(n, *shape, generator))


class Seq2SeqTask(TaskModule):
    """Teacher-forced cross-entropy for an :class:`~qkmonitor.models.EncoderDecoder`.

    Batches are ``(source, decoder_input, targets)``; source positions holding ``PAD`` (0) are
    masked out of the encoder's and the cross-attention's keys. Logs ``{stage}_loss`` (nats per
    target token) and ``{stage}_acc`` (token accuracy under teacher forcing); validation also logs
    ``val_seq_acc``, the exact-match rate of greedy decoding (every target token up to and
    including EOS right, each step fed the model's own previous output).

    Args: see :class:`~qkmonitor.models.tasks.TaskModule`.
    """

    model_class = EncoderDecoder

    def forward(self, source: Tensor, decoder_input: Tensor) -> Tensor:
        """(B, M) source, (B, N) decoder input -> (B, N, V) logits."""
        return self.model(source, decoder_input, source != PAD)

    @torch.no_grad()
    def greedy_decode(self, source: Tensor, steps: int) -> Tensor:
        """(B, M) source -> (B, steps) tokens, each the argmax given the ones before (after BOS)."""
        mask = source != PAD
        memory = self.model.encode(source, mask)
        out = torch.full((len(source), 1), BOS, device=source.device)
        for _ in range(steps):
            logits = self.model.decode(out, memory, mask)[:, -1]  # (B, V)
            out = torch.cat((out, logits.argmax(-1, keepdim=True)), dim=1)
        return out[:, 1:]

    def _step(self, batch: tuple[Tensor, Tensor, Tensor], stage: str) -> Tensor:
        source, decoder_input, targets = batch
        logits = self(source, decoder_input)  # (B, N, V)
        return self.token_loss(logits, targets, stage)

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> None:
        self._step(batch, "val")
        source, _, targets = batch
        decoded = self.greedy_decode(source, targets.shape[1])
        exact = ((decoded == targets) | (targets == IGNORE_INDEX)).all(dim=1)
        self.log("val_seq_acc", exact.float().mean(), prog_bar=True)

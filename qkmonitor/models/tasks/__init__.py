"""Example tasks: LightningModules and LightningDataModules, generated on the fly or read from the
local Python installation (nothing is downloaded).

- ``recall``: multi-query associative recall, :class:`AssociativeRecallDataModule` +
  :class:`CausalLMTask`.
- ``copy`` / ``reverse``: :class:`CopyReverseDataModule` + :class:`Seq2SeqTask` (encoder–decoder).
- ``charlm``: :class:`PythonSourceDataModule` (the stdlib's own source, bytes) +
  :class:`CharLMTask`.
- ``grid``: :class:`GridRelationDataModule` + :class:`VisionClassificationTask` (vision encoder, 2-D
  RoPE).
- ``modular``: modular addition (grokking), :class:`ModularAdditionDataModule` +
  :class:`CausalLMTask`.
"""

from .base import TaskModule
from .charlm import CharLMTask, PythonSourceDataModule, python_source_files
from .copy_reverse import CopyReverseDataModule, Seq2SeqTask, make_copy_batch
from .grid import GridRelationDataModule, VisionClassificationTask, make_grid_batch
from .lm import CausalLMTask
from .modular import ModularAdditionDataModule, make_modular_addition
from .recall import AssociativeRecallDataModule, make_recall_batch, train_recall_miniature

__all__ = [
    "AssociativeRecallDataModule",
    "CausalLMTask",
    "CharLMTask",
    "CopyReverseDataModule",
    "GridRelationDataModule",
    "ModularAdditionDataModule",
    "PythonSourceDataModule",
    "Seq2SeqTask",
    "TaskModule",
    "VisionClassificationTask",
    "make_copy_batch",
    "make_grid_batch",
    "make_modular_addition",
    "make_recall_batch",
    "python_source_files",
    "train_recall_miniature",
]

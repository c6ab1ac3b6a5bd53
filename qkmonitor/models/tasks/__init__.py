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

:mod:`qkmonitor.models.tasks.registry` names them for ``qkmonitor train --task``. The names here
are loaded on first use (the module's ``__getattr__``), so that reading the registry (``qkmonitor
train --help``, ``qkmonitor report``) loads no Lightning.
"""

from typing import TYPE_CHECKING

from qkmonitor.lazy import lazy_exports as _lazy_exports

if TYPE_CHECKING:
    from .base import TaskDataModule, TaskModule
    from .charlm import CharLMTask, PythonSourceDataModule, python_source_files
    from .copy_reverse import CopyReverseDataModule, Seq2SeqTask, make_copy_batch
    from .grid import GridRelationDataModule, VisionClassificationTask, make_grid_batch
    from .lm import CausalLMTask
    from .modular import ModularAdditionDataModule, make_modular_addition
    from .recall import AssociativeRecallDataModule, make_recall_batch

#: the names loaded on first use -> the module of this package that defines them
_LAZY = {
    "AssociativeRecallDataModule": ".recall",
    "CausalLMTask": ".lm",
    "CharLMTask": ".charlm",
    "CopyReverseDataModule": ".copy_reverse",
    "GridRelationDataModule": ".grid",
    "ModularAdditionDataModule": ".modular",
    "PythonSourceDataModule": ".charlm",
    "Seq2SeqTask": ".copy_reverse",
    "TaskDataModule": ".base",
    "TaskModule": ".base",
    "VisionClassificationTask": ".grid",
    "make_copy_batch": ".copy_reverse",
    "make_grid_batch": ".grid",
    "make_modular_addition": ".modular",
    "make_recall_batch": ".recall",
    "python_source_files": ".charlm",
}
__getattr__, __dir__ = _lazy_exports(globals(), _LAZY)


__all__ = [
    "AssociativeRecallDataModule",
    "CausalLMTask",
    "CharLMTask",
    "CopyReverseDataModule",
    "GridRelationDataModule",
    "ModularAdditionDataModule",
    "PythonSourceDataModule",
    "Seq2SeqTask",
    "TaskDataModule",
    "TaskModule",
    "VisionClassificationTask",
    "make_copy_batch",
    "make_grid_batch",
    "make_modular_addition",
    "make_recall_batch",
    "python_source_files",
]

"""The example tasks by name: what ``qkmonitor train --task NAME`` builds, and its defaults.

Each :class:`TaskEntry` holds a task's defaults for the options every task shares (the model's
size, the optimizer), how its data module is made from the parsed options, which task module
learns it, and its words for the line ``qkmonitor train`` prints first. The options are an
``argparse.Namespace`` or any object with the same attributes (``d_model``, ``layers``, ``heads``,
``kv_heads``, ``positional``, ``lr``, ``weight_decay``, ``steps``, ``lr_decay``, ``batch_size``,
``seed`` and the task's own: ``pairs``, ``modulus``, ...). The task modules are imported when a
task is built, so reading the registry loads no Lightning.

Example::

    from qkmonitor.models.tasks.registry import TASKS

    TASKS["recall"].defaults["steps"]        # 1500
    data, task = TASKS["recall"].build(args)  # args: qkmonitor train's parsed options
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["TASKS", "TaskEntry", "model_config", "optimizer_options"]

#: the model and the task module's class, and the model config's fields the data decides
_Made = tuple[Any, Callable[..., Any], dict[str, Any]]


@dataclass(frozen=True)
class TaskEntry:
    """One task of ``qkmonitor train --task``.

    Attributes:
        name: the task's name on the command line.
        defaults: the shared options' values for this task; an option given on the command line
            wins.
        make: the parsed options -> the data module, the task module's class and the model
            config's fields the data decides (vocabulary, length, ...).
        learns: the parsed options -> what the task learns, in words.
        model: the kind of model, in words.
    """

    name: str
    defaults: Mapping[str, object]
    make: Callable[[Any], _Made]
    learns: Callable[[Any], str]
    model: str = "decoder"

    def build(self, options: Any) -> tuple[Any, Any]:
        """The data module and the task module the options describe.

        Raises:
            ValueError: an option the data module, the model or the optimizer refuses.
        """
        data, task_class, fields = self.make(options)
        return data, task_class(model_config(options, **fields), **optimizer_options(options))


def model_config(options: Any, **fields: Any):
    """The model config from the shared options; ``fields`` are the task's own (vocabulary, ...)."""
    from qkmonitor.models.config import TransformerConfig

    return TransformerConfig(
        d_model=options.d_model,
        n_layers=options.layers,
        n_heads=options.heads,
        n_kv_heads=options.kv_heads,
        positional=options.positional,
        **fields,
    )


def optimizer_options(options: Any) -> dict[str, Any]:
    """The task module's optimizer arguments: AdamW's, a warmup of a tenth of the run (at most
    100 steps) and, for ``lr_decay="cosine"``, a decay over the whole run."""
    return {
        "lr": options.lr,
        "weight_decay": options.weight_decay,
        "warmup_steps": min(100, options.steps // 10),
        "decay_steps": options.steps if options.lr_decay == "cosine" else None,
    }


def _sequence(data: Any) -> dict[str, Any]:
    """The config fields of a task on token sequences: its vocabulary and length."""
    return {"vocab_size": data.vocab_size, "max_seq_len": data.seq_len}


def _recall(o: Any) -> _Made:
    from .lm import CausalLMTask
    from .recall import AssociativeRecallDataModule

    data = AssociativeRecallDataModule(
        num_pairs=o.pairs,
        num_queries=o.pairs,
        num_keys=4 * o.pairs,
        num_values=4 * o.pairs,
        batch_size=o.batch_size,
        seed=o.seed,
    )
    return data, CausalLMTask, _sequence(data)


def _modular(o: Any) -> _Made:
    from .lm import CausalLMTask
    from .modular import ModularAdditionDataModule

    data = ModularAdditionDataModule(
        modulus=o.modulus, train_fraction=o.train_fraction, batch_size=o.batch_size, seed=o.seed
    )
    return data, CausalLMTask, _sequence(data)


def _charlm(o: Any) -> _Made:
    from .charlm import CharLMTask, PythonSourceDataModule

    data = PythonSourceDataModule(
        max_chars=o.chars, seq_len=o.seq_len, batch_size=o.batch_size, seed=o.seed
    )
    return data, CharLMTask, _sequence(data)


def _grid(o: Any) -> _Made:
    from .grid import GridRelationDataModule, VisionClassificationTask

    data = GridRelationDataModule(
        height=o.grid_size, width=o.grid_size, batch_size=o.batch_size, seed=o.seed
    )
    fields = {
        "vocab_size": 1,
        "max_seq_len": o.grid_size**2,
        "grid_size": data.grid_size,
        "patch_dim": data.patch_dim,
        "num_classes": data.num_classes,
    }
    return data, VisionClassificationTask, fields


#: The shared options' defaults each task's entry starts from (its entry names what differs).
_SHARED = {
    "steps": 400,
    "d_model": 64,
    "layers": 2,
    "heads": 4,
    "batch_size": 64,
    "lr": 3e-3,
    "lr_decay": "cosine",
    "weight_decay": 0.1,
    "positional": "rope",
}


def _defaults(**changes: object) -> dict[str, object]:
    return {**_SHARED, **changes}


def _copy_reverse(reverse: bool, steps: int) -> TaskEntry:
    """The ``copy`` task, or with ``reverse`` the ``reverse`` one: one data module, a flag apart."""
    name, verb = ("reverse", "reversing") if reverse else ("copy", "copying")

    def make(o: Any) -> _Made:
        from .copy_reverse import CopyReverseDataModule, Seq2SeqTask

        data = CopyReverseDataModule(
            reverse=reverse,
            min_len=min(3, o.length),
            max_len=o.length,
            batch_size=o.batch_size,
            seed=o.seed,
        )
        return data, Seq2SeqTask, _sequence(data)

    return TaskEntry(
        name,
        _defaults(steps=steps, positional="learned"),
        make,
        lambda o: f"{verb} strings of up to {o.length} symbols",
        model="encoder-decoder",
    )


#: The tasks, ``recall`` (the default) first. Each learns with ``qkmonitor train --task X`` on a
#: 2-core CPU in about a minute or two.
TASKS: dict[str, TaskEntry] = {
    entry.name: entry
    for entry in (
        TaskEntry(
            "recall",
            _defaults(steps=1500, lr_decay="constant"),
            _recall,
            lambda o: f"associative recall ({o.pairs} key-value pairs a sequence)",
        ),
        _copy_reverse(reverse=False, steps=600),
        _copy_reverse(reverse=True, steps=800),
        TaskEntry(
            "modular",
            _defaults(steps=2500, layers=1, batch_size=None, weight_decay=1.0),
            _modular,
            lambda o: f"addition mod {o.modulus} ({o.train_fraction:.0%} of the pairs trained on)",
        ),
        TaskEntry(
            "charlm",
            _defaults(d_model=128, batch_size=32),
            _charlm,
            lambda o: f"next-character prediction on Python's own source ({o.chars:,} characters)",
        ),
        TaskEntry(
            "grid",
            _defaults(positional="rope_2d"),
            _grid,
            lambda o: f"a relation between cells of a {o.grid_size}x{o.grid_size} grid",
            model="vision encoder",
        ),
    )
}

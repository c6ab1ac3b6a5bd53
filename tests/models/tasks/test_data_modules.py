"""What every task's data module shares (``TaskDataModule``): its ``__init__`` arguments saved as
hyper-parameters, as given, and the named sizes checked positive."""

from __future__ import annotations

import inspect

import pytest

from qkmonitor.models.tasks import (
    AssociativeRecallDataModule,
    CopyReverseDataModule,
    GridRelationDataModule,
    ModularAdditionDataModule,
    PythonSourceDataModule,
)

DATA_MODULES = [
    AssociativeRecallDataModule,
    PythonSourceDataModule,
    CopyReverseDataModule,
    GridRelationDataModule,
    ModularAdditionDataModule,
]


def arguments_of(cls: type) -> dict:
    """The ``__init__`` arguments with their defaults, read from the signature."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]  # past `self`
    return {p.name: p.default for p in parameters}


@pytest.mark.parametrize("cls", DATA_MODULES, ids=lambda c: c.__name__)
def test_every_argument_is_saved_as_given(cls):
    defaults = arguments_of(cls)
    assert dict(cls().hparams) == defaults
    given = {"seed": 7} | ({"batch_size": 5} if "batch_size" in defaults else {})
    assert dict(cls(**given).hparams) == defaults | given


def test_a_users_subclass_keeps_its_own_arguments_and_those_of_the_task():
    class Shorter(CopyReverseDataModule):
        def __init__(self, tag: str = "mine", **kwargs) -> None:
            super().__init__(max_len=6, **kwargs)
            self.tag = tag

    hparams = dict(Shorter(tag="x", seed=3).hparams)
    assert hparams["tag"] == "x" and hparams["seed"] == 3 and hparams["max_len"] == 6


@pytest.mark.parametrize(
    ("cls", "name"),
    [
        (CopyReverseDataModule, "num_symbols"),
        (CopyReverseDataModule, "train_size"),
        (AssociativeRecallDataModule, "num_values"),
        (AssociativeRecallDataModule, "val_size"),
        (GridRelationDataModule, "width"),
        (PythonSourceDataModule, "max_file_chars"),
        (PythonSourceDataModule, "batch_size"),
        (ModularAdditionDataModule, "modulus"),
    ],
)
@pytest.mark.parametrize("bad", [0, -2, 2.5])
def test_a_size_that_is_not_a_positive_int_is_named(cls, name, bad):
    with pytest.raises(ValueError, match=f"`{name}`"):
        cls(**{name: bad})

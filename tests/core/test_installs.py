"""qkmonitor.attention.installs: what qkmonitor puts on a module is left out of every copy of it,
the module's own hooks and attributes are kept, and the last undo leaves the module as it was."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from qkmonitor.attention.compiled import add_forward_hooks
from qkmonitor.attention.installs import installs_of, set_attribute


class Recorder:
    """A picklable hook that counts its calls (a user's own hook)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args) -> None:
        self.calls += 1


def test_copies_keep_the_modules_own_hooks_and_attributes_and_leave_out_qkmonitors():
    torch.manual_seed(0)
    module = nn.Linear(3, 3)
    own_pre, own_post = Recorder(), Recorder()
    module.register_forward_pre_hook(own_pre)
    module.register_forward_hook(own_post, always_call=True)
    module.tag = "the user's"
    ours = []
    remove = add_forward_hooks(
        module, pre=lambda *a: ours.append("pre"), post=lambda *a: ours.append("post")
    )
    undo_tag = set_attribute(module, "tag", "qkmonitor's")
    undo_new = set_attribute(module, "_qkmonitor_thing", lambda: None)
    before = {name: dict(getattr(module, name)) for name in vars(module) if name.endswith("hooks")}

    for clone in (copy.deepcopy(module), pickle.loads(pickle.dumps(module)), copy.copy(module)):
        assert installs_of(clone) is None and "__getstate__" not in vars(clone)
        assert clone.tag == "the user's" and not hasattr(clone, "_qkmonitor_thing")
        assert len(clone._forward_pre_hooks) == 1 and len(clone._forward_hooks) == 1
        assert len(clone._forward_hooks_always_called) == 1
        clone(torch.ones(1, 3))
        assert ours == []  # the copy never calls qkmonitor's hooks
        torch.testing.assert_close(clone.weight, module.weight)
    # the module itself is untouched by the copies
    assert {name: dict(getattr(module, name)) for name in before} == before
    module(torch.ones(1, 3))
    assert ours == ["pre", "post"] and module.tag == "qkmonitor's"

    remove()
    undo_tag()
    undo_new()
    undo_new()  # once only
    assert installs_of(module) is None and "__getstate__" not in vars(module)
    assert module.tag == "the user's" and "_qkmonitor_thing" not in vars(module)
    assert len(module._forward_pre_hooks) == 1 and len(module._forward_hooks) == 1


def test_an_attribute_is_installed_once_at_a_time():
    module = nn.Linear(2, 2)
    undo = set_attribute(module, "x", 1)
    with pytest.raises(RuntimeError, match="'x' is already installed on Linear"):
        set_attribute(module, "x", 2)
    undo()
    assert "x" not in vars(module) and installs_of(module) is None

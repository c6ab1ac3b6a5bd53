"""qkmonitor.private_apis: each private name of torch, Lightning and transformers that qkmonitor
uses is in the installed release (a release that drops one fails here, naming it), its accessor
falls back or refuses by name where it is missing, and no other module of the package touches
such a name."""

from __future__ import annotations

import ast
import copy
import importlib
import io
import re
import tokenize
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkmonitor
from qkmonitor import private_apis
from qkmonitor.private_apis import PRIVATE_APIS, PrivateAPIMissing, PrivateAPIWarning

GPT2_UPCAST = "transformers.models.gpt2.modeling_gpt2.GPT2Attention._upcast_and_reordered_attn"
# where torch's context_parallel has defined `_distribute_function` (2.13; earlier releases)
CONTEXT_PARALLEL_MODULES = (
    "torch.distributed.tensor.experimental._context_parallel._attention",
    "torch.distributed.tensor.experimental._attention",
    "torch.distributed._tensor.experimental.attention",
)


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees the once-a-process warnings anew."""
    monkeypatch.setattr(private_apis, "_warned", set())


def _context_parallel_has_it() -> bool:
    for name in CONTEXT_PARALLEL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if callable(getattr(module, "_distribute_function", None)):
            return True
    return False


def _logger_prefixes(tmp_path) -> bool:
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    loggers = [TensorBoardLogger(tmp_path, prefix="p"), CSVLogger(tmp_path, prefix="p")]
    return all(getattr(logger, "_prefix", None) == "p" for logger in loggers)


def _gpt2_config():
    return pytest.importorskip("transformers").GPT2Config()


def _gpt2_attention() -> type:
    pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    return GPT2Attention


def _compiled_function_original() -> bool:
    def function(x):
        return x

    return getattr(torch.compile(function), "_torchdynamo_orig_callable", None) is function


def _compiled_in_place() -> bool:
    module = nn.Linear(2, 2)
    module.compile()
    return getattr(module, "_compiled_call_impl", None) is not None


def _is_view_of_its_base(x: torch.Tensor) -> bool:
    return x.t()._base is x


def _hook_dict(attribute: str, register: str) -> bool:
    module = nn.Linear(2, 2)
    getattr(module, register)(lambda *args: None)
    return len(getattr(module, attribute, {})) == 1


#: per name: whether the installed release has it (and it does what qkmonitor reads it for)
PRESENT = {
    "torch._C._current_graph_task_id": lambda tmp: torch._C._current_graph_task_id() == -1,
    "torch._C._nn.scaled_dot_product_attention": lambda tmp: (
        torch._C._nn.scaled_dot_product_attention is F.scaled_dot_product_attention
    ),
    "torch.distributed.tensor.experimental._context_parallel._attention._distribute_function": (
        lambda tmp: _context_parallel_has_it()
    ),
    # FSDP2's class, at its public path (torch 2.6 on) or its private one (2.4 - 2.5)
    "torch.distributed._composable.fsdp.FSDPModule": lambda tmp: (
        private_apis.fsdp_module_type().__name__ == "FSDPModule"
    ),
    "torch._dynamo.eval_frame.OptimizedModule": lambda tmp: isinstance(
        torch.compile(nn.Linear(2, 2)),
        importlib.import_module("torch._dynamo.eval_frame").OptimizedModule,
    ),
    "torch._dynamo.eval_frame.OptimizedModule._orig_mod": lambda tmp: isinstance(
        getattr(torch.compile(nn.Linear(2, 2)), "_orig_mod", None), nn.Linear
    ),
    "torch.nn.Module._compiled_call_impl": lambda tmp: _compiled_in_place(),
    "torch.nn.Module._forward_pre_hooks": lambda tmp: _hook_dict(
        "_forward_pre_hooks", "register_forward_pre_hook"
    ),
    "torch.nn.Module._forward_hooks": lambda tmp: _hook_dict(
        "_forward_hooks", "register_forward_hook"
    ),
    "torch.overrides._get_current_function_mode": lambda tmp: (
        torch.overrides._get_current_function_mode() is None
    ),
    "torch.overrides._pop_mode": lambda tmp: callable(getattr(torch.overrides, "_pop_mode", None)),
    "torch.overrides._push_mode": lambda tmp: callable(
        getattr(torch.overrides, "_push_mode", None)
    ),
    "torch.compile(f)._torchdynamo_orig_callable": lambda tmp: _compiled_function_original(),
    "torch.Tensor._base": lambda tmp: _is_view_of_its_base(torch.ones(2, 2)),
    "torch.optim.Optimizer._optimizer_step_pre_hooks": lambda tmp: hasattr(
        torch.optim.SGD([nn.Parameter(torch.zeros(1))]), "_optimizer_step_pre_hooks"
    ),
    "torch.utils.tensorboard.SummaryWriter._get_file_writer": lambda tmp: callable(
        getattr(
            importlib.import_module("torch.utils.tensorboard").SummaryWriter,
            "_get_file_writer",
            None,
        )
    ),
    "lightning.pytorch.LightningModule._compiler_ctx": lambda tmp: (
        "_compiler_ctx" in vars(importlib.import_module("lightning.pytorch").LightningModule())
    ),
    "lightning.pytorch.loggers.Logger._prefix": _logger_prefixes,
    # None until a model sets it (transformers 5), or the default "eager" (4.48, CI's minimum)
    "transformers.PretrainedConfig._attn_implementation": lambda tmp: (
        _gpt2_config()._attn_implementation in (None, "eager")
    ),
    "transformers.PretrainedConfig._attn_implementation_internal": lambda tmp: (
        private_apis.route_config(copy.copy(_gpt2_config()), "sdpa")
    ),
    GPT2_UPCAST: lambda tmp: callable(
        getattr(_gpt2_attention(), "_upcast_and_reordered_attn", None)
    ),
}


def test_every_name_is_checked_both_ways():
    assert set(PRESENT) == set(PRIVATE_APIS) == set(REMOVED)


@pytest.mark.parametrize("name", sorted(PRIVATE_APIS))
def test_the_installed_release_has_it(name, tmp_path):
    api = PRIVATE_APIS[name]
    if api.since and api.library == "torch" and torch.__version__ < api.since:
        pytest.skip(f"{name}: its feature arrived in torch {api.since} ({torch.__version__})")
    assert PRESENT[name](tmp_path), (
        f"this {api.library} has no `{name}` (as qkmonitor reads it; checked on {api.checked}): "
        f"its accessor in qkmonitor/private_apis.py now gives the {api.missing}; find the new "
        "name or drop the use"
    )


# --- each accessor with its name removed: a fallback or a refusal naming the API


def _warned_of(name: str, call):
    """``call()``'s result, checked to have warned that ``name`` is missing."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    messages = [str(w.message) for w in caught if issubclass(w.category, PrivateAPIWarning)]
    assert any(f"`{name}`" in message for message in messages), messages
    return result


def _no_graph_task_id(monkeypatch):
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    name = "torch._C._current_graph_task_id"
    assert _warned_of(name, private_apis.in_backward) is False


def _no_torch_sdpa(monkeypatch):
    monkeypatch.delattr(torch._C._nn, "scaled_dot_product_attention")
    name = "torch._C._nn.scaled_dot_product_attention"
    assert _warned_of(name, private_apis.torch_sdpa) is F.scaled_dot_product_attention


def _renamed_distribute_function(monkeypatch):
    def inner_fn(*args):
        return args

    inner_fn.__module__ = "torch.distributed.tensor.experimental._context_parallel._attention"
    inner_fn.__qualname__ = "_distribute_function.<locals>.inner_fn"
    assert private_apis.is_context_parallel_wrapper(inner_fn)
    inner_fn.__qualname__ = "_spread_function.<locals>.inner_fn"  # a release that renames it
    assert not private_apis.is_context_parallel_wrapper(inner_fn)


def _no_fsdp_module(monkeypatch):
    """Neither path (public, private) has it: no module is taken for FSDP2's."""
    import torch.distributed._composable.fsdp as private_fsdp
    import torch.distributed.fsdp as public_fsdp

    for module in (public_fsdp, private_fsdp):
        monkeypatch.delattr(module, "FSDPModule", raising=False)
    name = "torch.distributed._composable.fsdp.FSDPModule"
    assert _warned_of(name, private_apis.fsdp_module_type) == ()


def _no_optimized_module(monkeypatch):
    from torch._dynamo import eval_frame

    from qkmonitor.attention.compiled import compiled_roots

    model = nn.Sequential(torch.compile(nn.Linear(2, 2)))
    monkeypatch.delattr(eval_frame, "OptimizedModule")
    name = "torch._dynamo.eval_frame.OptimizedModule"
    assert _warned_of(name, private_apis.optimized_module_type) is None
    assert compiled_roots(model) == []  # taken for uncompiled


def _no_orig_mod(monkeypatch):
    name = "torch._dynamo.eval_frame.OptimizedModule._orig_mod"
    assert _warned_of(name, lambda: private_apis.compiled_original(nn.Module())) is None


def _no_compiled_call_impl(monkeypatch):
    assert private_apis.compiled_in_place(object()) is False


def _no_hook_dict(attribute: str):
    def check(monkeypatch):
        module = nn.Linear(2, 2)
        monkeypatch.delattr(module, attribute)
        kept = _warned_of(
            f"torch.nn.Module.{attribute}", lambda: private_apis.forward_hook_dicts(module)
        )
        assert len(kept) == 1  # the other one

    return check


def _no_mode_function(attribute: str):
    def check(monkeypatch):
        from qkmonitor.attention.parallel_hooks import ParallelHooks

        monkeypatch.delattr(torch.overrides, attribute)
        assert _warned_of(f"torch.overrides.{attribute}", private_apis.function_mode_ops) is None
        assert ParallelHooks(nn.Sequential(nn.Linear(2, 2)))._swapped == []  # hooks left in sight

    return check


def _no_orig_callable(monkeypatch):
    assert private_apis.compiled_function_original(lambda x: x) is None


def _no_tensor_base(monkeypatch):
    class NoBase(torch.Tensor):
        @property
        def _base(self):
            raise AttributeError("_base")

    tensor = torch.ones(2).as_subclass(NoBase)
    assert _warned_of("torch.Tensor._base", lambda: private_apis.view_base(tensor)) is None
    assert private_apis.view_base(object()) is None  # a non-tensor: no view, no warning


def _no_step_pre_hooks(monkeypatch):
    init = torch.optim.Optimizer.__init__

    def without(self, *args, **kwargs):
        init(self, *args, **kwargs)
        del self._optimizer_step_pre_hooks

    monkeypatch.setattr(torch.optim.Optimizer, "__init__", without)
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))])
    name = "torch.optim.Optimizer._optimizer_step_pre_hooks"
    assert _warned_of(name, lambda: private_apis.takes_step_pre_hooks(optimizer)) is True


def _no_get_file_writer(monkeypatch):
    name = "torch.utils.tensorboard.SummaryWriter._get_file_writer"
    file_writer = object()
    writer = types.SimpleNamespace(file_writer=file_writer)
    assert _warned_of(name, lambda: private_apis.tensorboard_file_writer(writer)) is file_writer
    with pytest.raises(PrivateAPIMissing, match=re.escape(f"`{name}`")):
        private_apis.tensorboard_file_writer(types.SimpleNamespace(file_writer=None))


def _no_compiler_ctx(monkeypatch):
    assert private_apis.lightning_compiler_ctx(nn.Module()) is None


def _no_logger_prefix(monkeypatch):
    assert private_apis.logger_prefix(types.SimpleNamespace(prefix="p")) == ""


def _no_attn_implementation(monkeypatch):
    config = types.SimpleNamespace()
    assert not private_apis.has_attn_implementation(config)
    assert private_apis.attn_implementation(config) is None


def _elsewhere_attn_implementation(monkeypatch):
    class Elsewhere:  # a release that keeps the implementation under another name
        _attn_implementation = property(lambda self: self.__dict__.get("_implementation"))

    assert private_apis.route_config(Elsewhere(), "sdpa") is False  # the caller refuses


def _no_gpt2_upcast(monkeypatch):
    assert private_apis.gpt2_upcast(nn.Module) is None  # the caller refuses, naming it
    assert f"`{GPT2_UPCAST}`" in private_apis.missing_message(GPT2_UPCAST)


#: per name: the accessor with the name gone gives its fallback, or refuses naming it
REMOVED = {
    "torch._C._current_graph_task_id": _no_graph_task_id,
    "torch._C._nn.scaled_dot_product_attention": _no_torch_sdpa,
    "torch.distributed.tensor.experimental._context_parallel._attention._distribute_function": (
        _renamed_distribute_function
    ),
    "torch.distributed._composable.fsdp.FSDPModule": _no_fsdp_module,
    "torch._dynamo.eval_frame.OptimizedModule": _no_optimized_module,
    "torch._dynamo.eval_frame.OptimizedModule._orig_mod": _no_orig_mod,
    "torch.nn.Module._compiled_call_impl": _no_compiled_call_impl,
    "torch.nn.Module._forward_pre_hooks": _no_hook_dict("_forward_pre_hooks"),
    "torch.nn.Module._forward_hooks": _no_hook_dict("_forward_hooks"),
    "torch.overrides._get_current_function_mode": _no_mode_function("_get_current_function_mode"),
    "torch.overrides._pop_mode": _no_mode_function("_pop_mode"),
    "torch.overrides._push_mode": _no_mode_function("_push_mode"),
    "torch.compile(f)._torchdynamo_orig_callable": _no_orig_callable,
    "torch.Tensor._base": _no_tensor_base,
    "torch.optim.Optimizer._optimizer_step_pre_hooks": _no_step_pre_hooks,
    "torch.utils.tensorboard.SummaryWriter._get_file_writer": _no_get_file_writer,
    "lightning.pytorch.LightningModule._compiler_ctx": _no_compiler_ctx,
    "lightning.pytorch.loggers.Logger._prefix": _no_logger_prefix,
    "transformers.PretrainedConfig._attn_implementation": _no_attn_implementation,
    "transformers.PretrainedConfig._attn_implementation_internal": _elsewhere_attn_implementation,
    GPT2_UPCAST: _no_gpt2_upcast,
}


@pytest.mark.parametrize("name", sorted(PRIVATE_APIS))
def test_without_it_the_accessor_falls_back_or_refuses_by_name(name, monkeypatch):
    REMOVED[name](monkeypatch)


@pytest.mark.parametrize("name", sorted(PRIVATE_APIS))
def test_the_message_names_the_api_and_where_it_was_checked(name):
    api = PRIVATE_APIS[name]
    message = private_apis.missing_message(name)
    assert f"`{name}`" in message and api.checked in message and api.missing in message
    assert api.library in ("torch", "lightning", "transformers")


# --- no other module touches a private name


#: attributes retired to public API (torchmetrics' `metric_state`, `nn.Module.named_children`)
RETIRED = ("_defaults", "_modules", "_parameters", "_buffers")
LIBRARIES = r"(?:torch|lightning|pytorch_lightning|transformers|torchmetrics)"
GENERIC = (
    re.compile(rf"\b{LIBRARIES}(?:\.\w+)*\._(?!_)\w"),  # torch._C, torch.overrides._pop_mode
    re.compile(rf"^\s*from\s+{LIBRARIES}[\w.]*\s+import\b.*\b_(?!_)\w"),  # from x import _y
)


def _private_attributes() -> set[str]:
    names = {name.rsplit(".", 1)[-1] for name in PRIVATE_APIS} | set(RETIRED)
    return {name for name in names if name.startswith("_")}


def _code_and_strings(source: str) -> tuple[list[str], list[tuple[int, object]]]:
    """The source's lines with strings and comments blanked, and its string literals by line."""
    lines = [list(line) for line in source.splitlines()]
    literals = []
    blanked = {tokenize.STRING, tokenize.COMMENT, getattr(tokenize, "FSTRING_MIDDLE", -1)}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in blanked:
            continue
        if token.type == tokenize.STRING:
            try:
                literals.append((token.start[0], ast.literal_eval(token.string)))
            except (ValueError, SyntaxError):
                pass
        (row, col), (end_row, end_col) = token.start, token.end
        for r in range(row, end_row + 1):
            line = lines[r - 1]
            first, last = (col if r == row else 0), (end_col if r == end_row else len(line))
            line[first:last] = " " * (last - first)
    return ["".join(line) for line in lines], literals


def test_no_module_but_the_door_touches_a_private_name():
    package = Path(qkmonitor.__file__).parent
    attributes = _private_attributes()
    touch = re.compile(r"(?<!\bself)(?<!\bcls)\.(" + "|".join(sorted(attributes)) + r")\b")
    found = []
    for path in sorted(package.rglob("*.py")):
        if path == Path(private_apis.__file__) or "models" in path.relative_to(package).parts:
            continue
        where = path.relative_to(package.parent)
        lines, literals = _code_and_strings(path.read_text())
        for number, line in enumerate(lines, 1):
            if touch.search(line) or any(pattern.search(line) for pattern in GENERIC):
                found.append(f"{where}:{number}: {line.strip()}")
        found += [
            f"{where}:{number}: {value!r}" for number, value in literals if value in attributes
        ]
    assert not found, (
        "private names of torch, Lightning or transformers outside qkmonitor/private_apis.py "
        "(reach them through an accessor there; docs/architecture.md, 'Private APIs'):\n"
        + "\n".join(found)
    )

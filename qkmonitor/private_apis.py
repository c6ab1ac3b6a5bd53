"""The one door to the private names of torch, Lightning and transformers that qkmonitor uses.

A name with a leading underscore is no promise: a release may rename or drop it without notice.
Every such name qkmonitor imports, reads or patches is reached through an accessor here and
nowhere else (``tests/core/test_private_apis.py`` greps the package for strays), so that one file
says what qkmonitor leans on, and what it does where a release lacks it:

- a **fallback**, where qkmonitor can do without: the accessor returns what the name's absence
  means (not compiled, no view, no prefix), with a :class:`PrivateAPIWarning` naming the API
  where the absence can be told from the installed release (once a process and name);
- a **refusal**, where it cannot: :class:`PrivateAPIMissing` (or the caller's warning that a
  layer has no statistics) naming the API, never an ``AttributeError`` deep in a probe.

:data:`PRIVATE_APIS` lists them all, each with the releases it was checked on: those the test
suite runs on (CI's latest and its minimums, torch 2.4.0 among them: docs/requirements.md). The
tests check each name on the installed release, and each accessor with the name removed.

Adding a name: an accessor here (what it is, why qkmonitor needs it, what happens without it), an
entry in :data:`PRIVATE_APIS`, and in the tests a presence check and a removal check under the
entry's name. Lightning and transformers are never imported here (the layers contract keeps
Lightning out of this layer): their names are read off the objects handed in.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPT2_UPCAST",
    "PRIVATE_APIS",
    "FunctionModeOps",
    "PrivateAPI",
    "PrivateAPIMissing",
    "PrivateAPIWarning",
    "attn_implementation",
    "compiled_function_original",
    "compiled_in_place",
    "compiled_original",
    "forward_hook_dicts",
    "fsdp_module_type",
    "function_mode_ops",
    "gpt2_upcast",
    "has_attn_implementation",
    "in_backward",
    "is_context_parallel_wrapper",
    "lightning_compiler_ctx",
    "logger_prefix",
    "missing_message",
    "optimized_module_type",
    "route_config",
    "takes_step_pre_hooks",
    "tensorboard_file_writer",
    "torch_sdpa",
    "view_base",
]

_TORCH = "torch 2.4.0 and 2.13.0"
_LIGHTNING = "lightning 2.4.0 and 2.6.6"
_TRANSFORMERS = "transformers 4.48 to 5.25"


@dataclass(frozen=True)
class PrivateAPI:
    """One private name: ``name`` as a reader finds it, the ``library`` it belongs to, the
    releases it was ``checked`` on, what qkmonitor does where it is ``missing``, and the first
    release of the feature it belongs to (``since``; empty: every release qkmonitor supports):
    before that there is nothing for qkmonitor to read."""

    name: str
    library: str
    checked: str
    missing: str
    since: str = ""


def _api(name: str, checked: str, missing: str, since: str = "") -> PrivateAPI:
    return PrivateAPI(name, name.split(".")[0], checked, missing, since)


#: every private name qkmonitor uses, by the name its messages give
PRIVATE_APIS: dict[str, PrivateAPI] = {
    api.name: api
    for api in (
        _api(
            "torch._C._current_graph_task_id",
            _TORCH,
            "fallback: probes count a forward recomputed by activation checkpointing again; warns",
        ),
        _api(
            "torch._C._nn.scaled_dot_product_attention",
            _TORCH,
            "fallback: F.scaled_dot_product_attention as imported; warns",
        ),
        _api(
            "torch.distributed.tensor.experimental._context_parallel._attention._distribute_function",
            "torch 2.8.0 and 2.13.0 (2.5.1, 2.6.0: in experimental._attention, read in the wheels)",
            "fallback: context_parallel's SDPA wrapper is not recognised (DTensor arguments "
            "sharded along the sequence still are)",
            since="2.5",  # context_parallel's first release
        ),
        _api(
            "torch.distributed._composable.fsdp.FSDPModule",
            "torch 2.4.0 (2.5.1: read in the wheel; public from 2.6, where it is not used)",
            "fallback: FSDP2 is taken for tensor parallelism (EffectiveRank probes a share of its "
            "sequences on each rank, as if the ranks computed the same ones); warns",
        ),
        _api(
            "torch._dynamo.eval_frame.OptimizedModule",
            _TORCH,
            "fallback: a torch.compile'd module is taken for an uncompiled one; warns",
        ),
        _api(
            "torch._dynamo.eval_frame.OptimizedModule._orig_mod",
            _TORCH,
            "fallback: the compiled module's region is not switched to eager while probed; warns",
        ),
        _api(
            "torch.nn.Module._compiled_call_impl",
            _TORCH,
            "fallback: a module compiled in "
            "place (nn.Module.compile()) is taken for an uncompiled one",
        ),
        _api(
            "torch.nn.Module._forward_pre_hooks",
            _TORCH,
            "fallback: tensor parallelism's "
            "pre-hooks stay in the interceptor's sight (slower, same statistics); warns",
        ),
        _api(
            "torch.nn.Module._forward_hooks",
            _TORCH,
            "fallback: tensor parallelism's "
            "hooks stay in the interceptor's sight (slower, same statistics); warns",
        ),
        _api(
            "torch.overrides._get_current_function_mode",
            _TORCH,
            "fallback: tensor parallelism's hooks stay in the interceptor's sight; warns",
        ),
        _api("torch.overrides._pop_mode", _TORCH, "fallback: as _get_current_function_mode"),
        _api("torch.overrides._push_mode", _TORCH, "fallback: as _get_current_function_mode"),
        _api(
            "torch.compile(f)._torchdynamo_orig_callable",
            _TORCH,
            "fallback: a torch.compile'd function is not unwrapped (a compiled flex_attention "
            "is not recognised as one)",
        ),
        _api(
            "torch.Tensor._base",
            _TORCH,
            "fallback: every tensor is taken for a non-view "
            "(a view's gradient and a DTensor view go unread); warns",
        ),
        _api(
            "torch.optim.Optimizer._optimizer_step_pre_hooks",
            _TORCH,
            "fallback: any optimizer with register_step_pre_hook is hooked; warns",
        ),
        _api(
            "torch.utils.tensorboard.SummaryWriter._get_file_writer",
            _TORCH,
            "fallback: the writer's file_writer; refusal (PrivateAPIMissing) where it has none",
        ),
        _api(
            "lightning.pytorch.LightningModule._compiler_ctx",
            _LIGHTNING,
            "fallback: a module Lightning compiles is taken for an uncompiled one",
        ),
        _api(
            "lightning.pytorch.loggers.Logger._prefix",
            _LIGHTNING,
            "fallback: no prefix on the tags written outside log_metrics",
        ),
        _api(
            "transformers.PretrainedConfig._attn_implementation",
            _TRANSFORMERS,
            "refusal: the layer's attention statistics, with a warning naming it",
        ),
        _api(
            "transformers.PretrainedConfig._attn_implementation_internal",
            _TRANSFORMERS,
            "refusal: the layer's attention statistics, with a warning naming it",
        ),
        _api(
            "transformers.models.gpt2.modeling_gpt2.GPT2Attention._upcast_and_reordered_attn",
            _TRANSFORMERS,
            "refusal: the statistics of a GPT-2 layer with "
            "reorder_and_upcast_attn=True, with a warning naming it",
        ),
    )
}


class PrivateAPIWarning(UserWarning):
    """A private name qkmonitor uses is missing from the installed release: it falls back."""


class PrivateAPIMissing(RuntimeError):
    """A private name qkmonitor needs is missing from the installed release: it refuses."""


def missing_message(name: str, consequence: str = "") -> str:
    """The message for a missing private name: which, where it was checked, what follows."""
    api = PRIVATE_APIS[name]
    installed = torch.__version__ if api.library == "torch" else "as installed"
    text = (
        f"qkmonitor uses {api.library}'s private `{name}` (checked on {api.checked}); "
        f"{api.library} {installed} has none"
    )
    return f"{text}: {consequence or api.missing}"


_warned: set[str] = set()


def _fall_back(name: str) -> None:
    """Warn once a process that ``name`` is missing and qkmonitor falls back."""
    if name not in _warned:
        _warned.add(name)
        warnings.warn(missing_message(name), PrivateAPIWarning, stacklevel=3)


# --- autograd and SDPA


def in_backward() -> bool:
    """Whether autograd runs a backward on this thread (``torch._C._current_graph_task_id() !=
    -1``): a forward there is activation checkpointing recomputing one, which probes must not
    count twice. No public API tells it."""
    name = "torch._C._current_graph_task_id"
    current = getattr(torch._C, "_current_graph_task_id", None)
    if current is None:
        _fall_back(name)
        return False
    return current() != -1


def torch_sdpa() -> Callable:
    """torch's own SDPA, ``torch._C._nn.scaled_dot_product_attention``: what a
    ``TorchFunctionMode`` is handed for an SDPA call, also inside ``context_parallel``, whose
    wrapper replaces ``F.scaled_dot_product_attention`` meanwhile."""
    function = getattr(getattr(torch._C, "_nn", None), "scaled_dot_product_attention", None)
    if function is None:
        _fall_back("torch._C._nn.scaled_dot_product_attention")
        return F.scaled_dot_product_attention
    return function


def fsdp_module_type() -> type | tuple[()]:
    """FSDP2's module class, to tell its sharded parameters from tensor parallelism's:
    ``torch.distributed.fsdp.FSDPModule`` (public from torch 2.6), else the same class at its
    private path on torch 2.4 - 2.5, else ``()`` (``isinstance`` then says no) with a warning."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            _fall_back("torch.distributed._composable.fsdp.FSDPModule")
            return ()
    return FSDPModule


def is_context_parallel_wrapper(function: object) -> bool:
    """Whether ``function`` is the SDPA wrapper torch's ``context_parallel`` installs: the
    ``inner_fn`` of its private ``_distribute_function`` (the module path moved between
    releases; the function's name did not). A release that renames it goes unrecognised."""
    module = getattr(function, "__module__", None) or ""
    qualname = getattr(function, "__qualname__", None) or ""
    return module.startswith("torch.distributed") and "_distribute_function" in qualname


# --- torch.compile


def optimized_module_type() -> type | None:
    """``torch._dynamo.eval_frame.OptimizedModule``, the class of what ``torch.compile(module)``
    returns (torch has no public name for it), or None without it. Imported when first asked:
    dynamo imports triton, which ``import qkmonitor`` must not."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:
        _fall_back("torch._dynamo.eval_frame.OptimizedModule")
        return None
    return OptimizedModule


def compiled_original(module: nn.Module) -> nn.Module | None:
    """The module a ``torch.compile``'d one wraps (its ``_orig_mod``), or None without it."""
    original = getattr(module, "_orig_mod", None)
    if not isinstance(original, nn.Module):
        _fall_back("torch._dynamo.eval_frame.OptimizedModule._orig_mod")
        return None
    return original


def compiled_in_place(module: object) -> bool:
    """Whether ``module`` was compiled in place (``nn.Module.compile()`` sets its
    ``_compiled_call_impl``)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def compiled_function_original(value: object) -> object | None:
    """What ``torch.compile(f)`` compiled (``f``, its ``_torchdynamo_orig_callable``), for a
    compiled function; else None."""
    return getattr(value, "_torchdynamo_orig_callable", None)


def lightning_compiler_ctx(module: object) -> dict | None:
    """What a LightningModule that Lightning compiles keeps in its ``_compiler_ctx`` (the
    original ``forward`` and ``*_step`` methods, under ``original_{name}``), or None."""
    return getattr(module, "_compiler_ctx", None) or None


# --- module hooks and the torch function mode stack


def forward_hook_dicts(module: nn.Module) -> list[dict]:
    """The module's forward pre-hook and forward hook dictionaries (``_forward_pre_hooks``,
    ``_forward_hooks``), to swap a hook in place (same key, order and flags: no public API
    replaces one); those missing are left out."""
    found = []
    for attribute in ("_forward_pre_hooks", "_forward_hooks"):
        hooks = getattr(module, attribute, None)
        if isinstance(hooks, dict):
            found.append(hooks)
        else:
            _fall_back(f"torch.nn.Module.{attribute}")
    return found


class FunctionModeOps(NamedTuple):
    """torch's function mode stack: the mode on top, take it off, put one back."""

    current: Callable[[], Any]
    pop: Callable[[], Any]
    push: Callable[[Any], None]


def function_mode_ops() -> FunctionModeOps | None:
    """``torch.overrides``' private ``_get_current_function_mode``, ``_pop_mode`` and
    ``_push_mode``, to run a hook with the interceptor off the top of the mode stack (the public
    ``TorchFunctionMode.__exit__`` would close the interception); None if one is missing."""
    from torch import overrides

    names = ("_get_current_function_mode", "_pop_mode", "_push_mode")
    found = [getattr(overrides, name, None) for name in names]
    for function, name in zip(found, names):
        if function is None:
            _fall_back(f"torch.overrides.{name}")
    return None if None in found else FunctionModeOps(*found)


# --- tensors, optimizers, TensorBoard, loggers


def view_base(tensor: object) -> Any:
    """The tensor a view was taken of (``Tensor._base``; None for a non-view or a non-tensor):
    no public API gives it. A tensor without it is taken for a non-view."""
    try:
        return tensor._base  # type: ignore[attr-defined]
    except AttributeError:
        if isinstance(tensor, torch.Tensor):
            _fall_back("torch.Tensor._base")
        return None


def takes_step_pre_hooks(optimizer: object) -> bool:
    """Whether ``optimizer`` holds the ``_optimizer_step_pre_hooks`` its public
    ``register_step_pre_hook`` adds to (a subclass that skipped ``Optimizer.__init__`` has
    none, and would fail there). Without the name in the release, any optimizer with
    ``register_step_pre_hook`` is taken."""
    if hasattr(optimizer, "_optimizer_step_pre_hooks"):
        return True
    if not hasattr(torch.optim.SGD([nn.Parameter(torch.zeros(1))]), "_optimizer_step_pre_hooks"):
        _fall_back("torch.optim.Optimizer._optimizer_step_pre_hooks")
        return callable(getattr(optimizer, "register_step_pre_hook", None))
    return False


def tensorboard_file_writer(writer: Any) -> Any:
    """A ``SummaryWriter``'s file writer (``_get_file_writer()``, which reopens one after
    ``close``), to add raw summaries: many scalars in one event, images already encoded.

    Raises:
        PrivateAPIMissing: where the writer has neither that nor a ``file_writer``.
    """
    name = "torch.utils.tensorboard.SummaryWriter._get_file_writer"
    get = getattr(writer, "_get_file_writer", None)
    if callable(get):
        return get()
    file_writer = getattr(writer, "file_writer", None)
    if file_writer is None:
        raise PrivateAPIMissing(missing_message(name, "no file writer to add summaries to"))
    _fall_back(name)
    return file_writer


def logger_prefix(logger: object) -> str:
    """The prefix a Lightning logger's ``log_metrics`` puts before every tag (its ``_prefix``:
    no public attribute has it), or ""."""
    return getattr(logger, "_prefix", "") or ""


# --- transformers


def attn_implementation(config: object) -> Any:
    """The attention implementation a transformers config names (``config._attn_implementation``:
    the modules dispatch on it; no public attribute has it), or None where it has none."""
    return getattr(config, "_attn_implementation", None)


def has_attn_implementation(config: object) -> bool:
    """Whether ``config`` names its attention implementation (:func:`attn_implementation`): where
    it does not, nothing routes a module's attention call, and the layer refuses statistics."""
    return hasattr(config, "_attn_implementation")


def route_config(config: object, implementation: str) -> bool:
    """Make ``config`` (a copy, seen by one module) name ``implementation``, through the
    ``_attn_implementation_internal`` that its ``_attn_implementation`` reads; whether that took
    (False: this release keeps it elsewhere, and the caller refuses)."""
    config.__dict__["_attn_implementation_internal"] = implementation
    return attn_implementation(config) == implementation


#: the name of GPT-2's upcast path, wrapped on a routed module's instance
GPT2_UPCAST = "_upcast_and_reordered_attn"


def gpt2_upcast(cls: type) -> Callable | None:
    """GPT-2's ``_upcast_and_reordered_attn`` (its attention with ``reorder_and_upcast_attn``,
    which never reaches the dispatch), or None where the class has none."""
    return getattr(cls, GPT2_UPCAST, None)

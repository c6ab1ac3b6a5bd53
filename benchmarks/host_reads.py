"""The training thread's blocking reads of tensor values: what would make a GPU wait for the host.

On a device, every read of a tensor's value by Python (``.item()``, ``.tolist()``, ``.cpu()``,
``bool(t)``, a mask index whose result's shape depends on the values, ...) waits for every kernel
queued before it: the training step stalls while the host catches up. On a CPU nothing waits, so
those reads cost nothing there and are invisible to a timer; this module counts them instead, by
what is called, on any machine.

:class:`HostReads` is a ``TorchFunctionMode`` that counts, on the thread that enters it (the
training thread; the publishing thread and any worker are not counted), every call that reads a
tensor's values into Python or makes a shape from them:

- ``item``, ``tolist``, ``numpy``, ``cpu``, ``to("cpu")`` (the host named by the string),
  ``bool``/``float``/``int``/``complex``/``index`` of a tensor, its ``repr``/``format``;
- ``torch.equal``, ``allclose``, ``is_nonzero``, whose results are Python values;
- data-dependent shapes: ``nonzero``, ``argwhere``, ``masked_select``, ``unique``,
  ``unique_consecutive``, ``bincount``, one-argument ``torch.where``, ``repeat_interleave`` with a
  tensor of repeats, indexing with a boolean tensor.

On a CPU every tensor is a host tensor, so the mode tells apart what would be one on a device: a
tensor made while it is on from Python values without naming a device (``torch.tensor([...])``,
``torch.full(...)``: a factory makes it on the CPU in any run), one copied to the host (the result
of a counted ``.cpu()``/``.to("cpu")``), and what is computed from such tensors alone are host
tensors, whose reads wait for nothing and are not counted. Any other tensor (a parameter, an
activation, what is computed from one, a factory's output with a ``device`` argument) counts as
a device tensor: the count is what the same code makes a GPU run wait for, or more (a CPU
tensor's ``.cpu()`` is the tensor itself, which stays a device tensor to the count). A read is
attributed to the innermost frame of the package named by ``owner`` (default ``qkmonitor``, its
bundled models left out: their forward is the model's), or to ``"other"`` (the model's own code,
the optimizer's, torch's).

Run as a script, it prints the reads of one unprobed and one probed step of a plain loop, per
engine, on the bundled decoder and a nanoGPT-style model (SDPA through the interception)::

    python benchmarks/host_reads.py
    python benchmarks/host_reads.py --layers 4 --by-site   # where each read comes from
    python benchmarks/host_reads.py --gpu-paths   # the paths a GPU run takes, counted here
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import weakref
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

__all__ = ["HostReads", "count_step", "main"]

_T = torch.Tensor

#: Methods and functions whose result is a Python value read from the tensor, by name.
VALUE_READS: dict[Callable[..., Any], str] = {
    _T.item: "item",
    _T.tolist: "tolist",
    _T.numpy: "numpy",
    _T.cpu: "cpu",
    _T.__bool__: "bool",
    _T.__float__: "float",
    _T.__int__: "int",
    _T.__index__: "index",
    _T.__complex__: "complex",
    _T.__repr__: "repr",
    _T.__format__: "format",
    torch.equal: "equal",
    _T.equal: "equal",
    torch.allclose: "allclose",
    _T.allclose: "allclose",
    torch.is_nonzero: "is_nonzero",
    _T.is_nonzero: "is_nonzero",
}

#: Calls whose result's shape depends on the values (the host must read them to allocate it).
SHAPE_READS: dict[Callable[..., Any], str] = {
    torch.nonzero: "nonzero",
    _T.nonzero: "nonzero",
    torch.argwhere: "argwhere",
    _T.argwhere: "argwhere",
    torch.masked_select: "masked_select",
    _T.masked_select: "masked_select",
    torch.unique: "unique",
    _T.unique: "unique",
    torch.unique_consecutive: "unique_consecutive",
    _T.unique_consecutive: "unique_consecutive",
    torch.bincount: "bincount",
    _T.bincount: "bincount",
}


def _is_cpu_device(value: Any) -> bool:
    """Whether ``value`` names the host: the string ``"cpu"``. A ``torch.device`` is taken to be
    a tensor's own (``x.device``, as the package moves its states with), which on a CPU machine
    cannot be told from the host; the package names the host with the string."""
    return isinstance(value, str) and value.split(":")[0] == "cpu"


def _names_device(args: tuple) -> bool:
    """Whether positional arguments of ``Tensor.to`` name a device (not only a dtype)."""
    return any(isinstance(a, (str, torch.device, int)) and not isinstance(a, bool) for a in args)


def _kind(func: Callable[..., Any], args: tuple, kwargs: dict) -> str | None:
    """The kind of blocking read ``func(*args, **kwargs)`` is, or None where it reads nothing."""
    kind = VALUE_READS.get(func) or SHAPE_READS.get(func)
    if kind is not None:
        return kind
    if func is _T.to:
        device = kwargs.get("device", args[1] if len(args) > 1 else None)
        return "to_cpu" if _is_cpu_device(device) else None
    if func is torch.where and len(args) + len(kwargs) == 1:
        return "where"
    if func in (torch.repeat_interleave, _T.repeat_interleave):
        repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
        return "repeat_interleave" if isinstance(repeats, torch.Tensor) else None
    if func is _T.__getitem__ and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
            return "bool_index"
    return None


#: The package's own subpackages that stand for a user's code: the bundled models' forward is the
#: model's, not the monitor's.
NOT_OWNED = ("models",)


def _site(owner: str) -> str:
    """``module:function:line`` of the innermost frame inside the package ``owner`` (outside its
    :data:`NOT_OWNED` subpackages), or ``"other"``."""
    frame = sys._getframe(2)  # past _site and __torch_function__: the call, or torch's wrapper
    marker = os.sep + owner + os.sep
    while frame is not None:
        path = frame.f_code.co_filename
        if marker in path:
            module = path.rsplit(marker, 1)[1].removesuffix(".py").replace(os.sep, ".")
            if module.split(".")[0] in NOT_OWNED:
                return "other"
            return f"{owner}.{module}:{frame.f_code.co_name}:{frame.f_lineno}"
        frame = frame.f_back
    return "other"


#: id -> the tensors any mode has seen made on the host (see :class:`HostReads`)
_HOST: dict[int, weakref.ReferenceType] = {}


def _forget(key: int, _: weakref.ReferenceType) -> None:
    _HOST.pop(key, None)


class HostReads(TorchFunctionMode):
    """Counts the blocking reads made on the entering thread while the mode is on.

    Attributes:
        kinds: reads by kind (``"item"``, ``"cpu"``, ``"bool_index"``, ...).
        sites: reads by where they come from (``qkmonitor.<module>:<function>:<line> (kind)``,
            or ``"other (kind)"``), filled only with ``by_site=True``.
        owned: reads whose site is inside ``owner`` (the stack is walked once a read).

    Example::

        with HostReads() as reads:
            train_one_step()
        assert reads.total == 0, reads.kinds
    """

    def __init__(self, owner: str = "qkmonitor", by_site: bool = False) -> None:
        super().__init__()
        self.owner = owner
        self.by_site = by_site
        self.kinds: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()
        self.owned = 0
        self._host = _HOST  # shared: a host tensor stays one in the modes of later steps

    @property
    def total(self) -> int:
        """Every read counted, the package's and the rest's."""
        return sum(self.kinds.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _kind(func, args, kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_host = all(self._on_host(t) for t in tensors)
        if kind is not None and not (tensors and on_host):
            self.kinds[kind] += 1
            site = _site(self.owner)
            if site != "other":
                self.owned += 1
            if self.by_site:
                self.sites[f"{site} ({kind})"] += 1
        result = func(*args, **kwargs)
        moved = "device" in kwargs or (func is _T.to and _names_device(args[1:]))
        copied = kind in ("cpu", "to_cpu") and not on_host  # a read: its result is on the host
        if copied or (on_host and not moved):  # (a device named may be the model's)
            for out in tree_leaves(result):
                # (a CPU tensor's .cpu() is itself here, a device tensor still to other reads)
                if isinstance(out, torch.Tensor) and not any(out is t for t in tensors):
                    self._host[id(out)] = weakref.ref(out, partial(_forget, id(out)))
        return result

    def _on_host(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a host tensor in any run (:class:`HostReads`)."""
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor


def count_step(step: Callable[[], Any], **mode_args: Any) -> HostReads:
    """The reads one call of ``step()`` makes on this thread."""
    with HostReads(**mode_args) as reads:
        step()
    return reads


@contextlib.contextmanager
def as_on_gpu():
    """The paths a GPU run takes, on a CPU: the spectrum on its worker thread
    (``background_weights``), each probe's values logged at the next step (``defer_reads``), the
    attention rank's keys not trimmed (:data:`qkmonitor.engine.rank.TRIMMED_ON`)."""
    from qkmonitor.engine import QKSpectrum, base, rank

    original_init, original_engine_init = QKSpectrum.__init__, base.MonitorEngine.__init__
    trimmed, rank.TRIMMED_ON = rank.TRIMMED_ON, ()

    def init(self, *args, **kwargs):
        kwargs.setdefault("background_weights", True)
        original_init(self, *args, **kwargs)

    def engine_init(self, *args, **kwargs):
        if kwargs.get("options") is None:
            kwargs.setdefault("defer_reads", True)
        original_engine_init(self, *args, **kwargs)

    QKSpectrum.__init__, base.MonitorEngine.__init__ = init, engine_init
    try:
        yield
    finally:
        QKSpectrum.__init__, base.MonitorEngine.__init__ = original_init, original_engine_init
        rank.TRIMMED_ON = trimmed


def _plain_loop(arch: str, engines: list[str], layers: int, every: int):
    """A model, its batches and a ``Monitoring`` over ``engines``; returns a function that runs
    step ``i`` as a user's plain loop does (``with monitoring.step(i):`` around it)."""
    from qkmonitor.engine import AttentionEntropy, EffectiveRank, Monitoring, QKSpectrum
    from qkmonitor.models import DecoderLM, TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(
        vocab_size=64, d_model=64, n_layers=layers, n_heads=4, max_seq_len=64, dropout=0.0
    )
    if arch == "nanogpt":
        here = os.path.dirname(os.path.abspath(__file__))
        if here not in sys.path:
            sys.path.insert(0, here)
        from nanogpt import GPT

        model = GPT(config)
    else:
        model = DecoderLM(config)
    make = {
        "spectrum": QKSpectrum,
        "entropy": AttentionEntropy,
        "rank": lambda: EffectiveRank(max_probe_tokens=32),
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitoring = Monitoring(
        model, [make[name]() for name in engines], optimizer=optimizer, every_n_steps=every
    )
    tokens = torch.randint(0, 64, (8, 65), generator=torch.Generator().manual_seed(0))

    def step(i: int) -> None:
        with monitoring.step(i):
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            monitoring.observe_loss(loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    return monitoring, step


def reads_of_steps(
    arch: str,
    engines: list[str],
    layers: int = 2,
    every: int = 4,
    steps: int = 9,
    gpu_paths: bool = False,
    **mode_args,
) -> list[HostReads]:
    """Each step's reads for ``steps`` steps of a plain loop probing every ``every``-th step
    (``gpu_paths``: :func:`as_on_gpu`)."""
    with as_on_gpu() if gpu_paths else contextlib.nullcontext():
        monitoring, step = _plain_loop(arch, engines, layers, every)
        out = []
        with monitoring:
            for i in range(steps):
                out.append(count_step(lambda i=i: step(i), **mode_args))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder blocks (default 2)")
    parser.add_argument("--by-site", action="store_true", help="print where each read comes from")
    parser.add_argument(
        "--gpu-paths",
        action="store_true",
        help="take the paths a GPU run takes (the spectrum on its worker, values logged at the "
        "next step): what the training thread would wait for on a GPU",
    )
    args = parser.parse_args(argv)
    every = 4
    print(f"blocking reads on the training thread, plain loop, {args.layers} layers, probe every")
    quiet = f"1-{every - 2} and {every + 1}-{2 * every - 2}"
    print(f"{every} steps: 'unprobed' the most of steps {quiet},")
    print(f"'before' step {every - 1} (the update the spectrum compares), 'probed' step {every}")
    print("columns: the monitor's reads (all reads, the model's and optimizer's included)")
    print(f"{'model':8s} {'engines':22s} {'unprobed':>10s} {'before':>10s} {'probed':>10s}  kinds")
    for arch in ("bundled", "nanogpt"):
        for engines in (["spectrum"], ["entropy"], ["rank"], ["spectrum", "entropy", "rank"]):
            reads = reads_of_steps(
                arch, engines, args.layers, every, gpu_paths=args.gpu_paths, by_site=args.by_site
            )
            unprobed = max(
                (r.owned, r.total) for i, r in enumerate(reads) if 0 < i % every < every - 1
            )
            before, probed = reads[every - 1], reads[every]
            kinds = ", ".join(f"{k} {n}" for k, n in probed.kinds.most_common())
            name = "+".join(engines)
            cells = [f"{o} ({t})" for o, t in (unprobed, (before.owned, before.total))]
            cells.append(f"{probed.owned} ({probed.total})")
            print(f"{arch:8s} {name:22s} {cells[0]:>10s} {cells[1]:>10s} {cells[2]:>10s}  {kinds}")
            for site, n in probed.sites.most_common() if args.by_site else ():
                print(f"{'':10s}{n:4d}  {site}")


if __name__ == "__main__":
    main()

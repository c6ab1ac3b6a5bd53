"""What the interceptor adds to each torch call of a probed forward that it passes on.

A probe of a model with no attention adapter runs the forward under
:class:`~qkmonitor.attention.capture_mode.Interceptor`, a ``TorchFunctionMode`` that sees every
torch call. Most of them (a view, an activation; under tensor parallelism, DTensor's own calls)
are none the capture reads; this script measures what passing one on costs. Three calls the
capture never reads (``torch.relu``, ``Tensor.view``, ``Tensor.transpose`` on a 4-element tensor)
are timed with no mode and under the interceptor, in turn, in one process, CPU time
(``time.process_time``), the best of ``--repeats`` passes of ``--calls`` calls each; printed: the
microseconds a call, plain and intercepted, and their difference. To compare two versions of the
interceptor, run this file on each.

Usage::

    python benchmarks/interceptor.py
    python benchmarks/interceptor.py --calls 50000 --repeats 7
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext
from types import SimpleNamespace

import torch

from qkmonitor.attention.capture_mode import Interceptor


def per_call(mode, x: torch.Tensor, calls: int) -> float:
    """Microseconds of CPU a call, over ``calls`` rounds of three calls under ``mode``."""
    with mode:
        start = time.process_time()
        for _ in range(calls):
            torch.relu(x)
            x.view(2, 2)
            x.transpose(0, 0)
        return (time.process_time() - start) / (3 * calls) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    x = torch.zeros(4)
    capture = SimpleNamespace(in_kernel=False)  # read only where a call is one the capture reads
    plain, intercepted = [], []
    for _ in range(args.repeats):  # in turn, so that a slow spell falls on both
        plain.append(per_call(nullcontext(), x, args.calls))
        intercepted.append(per_call(Interceptor(capture), x, args.calls))
    best_plain, best_intercepted = min(plain), min(intercepted)
    print(
        f"torch {torch.__version__}: plain {best_plain:.2f} us a call, intercepted "
        f"{best_intercepted:.2f} us, added {best_intercepted - best_plain:.2f} us a call "
        f"(best of {args.repeats} x {args.calls} x 3 calls)"
    )


if __name__ == "__main__":
    main()

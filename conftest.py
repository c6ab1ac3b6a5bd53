"""Repository-wide pytest setup: Triton in the interpreter without a GPU; the xdist workers.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at the root,
before any test module or doctest is collected.
"""

import os

# One torch thread per test worker (unless the user set OMP_NUM_THREADS): the workers already use
# every CPU, so further OpenMP threads in each worker would only compete for the same cores
# (docs/benchmarks.md, "The test suite"). Subprocesses the tests start inherit the setting.
_ONE_THREAD = bool(os.environ.get("PYTEST_XDIST_WORKER")) and "OMP_NUM_THREADS" not in os.environ
if _ONE_THREAD:
    os.environ["OMP_NUM_THREADS"] = "1"

import torch

if _ONE_THREAD:
    torch.set_num_threads(1)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util

collect_ignore = []
try:
    import triton
except ImportError:  # without triton the doctest collector must not import the Triton backend
    collect_ignore.append("qkmonitor/kernels/_triton")
else:
    if not hasattr(triton, "knobs"):  # triton < 3.4 (CUDA torch < 2.8): the backend cannot import
        collect_ignore.append("qkmonitor/kernels/_triton")
if importlib.util.find_spec("transformers") is None:  # the Trainer callback imports it at the top
    collect_ignore.append("qkmonitor/callbacks/hf_trainer.py")


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: a worker per CPU, at most 4 (each imports torch, Lightning and transformers)."""
    return max(1, min(4, os.cpu_count() or 1))


#: How long the whole suite (slow tests included) took on CI's kind of machine, 2 CPUs with nothing
#: else running, and when (docs/benchmarks.md, "The test suite", has the command and the history).
SUITE_TIME_ON_TWO_IDLE_CPUS = ("12 min", "2026-12-07")


def pytest_report_header(config):
    """What to expect before a long run: the suite's time on 2 idle CPUs, and this machine's load,
    which stretches it (a run with another job busy on the CPUs took 40 min)."""
    minutes, day = SUITE_TIME_ON_TWO_IDLE_CPUS
    cpus = os.cpu_count() or 1
    quick = '-m "not slow" leaves out the Triton interpreter and the long training runs'
    lines = [f"qkmonitor: the whole suite takes about {minutes} on 2 idle CPUs ({day}); {quick}"]
    try:
        load = os.getloadavg()[0]
    except OSError:  # not every platform has a load average
        return lines
    busy = load >= 0.5 * cpus
    lines.append(
        f"qkmonitor: this machine: {cpus} CPUs, load {load:.1f} over the last minute"
        + (
            ": other work shares the CPUs, expect the suite to take several times longer"
            if busy
            else ""
        )
    )
    return lines

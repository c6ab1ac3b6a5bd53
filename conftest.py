"""Repository-wide pytest setup: run Triton kernels in the interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at the root,
before any test module or doctest is collected.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util

collect_ignore = []
try:
    import triton
except ImportError:  # without triton the doctest collector must not import the Triton backend
    collect_ignore.append("qkmonitor/kernels/_triton.py")
else:
    if not hasattr(triton, "knobs"):  # triton < 3.4 (CUDA torch < 2.8): the backend cannot import
        collect_ignore.append("qkmonitor/kernels/_triton.py")
if importlib.util.find_spec("transformers") is None:  # the Trainer callback imports it at the top
    collect_ignore.append("qkmonitor/hf_trainer.py")

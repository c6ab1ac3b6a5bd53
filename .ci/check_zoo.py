"""Fail loudly if the model-zoo installs replaced the CPU torch or broke what the tests import.

`--cpu-torch True` (what torch was before the zoo's installs): torch must still be a CPU build.
Prints the versions the zoo tests run against.
"""

import argparse
import sys
from importlib.metadata import version

parser = argparse.ArgumentParser()
parser.add_argument("--cpu-torch", choices=["True", "False"], required=True)
cpu_torch = parser.parse_args().cpu_torch == "True"

import torch

if cpu_torch and torch.version.cuda is not None:
    sys.exit(f"error: the model-zoo installs replaced the CPU torch with {torch.__version__}")
import lightning  # noqa: F401
import mlflow  # noqa: F401
import timm  # noqa: F401
import torchvision  # noqa: F401
import transformers  # noqa: F401
import wandb  # noqa: F401
import x_transformers  # noqa: F401
from litgpt.config import Config  # noqa: F401
from litgpt.model import GPT  # noqa: F401

names = (
    "torch",
    "transformers",
    "lightning",
    "pytest",
    "torchvision",
    "timm",
    "litgpt",
    "x-transformers",
    "mlflow-skinny",
    "wandb",
)
print("zoo:", "; ".join(f"{name} {version(name)}" for name in names))

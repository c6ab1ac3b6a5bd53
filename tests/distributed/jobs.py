"""The distributed tests run their jobs as scripts in a process of their own (Lightning's DDP
launcher, or :func:`two_ranks`), with none of the launcher variables of an outer run.

The ranks start with different string hash seeds (``PYTHONHASHSEED``, :data:`HASH_SEEDS`), as
``torchrun`` starts them (each process its own random seed): an order of collectives that follows
the iteration of a set of strings differs between such ranks and aborts the job (gloo: "Is there
a distributed collective mismatch"), here as in a user's run (issue 59). Rank 0 is the script's
process (:func:`run_script`); the other rank is started by :func:`two_ranks`, or by Lightning's
launcher after :func:`seed_other_ranks`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

LAUNCHER_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE")

#: ``PYTHONHASHSEED`` of rank 0 (the script's process) and of the other rank: two seeds under which
#: the set {"q_proj", "k_proj"} iterates in different orders
HASH_SEEDS = ("0", "3")


def run_script(script: Path, *args: object, timeout: int = 300) -> None:
    """Run ``python script args...`` with rank 0's hash seed; fail the test with the end of its
    stderr if it fails."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["PYTHONHASHSEED"] = HASH_SEEDS[0]
    result = subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def seed_other_ranks() -> None:
    """Give the ranks a launcher starts from this process the other rank's hash seed: Lightning's
    subprocess launcher copies ``os.environ`` when it starts them (call it before ``fit``)."""
    os.environ["PYTHONHASHSEED"] = HASH_SEEDS[1]


def two_ranks(run, out_dir: str, *args: object) -> None:
    """A job's two gloo ranks: rank 1 in a spawned process with its own hash seed, rank 0 in this
    one (one import of torch and qkmonitor fewer than ``mp.spawn``'s two children, which would
    share one seed); ``run(rank, world, out_dir, *args)``."""
    import multiprocessing as mp

    other = mp.get_context("spawn").Process(target=run, args=(1, 2, out_dir, *args))
    before = os.environ.get("PYTHONHASHSEED")
    seed_other_ranks()  # the spawned interpreter reads it at its start
    try:
        other.start()
    finally:
        if before is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = before
    try:
        run(0, 2, out_dir, *args)
    finally:
        other.join(timeout=120)
    if other.exitcode != 0:
        raise SystemExit(f"rank 1 failed (exit code {other.exitcode})")

"""The distributed tests run their jobs as scripts in a process of their own (Lightning's DDP
launcher, ``torch.multiprocessing.spawn``), with none of the launcher variables of an outer run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

LAUNCHER_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE")


def run_script(script: Path, *args: object, timeout: int = 300) -> None:
    """Run ``python script args...``; fail the test with the end of its stderr if it fails."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    result = subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def two_ranks(run, out_dir: str) -> None:
    """A job's two gloo ranks: rank 1 in a spawned process, rank 0 in this one (one import of
    torch and qkmonitor fewer than ``mp.spawn``'s two children); ``run(rank, world, out_dir)``."""
    import multiprocessing as mp

    other = mp.get_context("spawn").Process(target=run, args=(1, 2, out_dir))
    other.start()
    try:
        run(0, 2, out_dir)
    finally:
        other.join(timeout=120)
    if other.exitcode != 0:
        raise SystemExit(f"rank 1 failed (exit code {other.exitcode})")

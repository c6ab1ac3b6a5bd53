"""The README's quick start, as a new user runs it: a clean clone, then its two commands.

``./run train`` and ``./run test`` each set up the environment they need (a virtualenv with torch
first, then qkmonitor, then the test extras) and run the job; here in a fresh virtualenv of the
test's own, so that nothing installed before helps them. The clone is of the committed tree
(``git clone`` of this checkout), as CI's is.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def quick_start_commands() -> list[str]:
    """The commands of the README's quick-start block."""
    text = README.read_text()
    section = text[text.index("## Quick start") :]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def test_the_quick_start_is_two_commands_through_the_entry_point():
    assert quick_start_commands() == ["./run train", "./run test"]
    assert os.access(ROOT / "run", os.X_OK)
    ci = (ROOT / ".ci" / "run").read_text()
    assert "\n./run test\n" in ci, ".ci/run must run the README's test command"


def test_an_unknown_job_is_one_line_naming_the_jobs(tmp_path):
    done = subprocess.run(
        [str(ROOT / "run"), "deploy"],
        capture_output=True,
        check=False,
        text=True,
        env=os.environ | {"QKMONITOR_VENV": str(tmp_path / "venv")},
        timeout=30,
    )
    assert done.returncode == 2
    assert "unknown job 'deploy': expected train, test, qkmonitor or python" in done.stderr
    assert not (tmp_path / "venv").exists()  # refused before anything is installed


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_two_commands_set_up_and_run_from_a_clean_clone(tmp_path):
    """A fresh clone and a fresh virtualenv: `./run train` trains and prints its summary, then
    `./run test` installs the test extras into the same environment and runs pytest."""
    head = ["git", "-C", str(ROOT), "rev-parse", "HEAD"]
    if subprocess.run(head, capture_output=True, check=False).returncode:
        pytest.skip("not a git checkout")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTEST", "VIRTUAL_ENV", "PYTHONPATH"))
    }
    env |= {"QKMONITOR_VENV": str(tmp_path / "venv"), "QKMONITOR_PYTHON": sys.executable}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(sys.prefix)
    )

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["./run", *args],
            cwd=clone,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )

    train = run("train", "--steps", "20", "--log-dir", str(tmp_path / "runs"))
    assert train.returncode == 0, train.stderr[-3000:]
    assert "creating the environment" in train.stderr
    assert "qkmonitor summary after step 20" in train.stdout
    venv_python = tmp_path / "venv" / "bin" / "python"
    assert venv_python.exists()
    check = "import torch, qkmonitor; print(qkmonitor.__file__, torch.__version__)"
    where = subprocess.run(
        [str(venv_python), "-c", check], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout
    assert where.startswith(str(clone / "qkmonitor")), where  # the clone's package, editable
    if os.environ.get("CI") or "+cpu" in where:  # this project's machines: the CPU build stays
        assert "+cpu" in where, where

    tests = run("test", "-p", "no:cacheprovider", "-q", "-n", "0", "tests/docs/test_links.py")
    assert tests.returncode == 0, (tests.stdout + tests.stderr)[-3000:]
    assert re.search(r"\d+ passed", tests.stdout), tests.stdout[-2000:]
    assert "creating the environment" not in tests.stderr  # the environment is reused

    again = run("train", "--steps", "5", "--log-dir", str(tmp_path / "runs"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "installing" not in again.stderr  # nothing installed twice

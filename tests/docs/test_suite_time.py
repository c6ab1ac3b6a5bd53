"""What a run of the suite says to expect: the header every run prints (the root ``conftest.py``)
gives the time that docs/benchmarks.md measured and the README repeats, and this machine's load."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def suite_time() -> str:
    text = (ROOT / "conftest.py").read_text()
    return re.search(r'SUITE_TIME_ON_TWO_IDLE_CPUS = \("([^"]+)"', text).group(1)


def test_the_readme_and_benchmarks_give_the_headers_figure():
    minutes = suite_time()  # e.g. "12 min"
    readme = (ROOT / "README.md").read_text()
    assert f"./run test    # the whole test suite, as CI runs it: about {minutes}" in readme
    measured = re.search(
        r"## The test suite\n\n(.+?)`time ./run test`.+?\*\*(\d+) min (\d+) s\*\*",
        (ROOT / "docs" / "benchmarks.md").read_text(),
        re.DOTALL,
    )
    whole, seconds = int(measured.group(2)), int(measured.group(3))
    assert minutes == f"{whole + (seconds >= 30)} min"  # the measured figure, rounded


def test_a_run_says_how_long_to_expect_and_how_busy_the_machine_is():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-n", "0", "-p", "no:cacheprovider",
         "tests/docs/test_links.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    header = result.stdout.split("collected")[0]
    assert f"the whole suite takes about {suite_time()} on 2 idle CPUs" in header
    assert re.search(r"this machine: \d+ CPUs, load \d+\.\d over the last minute", header)

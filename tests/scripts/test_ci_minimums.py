"""``.ci/minimums`` tests what pyproject.toml claims: torch at its declared floor, not a torch the
CI machine happens to hold, and every other dependency at its lower bound
(``.ci/minimum_pins.py``). The run itself asserts that the torch it installed is that floor; this
checks, without installing anything, that the script asks for it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def declared_floor(name: str) -> str:
    """The one lower bound pyproject.toml declares for ``name`` (``"name>=X"``, in any list)."""
    text = (ROOT / "pyproject.toml").read_text()
    (floor,) = set(re.findall(rf'"{name}(?:\[[^\]]*\])?\s*>=\s*([0-9][0-9.]*)', text))
    return floor


def test_the_minimum_pins_are_pyprojects_floors_torch_included():
    pins = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "minimum_pins.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in ("torch", "triton", "numpy", "lightning"):
        assert f"{name}=={declared_floor(name)}" in pins, name


def test_ci_minimums_installs_the_torch_floor_and_no_other_torch():
    script = (ROOT / ".ci" / "minimums").read_text()
    code = "\n".join(line.split("#")[0] for line in script.splitlines())
    assert "minimum_pins.py --torch" not in code  # the floor, not a release on this machine's disk
    assert 'torch_floor="$(pin torch)"' in code
    assert '"torch==$torch_floor"' in code
    assert re.search(r"installed\.release\[.*\] == floor\.release", code)  # checked once installed
    assert not re.search(r"torch==\d", code)  # no release written into the script

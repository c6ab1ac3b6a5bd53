"""The wheel a release ships: built from the repository, installed (not editable) in a fresh
virtualenv, it carries the license and the ``py.typed`` marker and runs the quick start's two
commands, ``qkmonitor train`` and ``qkmonitor report``, reading nothing that only the repository
has.

The fresh environment holds the wheel alone; its dependencies (torch, Lightning, ...) are those of
the running interpreter, seen through a ``.pth`` line, so nothing is downloaded. qkmonitor itself
is not visible there from the repository: the commands run from an empty folder, and the running
environment's editable install is not a site directory of the new one (its finder never loads)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _run(args: list, cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, check=False,
        timeout=600, **kwargs,
    )  # fmt: skip


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", out, ROOT],
        cwd=out,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (path,) = out.glob("qkmonitor-*.whl")
    return path


def test_the_wheel_carries_the_license_and_the_typed_marker(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "qkmonitor/py.typed" in names
    licenses = [n for n in names if n.endswith("LICENSE") and ".dist-info/" in n]
    assert licenses, names
    text = zipfile.ZipFile(wheel).read(licenses[0]).decode()
    assert text == (ROOT / "LICENSE").read_text() and "Apache License" in text
    assert "Version 2.0, January 2004" in text
    metadata = (
        zipfile.ZipFile(wheel)
        .read(next(n for n in names if n.endswith(".dist-info/METADATA")))
        .decode()
    )
    assert "License-Expression: Apache-2.0" in metadata
    assert not [n for n in names if n.split("/")[0] in ("tests", "benchmarks", "docs", "scripts")]


def test_the_installed_wheel_trains_and_reports_from_an_empty_folder(wheel, tmp_path):
    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    target = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                  cwd=tmp_path).stdout.strip()  # fmt: skip
    # the running environment's packages (torch, Lightning, ...), not its editable qkmonitor
    (Path(target) / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    installed = _run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q", wheel],
        cwd=tmp_path,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    work = tmp_path / "empty"
    work.mkdir()
    where = _run([python, "-c", "import qkmonitor; print(qkmonitor.__file__)"], cwd=work)
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr
    cli = venv / "bin" / "qkmonitor"
    trained = _run([cli, "train", "--steps", "20", "--every-n-steps", "10", "--log-dir", "runs",
                    "--no-progress-bar", "--threads", "1"], cwd=work)  # fmt: skip
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-3000:]
    reported = _run([cli, "report", "runs", "--no-plots"], cwd=work)
    assert reported.returncode == 0, reported.stderr[-3000:]
    assert "kappa" in reported.stdout and "layer" in reported.stdout, reported.stdout[:2000]

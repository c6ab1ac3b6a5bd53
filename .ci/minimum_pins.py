"""Print pip constraints that pin every dependency in pyproject.toml to its declared lower bound.

Reads ``[project] dependencies`` and every ``[project.optional-dependencies]`` extra; each must
declare ``name>=version`` (a dependency without a lower bound is an error: the bound would be
whatever pip happens to pick). ``qkmonitor[...]`` self-references are skipped. ``--torch VERSION``
replaces torch's pin (to try another torch with every other dependency at its minimum, as
docs/requirements.md's figures for torch 2.8 were taken); ``.ci/minimums`` uses the floor itself.

Usage: ``python3 .ci/minimum_pins.py [--torch 2.8.0] > constraints.txt``
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import tomllib

# name, optional [extras], ">=" lower bound; anything after a comma or ";" (upper bounds, markers)
# does not change the minimum
LOWER_BOUND = re.compile(
    r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*>=\s*([0-9][A-Za-z0-9.+!-]*)"
)
NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def minimum_pins(pyproject: dict, torch: str | None = None) -> dict[str, str]:
    """``{normalised name: version}`` of every declared dependency's lower bound."""
    project = pyproject["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements.extend(extra)
    pins: dict[str, str] = {}
    for requirement in requirements:
        name = NAME.match(requirement).group(1).lower().replace("_", "-")
        if name == project["name"]:
            continue  # an extra that pulls in other extras
        bound = LOWER_BOUND.match(requirement)
        if bound is None:
            raise ValueError(
                f"pyproject.toml: {requirement!r} declares no lower bound (`name>=version`)"
            )
        version = bound.group(3)
        if pins.get(name, version) != version:
            raise ValueError(
                f"pyproject.toml: {name} has two lower bounds, {pins[name]} and {version}"
            )
        pins[name] = version
    if torch is not None:
        pins["torch"] = torch
    return pins


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", help="pin torch to this version instead of its lower bound")
    parser.add_argument(
        "--pyproject", type=Path, default=Path(__file__).resolve().parents[1] / "pyproject.toml"
    )
    args = parser.parse_args(argv)
    pins = minimum_pins(tomllib.loads(args.pyproject.read_text()), torch=args.torch)
    sys.stdout.write("".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

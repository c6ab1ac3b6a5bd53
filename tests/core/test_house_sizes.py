"""The package's owners stay small (issue 43): no module over 500 lines and no function over 60,
outside the Triton kernels (``qkmonitor/kernels/_triton``: a kernel's signature alone is ~50
lines of pointers, strides and constexprs).

A function's lines run from its ``def`` to its last line, docstring included; a nested function
counts inside its parent too."""

from __future__ import annotations

import ast
from pathlib import Path

import qkmonitor

PACKAGE = Path(qkmonitor.__file__).parent
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def package_modules() -> list[Path]:
    return [
        path
        for path in sorted(PACKAGE.rglob("*.py"))
        if "_triton" not in path.relative_to(PACKAGE).parts
    ]


def long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """``(name, lines)`` of each function or method in ``source`` longer than ``limit`` lines."""
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_the_check_sees_the_modules_and_measures_a_function():
    """It reads the package (not an empty list) and counts a known length right."""
    modules = package_modules()
    assert PACKAGE / "engine" / "base.py" in modules
    assert not any("_triton" in p.parts for p in modules)
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))  # def + 60 lines
    assert long_functions(f"def f():\n{body}\n", MAX_FUNCTION_LINES) == [
        ("f", MAX_FUNCTION_LINES + 1)
    ]
    assert long_functions(f"def f():\n{body}\n", MAX_FUNCTION_LINES + 1) == []


def test_no_module_over_500_lines():
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in package_modules()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_over_60_lines():
    long = {
        str(p.relative_to(PACKAGE)): found
        for p in package_modules()
        if (found := long_functions(p.read_text(), MAX_FUNCTION_LINES))
    }
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"

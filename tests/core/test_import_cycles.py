"""No circles (issue 62): no two modules of qkmonitor import each other, directly or through a chain
of imports.

The graph is read from the source with :mod:`ast`, nothing imported. Every import statement is an
edge: at module level, under ``if TYPE_CHECKING:`` (a type named in a signature is a dependency
too: a reader of the one module needs the other), and inside a function (a lazy import runs later,
and it runs: the two modules still need each other, the cycle only waits for its first call) —
the rule ``lint-imports`` holds for the layers (docs/architecture.md, "Layers").

An edge goes to the module an import names: ``import a.b`` and ``from a import b`` where ``b`` is
a submodule -> ``a.b``; ``from a.b import name`` -> ``a.b`` (the package's ``__init__`` where
``a.b`` is a package); relative imports resolved from the importing module's package. The parent
packages that Python runs first are not edges: ``import qkmonitor.x`` runs
``qkmonitor/__init__.py``, which imports the adapter families, and counting that would put every
module in one circle with the front door. Imports by a name computed at run time
(``importlib.import_module``, :mod:`qkmonitor.lazy`'s exports) are not seen; the front door's lazy
names are imported under ``TYPE_CHECKING`` beside their table, so their edges are here too.

A circle is a strongly connected component of more than one module. The check is one test per
subpackage (a circle inside ``qkmonitor.<subpackage>``) and one for circles across them, each
failing with the circle's modules and the import lines that close it."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import qkmonitor

PACKAGE = Path(qkmonitor.__file__).parent
ACROSS = "across subpackages"

#: an import: the module it names, its line, where it sits ("module level", "TYPE_CHECKING",
#: "in f()")
Edge = tuple[str, int, str]


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package under ``root`` (the package's folder) -> its file."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of the dotted ``name`` that is a module of the package, or None."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or None


def _targets(node: ast.Import | ast.ImportFrom, module: str, path: Path, modules) -> Iterator[str]:
    """The package's modules one import statement of ``module`` (in ``path``) names."""
    if isinstance(node, ast.Import):
        yield from filter(None, (_known(alias.name, modules) for alias in node.names))
        return
    base = node.module or ""
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, *([node.module] if node.module else [])])
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        target = submodule if submodule in modules else _known(base, modules)
        if target is not None:
            yield target


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST, where: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement under ``node``, with where it sits."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, where
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _imports(child, f"in {child.name}()")
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            checking = "TYPE_CHECKING" if where == "module level" else where
            yield from _imports(ast.Module(body=child.body, type_ignores=[]), checking)
            yield from _imports(ast.Module(body=child.orelse, type_ignores=[]), where)
        else:
            yield from _imports(child, where)


def import_graph(root: Path, package: str) -> dict[str, list[Edge]]:
    """Each module of the package -> the imports of the package's modules it makes."""
    modules = module_names(root, package)
    graph: dict[str, list[Edge]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, [])
        for node, where in _imports(ast.parse(path.read_text(), str(path)), "module level"):
            for target in _targets(node, module, path, modules):
                if target != module and (target, node.lineno, where) not in edges:
                    edges.append((target, node.lineno, where))
    return graph


def cycles(graph: dict[str, list[Edge]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target, _, _ in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def area(component: list[str]) -> str:
    """The subpackage of ``qkmonitor`` a circle lies in, or :data:`ACROSS`."""
    folders = {".".join(name.split(".")[:2]) for name in component}
    if len(folders) == 1 and (folder := folders.pop()) in SUBPACKAGES:
        return folder
    return ACROSS


def describe(component: list[str], graph: dict[str, list[Edge]]) -> str:
    """A circle's modules and the imports between them, each with its line and where it sits."""
    lines = [" <-> ".join(component)]
    for module in component:
        for target, line, where in graph[module]:
            if target in component:
                lines.append(f"    {module}:{line} imports {target} ({where})")
    return "\n".join(lines)


SUBPACKAGES = sorted(f"qkmonitor.{path.parent.name}" for path in PACKAGE.glob("*/__init__.py"))


@pytest.mark.parametrize("where", [*SUBPACKAGES, ACROSS])
def test_no_import_cycle(where):
    """No circle of imports among qkmonitor's modules, ``TYPE_CHECKING`` and function-local
    imports included; each failure names the circle's modules and the lines that close it."""
    graph = import_graph(PACKAGE, "qkmonitor")
    circles = [describe(c, graph) for c in cycles(graph) if area(c) == where]
    assert not circles, "import cycles:\n" + "\n".join(circles)


def test_the_check_reads_the_package():
    """It reads every module, resolves a relative import and a ``from package import submodule``,
    and sees no edge to a module that does not exist."""
    graph = import_graph(PACKAGE, "qkmonitor")
    assert len(graph) == len(list(PACKAGE.rglob("*.py")))
    assert "qkmonitor.callbacks.base" in {t for t, _, _ in graph["qkmonitor.callbacks.qk_clip"]}
    assert "qkmonitor.private_apis" in {t for t, _, _ in graph["qkmonitor.attention.compiled"]}
    assert all(t in graph for edges in graph.values() for t, _, _ in edges)
    assert {"qkmonitor.attention", "qkmonitor.engine", ACROSS} <= {*SUBPACKAGES, ACROSS}


def test_the_check_finds_each_kind_of_circle(tmp_path):
    """A circle closed at module level, one closed under ``TYPE_CHECKING`` by a relative import,
    one closed inside a function: each found, with where it is closed (the ``else`` of a
    ``TYPE_CHECKING`` block at module level); a package that imports its own submodules, and a
    name imported from a package that does not import back, are none."""
    files = {
        "__init__.py": "from pkg import a\nNAME = 1\n",
        "a.py": "from pkg import b\n",
        "b.py": "import typing\nif typing.TYPE_CHECKING:\n    from .a import X\n"
        "else:\n    import pkg.sub\n",
        "c.py": "def f():\n    import pkg.sub.d\n",
        "sub/__init__.py": "",
        "sub/d.py": "from ..c import f\nfrom pkg import NAME\n",
        "e.py": "import pkg.a\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, "pkg")
    assert cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.sub.d"]]
    assert graph["pkg.b"] == [("pkg.a", 3, "TYPE_CHECKING"), ("pkg.sub", 5, "module level")]
    assert ("pkg.sub.d", 2, "in f()") in graph["pkg.c"]
    assert ("pkg", 2, "module level") in graph["pkg.sub.d"]

"""The package's import graph: no module imports itself round a cycle, and `core/` imports
nothing from the other layers.

Read from the source (AST), never by importing. An import counts when it runs as its module is
imported: at module level, outside `if TYPE_CHECKING:` and outside functions, which import when
called. `from a.b import c` names the module a.b.c when there is one, else a.b; the packages
above a module are not edges (Python runs them first, whoever imports the module)."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

import quota_service

PACKAGE_ROOT = Path(quota_service.__file__).parent


def module_files(root: Path) -> dict[str, Path]:
    """Every module of the package at `root`, by dotted name (a package by its own)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports_at_import_time(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    for statement in body:
        if isinstance(statement, ast.Import | ast.ImportFrom):
            yield statement
        elif isinstance(statement, ast.If):
            if not _is_type_checking(statement.test):
                yield from _imports_at_import_time(statement.body)
            yield from _imports_at_import_time(statement.orelse)
        elif isinstance(statement, ast.Try):
            for block in (statement.body, statement.orelse, statement.finalbody):
                yield from _imports_at_import_time(block)
            for handler in statement.handlers:
                yield from _imports_at_import_time(handler.body)
        elif isinstance(statement, ast.With | ast.ClassDef):
            yield from _imports_at_import_time(statement.body)


def imported_modules(
    name: str, path: Path, modules: dict[str, Path], nodes: Iterable[ast.AST]
) -> set[str]:
    """The package's modules that these import statements of module `name` name."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, or a package above it
                base = f"{package.rsplit('.', node.level - 1)[0]}.{base}".rstrip(".")
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return found & modules.keys()


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module of the package at `root` and the modules of it that it imports at import
    time."""
    modules = module_files(root)
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = imported_modules(name, path, modules, _imports_at_import_time(tree.body))
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module, or a module importing
    itself (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1 or module in graph[module]:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_the_package_has_no_import_cycle() -> None:
    assert import_cycles(import_graph(PACKAGE_ROOT)) == []


def test_core_imports_nothing_from_the_other_layers() -> None:
    """Every import in core/, in functions and under TYPE_CHECKING too."""
    modules = module_files(PACKAGE_ROOT)
    for name, path in modules.items():
        if not name.startswith("quota_service.core"):
            continue
        tree = ast.parse(path.read_text(), str(path))
        imported = imported_modules(name, path, modules, ast.walk(tree))
        outside = {m for m in imported if not m.startswith("quota_service.core")}
        assert not outside, f"{name} imports {sorted(outside)}"


def test_a_planted_cycle_is_found(tmp_path: Path) -> None:
    root = tmp_path / "planted"
    (root / "inner").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "inner" / "__init__.py").write_text("")
    (root / "a.py").write_text("from planted.inner import b\n")
    (root / "inner" / "b.py").write_text("from .. import c\n")
    (root / "c.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import planted.a\n"
        "if TYPE_CHECKING:\n"
        "    from planted import d\n"
        "def later() -> None:\n"
        "    from planted import d\n"
    )
    # d imports c back only under TYPE_CHECKING and in c's function: no cycle through d.
    (root / "d.py").write_text("import planted.c\n")
    (root / "e.py").write_text("import planted.e\n")
    graph = import_graph(root)
    assert graph["planted.inner.b"] == {"planted.c"}
    assert graph["planted.c"] == {"planted.a"}
    assert import_cycles(graph) == [
        ["planted.a", "planted.c", "planted.inner.b"],
        ["planted.e"],
    ]

"""The core's modules import one another without cycles (at module level, and no module of the
core defers an import of another to call time to hide one)."""

from __future__ import annotations

import ast
from pathlib import Path

import unshardfs

SRC = Path(unshardfs.__file__).parent


def imports(path: Path, module: str) -> tuple[set[str], set[str]]:
    """(modules of unshardfs imported at module level, ... inside functions)."""
    package = module.rsplit(".", 1)[0]
    top: set[str] = set()
    lazy: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.split(".")[:len(package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        if not target.startswith("unshardfs"):
            continue
        found = (top if node in tree.body else lazy)
        found.add(target)
        found.update(f"{target}.{alias.name}" for alias in node.names)
    return top, lazy


def test_no_import_cycles_in_the_core():
    modules = {f"unshardfs.core.{p.stem}": p for p in (SRC / "core").glob("*.py") if p.stem != "__init__"}
    graph = {}
    for name, path in modules.items():
        top, lazy = imports(path, name)
        assert not {m for m in lazy if m in modules}, f"{name} imports core modules at call time: {lazy}"
        graph[name] = {m for m in top if m in modules and m != name}

    def visit(name: str, trail: tuple[str, ...]) -> None:
        assert name not in trail, "import cycle: " + " -> ".join(trail[trail.index(name):] + (name,))
        for dep in graph[name]:
            visit(dep, trail + (name,))

    for name in graph:
        visit(name, ())


def _defined(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level (definitions, assignments, imports), also inside its
    top-level `if` and `try` blocks, never inside a function's or a class's body."""
    names: set[str] = set()
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        else:
            todo.extend(ast.iter_child_nodes(node))
    return names


def test_every_module_exports_every_name_it_lists():
    """`from M import *` works for every module M of the package: each name in its `__all__` is
    bound there (a rename once left a stale string behind, in the public API and in a source).
    Read from the source, not imported: importing every module would load what a test process
    must not (a FUSE binding)."""
    stale = {}
    checked = 0
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                    for t in node.targets):
                listed = ast.literal_eval(node.value)
                checked += 1
                missing = [n for n in listed if n not in _defined(tree)]
                if missing:
                    stale[str(path.relative_to(SRC))] = missing
    assert checked >= 2 and stale == {}


def test_the_public_api_exports_every_name_it_lists():
    """`from unshardfs.abc import *` works: each name in `__all__` is there."""
    import unshardfs.abc as api

    assert [name for name in api.__all__ if not hasattr(api, name)] == []

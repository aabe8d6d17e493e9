"""Tensor-parallel orchestration sits above the engine: ``engine/engine.py`` imports nothing of
``engine/parallel`` (the worker imports the engine; ``engine/build.py`` starts the ranks), and the
package's import graph, drawn from the source (imports under ``TYPE_CHECKING`` aside), has no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import portattn

ROOT = Path(portattn.__file__).resolve().parent


def module_files() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def imports(name: str, path: Path, package: bool, modules) -> set[str]:
    """The modules of the package that ``name`` imports (at any depth of its code)."""
    here = name if package else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    skipped = {
        id(node)
        for guard in ast.walk(tree)
        if isinstance(guard, ast.If) and "TYPE_CHECKING" in ast.unparse(guard.test)
        for node in ast.walk(guard)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = here.split(".")[: len(here.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            subs = {f"{module}.{alias.name}" for alias in node.names} & set(modules)
            found |= subs or {module}
    return (found & set(modules)) - {name}


def test_the_engine_does_not_import_the_orchestration():
    modules = module_files()
    engine = imports("portattn.engine.engine", *modules["portattn.engine.engine"], modules)
    assert not {m for m in engine if m.startswith("portattn.engine.parallel")}
    assert "portattn.engine.engine" in imports(
        "portattn.engine.parallel.worker", *modules["portattn.engine.parallel.worker"], modules
    )


def test_no_import_cycle():
    modules = module_files()
    graph = {name: imports(name, *where, modules) for name, where in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(dep) :], dep]))
            if dep not in state:
                visit(dep, [*path, dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])

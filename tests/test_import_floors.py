"""The import floors of docs/design.md §9, drawn from the source: no module imports a floor above its
own, and neither the modules nor the top-level packages import in a cycle.

The graph counts every import a module's code can run: at the top, inside functions (lazy imports) and
in ``__getattr__``; imports under ``if TYPE_CHECKING:`` only are left out (annotations, never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import portattn

ROOT = Path(portattn.__file__).resolve().parent

# Lowest first: a module may import its own floor and the floors below it. A module's floor is that of
# the longest name here that is it or a package above it.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    # Under everything: the error helpers, the one module that asks the device, logging, the extras,
    # the fp8 cache dtypes, the weight quantizations offered, the version, and the tensor-parallel group the
    # layers are built for.
    ("base", ("errors", "device", "logs", "extras", "kv_quant", "quantization", "_version", "distributed")),
    ("kernels", ("kernels",)),
    # The op library: backends and the ops side by side.
    ("ops", ("backends", "ops", "mla", "cascade", "local_attention", "masks", "paging", "validation", "encoder")),
    ("runtime", ("runtime",)),
    ("models", ("models",)),
    ("engine", ("engine",)),
    # Orchestration above the engine (engine/engine.py imports none of it): the ranks, build_engine, the
    # offline LLM over it, `portattn generate`, and the engine package whose __getattr__ hands out LLM.
    ("orchestration", ("engine.parallel", "engine.build", "engine.llm", "engine.cli", "engine.__init__")),
    ("server", ("server",)),
    # Tools over every floor: the public API's package, the command line, the demo, `portattn check`,
    # the benchmarks and the test kit (references, fixtures, tiny checkpoints of every family).
    ("tools", ("__init__", "cli", "demo", "check", "bench", "testing")),
]
LEVEL = {name: i for i, (name, _) in enumerate(FLOORS)}


def module_files() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


MODULES = module_files()


def imports(name: str) -> set[str]:
    """The modules of the package that ``name`` imports, at any depth of its code."""
    path, package = MODULES[name]
    here = name if package else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    skipped = {  # the body of `if TYPE_CHECKING:` (its else branch runs)
        id(node)
        for guard in ast.walk(tree)
        if isinstance(guard, ast.If) and "TYPE_CHECKING" in ast.unparse(guard.test)
        for stmt in guard.body
        for node in ast.walk(stmt)
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
            subs = {f"{module}.{alias.name}" for alias in node.names} & set(MODULES)
            found |= subs or {module}
    return (found & set(MODULES)) - {name}


GRAPH = {name: imports(name) for name in MODULES}


def floor(module: str) -> str:
    """The floor of ``module``; a package's own ``__init__`` is ``package.__init__`` in FLOORS (the
    root package's is ``__init__``)."""
    rel = module.removeprefix("portattn").lstrip(".")
    if MODULES[module][1]:
        rel = f"{rel}.__init__".lstrip(".")
    matches = [(len(p), name) for name, prefixes in FLOORS for p in prefixes if rel == p or rel.startswith(p + ".")]
    assert matches, f"{module} has no floor in FLOORS: add it (and to docs/design.md §9)"
    return max(matches)[1]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep, [*path, dep])):
                return cycle
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [node])):
            return cycle
    return None


def test_every_module_has_a_floor():
    assert {floor(m) for m in MODULES} <= set(LEVEL)


def test_no_import_above_a_floor():
    up = sorted(
        f"{m} ({floor(m)}) -> {d} ({floor(d)})"
        for m, deps in GRAPH.items()
        for d in deps
        if LEVEL[floor(d)] > LEVEL[floor(m)]
    )
    assert not up, "imports above their floor:\n" + "\n".join(up)


def test_the_engine_does_not_import_the_orchestration():
    assert floor("portattn.engine.engine") == "engine" and floor("portattn.engine.parallel.worker") == "orchestration"
    assert "portattn.engine.engine" in GRAPH["portattn.engine.parallel.worker"]


def test_no_import_cycle_between_modules():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_between_top_level_packages():
    def unit(module: str) -> str:
        return ".".join(module.split(".")[:2])

    units: dict[str, set[str]] = {}
    for m, deps in GRAPH.items():
        units.setdefault(unit(m), set()).update(unit(d) for d in deps if unit(d) != unit(m))
    cycle = find_cycle(units)
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle)


def test_the_graph_sees_lazy_imports_and_skips_type_checking():
    """What the rules rely on: imports inside functions count, ``TYPE_CHECKING`` ones do not."""
    assert "portattn.engine.llm" in GRAPH["portattn.engine"]  # inside __getattr__
    assert "portattn.models" in GRAPH["portattn.testing.checkpoints"]  # inside a function
    assert "portattn.encoder" not in GRAPH["portattn.models.base"]  # under TYPE_CHECKING only

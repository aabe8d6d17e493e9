"""Module-level values read inside ``@triton.jit`` functions are ``tl.constexpr``.

Triton's compiler refuses any other global ("Cannot access global variable ... from within @jit'ed
function"), while its interpreter, which runs the CPU suite, reads it like Python: a kernel that
passes every CPU test can fail to compile on a GPU. This reads the sources instead of running them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import portattn

KERNELS = Path(portattn.__file__).parent / "kernels" / "triton"


def _is_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "jit"


def _is_constexpr(value: ast.expr | None) -> bool:
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "constexpr"


def plain_globals(tree: ast.Module) -> set[str]:
    """The module-level names of ``tree`` assigned anything but a ``constexpr``."""
    plain = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        plain |= {t.id for t in targets if isinstance(t, ast.Name) and not _is_constexpr(node.value)}
    return plain


def plain_globals_read_in_kernels(source: str, siblings: dict[str, set[str]] | None = None) -> list[tuple[str, str]]:
    """``(function, name)`` for each module-level value that is not a ``constexpr`` and is read inside a
    jitted function of ``source``: its own, and those it imports from ``siblings`` (module name -> its
    plain globals, for ``from .module import NAME``)."""
    tree = ast.parse(source)
    plain = plain_globals(tree)
    siblings = siblings or {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module in siblings:
            plain |= {a.asname or a.name for a in node.names if a.name in siblings[node.module]}
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list):
            local = {a.arg for a in node.args.args + node.args.kwonlyargs}
            local |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            for n in ast.walk(node):
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in plain - local:
                    found.append((node.name, n.id))
    return found


def test_kernels_read_only_constexpr_globals():
    files = sorted(KERNELS.glob("*.py"))
    assert len(files) > 10
    siblings = {f.stem: plain_globals(ast.parse(f.read_text())) for f in files}
    found = {f.name: hits for f in files if (hits := plain_globals_read_in_kernels(f.read_text(), siblings))}
    assert not found, f"expected only tl.constexpr globals inside @triton.jit functions, got {found}"


def test_the_check_finds_a_plain_global():
    source = (
        "import triton\nimport triton.language as tl\nLIMIT = 7\nOK = tl.constexpr(3)\n"
        "@triton.jit\ndef k(X):\n    tl.store(X, LIMIT + OK)\n"
    )
    assert plain_globals_read_in_kernels(source) == [("k", "LIMIT")]
    imported = "import triton\nfrom .consts import SIZE\n@triton.jit\ndef k(X):\n    X += SIZE\n"
    assert plain_globals_read_in_kernels(imported, {"consts": {"SIZE"}}) == [("k", "SIZE")]
    assert plain_globals_read_in_kernels(imported, {"consts": set()}) == []

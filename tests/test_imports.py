"""The package's modules import on their own, and no chain of import-time imports comes back to
where it started (a cycle works or breaks depending on which module a program imports first)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mlx_dsv41"


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__.py)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def test_each_module_imports_alone():
    """Each module imported first, into an interpreter holding no module of the package (one
    interpreter, the package's modules dropped from sys.modules before each). `__main__` modules
    run their command line when imported: they are only looked up."""
    code = (
        "import importlib, importlib.util, sys, traceback\n"
        "failed = []\n"
        "for name in sys.argv[1:]:\n"
        "    for loaded in [m for m in sys.modules if m == 'mlx_dsv41' or m.startswith('mlx_dsv41.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        if name.endswith('.__main__'):\n"
        "            assert importlib.util.find_spec(name) is not None\n"
        "        else:\n"
        "            importlib.import_module(name)\n"
        "    except Exception:\n"
        "        failed.append(name + ': ' + traceback.format_exc(limit=-3))\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, *MODULES], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


def _import_time_imports(tree: ast.Module) -> list[ast.stmt]:
    """The import statements that run when the module is imported: module level, in class bodies
    and in if / try / with blocks, not in functions nor under `if TYPE_CHECKING`."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
        elif isinstance(node, (ast.ClassDef, ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo += getattr(node, field, [])
        elif isinstance(node, ast.ExceptHandler):
            todo += node.body
    return found


def _targets(module: str, node: ast.stmt) -> set[str]:
    """The package modules an import statement runs: the module named (or, for `from X import Y`,
    X.Y when Y is a module) and the packages above it, except those above `module` itself (Python
    has run them before `module` starts)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        is_package = MODULES.get(module, Path()).name == "__init__.py"
        base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)] if node.level else []
        prefix = ".".join([*base, *([node.module] if node.module else [])])
        names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in MODULES else prefix for a in node.names]
    own_parents = {".".join(module.split(".")[:i]) for i in range(1, len(module.split(".")))}
    targets = set()
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            candidate = ".".join(parts[:i])
            if candidate in MODULES and candidate not in own_parents and candidate != module:
                targets.add(candidate)
    return targets


def _import_graph() -> dict[str, set[str]]:
    return {
        name: set().union(*(_targets(name, n) for n in _import_time_imports(ast.parse(path.read_text()))))
        for name, path in MODULES.items()
    }


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_cycles():
    cycle = _cycle(_import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_sees_a_cycle_through_a_package_init():
    """What the graph is for: `a.x` importing `b.y` runs b's __init__, which imports `b.z`, which
    imports `a.x` -- the shape of the old kernels.exl3 <-> exl3.experts cycle."""
    graph = {"a.x": {"b", "b.y"}, "b": {"b.z"}, "b.y": set(), "b.z": {"a.x"}}
    assert _cycle(graph) == ["a.x", "b", "b.z", "a.x"]
    assert _cycle({"a.x": {"b.y"}, "b.y": set()}) is None


def test_exl3_launches_do_not_import_the_format_package():
    """mlx_dsv41.kernels only builds and launches kernels: nothing of it imports mlx_dsv41.exl3 at
    import time (the format package chooses and calls the launches)."""
    graph = _import_graph()
    for name in MODULES:
        if name.startswith("mlx_dsv41.kernels"):
            assert not {t for t in graph[name] if t.startswith("mlx_dsv41.exl3")}, name

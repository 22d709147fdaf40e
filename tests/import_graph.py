"""Which module imports which, read from the source (ast, nothing imported),
and the rules of the house kvloom/__init__.py describes: the ground package
imports no daemon and no upper floor, a daemon imports neither the other
daemon nor an upper floor, nothing a daemon imports imports a daemon, and
no modules import each other, directly or round a longer loop.

Every import statement counts wherever it stands (inside a function, under
TYPE_CHECKING): a lazy import is still a dependency, and a loop of them is
still a loop.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

GROUND = ("kvloom",)
DAEMONS = ("controlplane", "workerd")
UPPER = ("kvloom_cli", "kvloom_testing")
# Everything whose imports are read: the packages, and what stands on them.
TREES = (*GROUND, *DAEMONS, *UPPER, "benchmarks", "scripts", "tests")

Graph = dict[str, set[str]]


def module_files(root: Path, trees: Iterable[str] = TREES) -> dict[str, Path]:
    """Module name -> file, for every .py under each tree (generated
    protobuf modules left out: they import only protobuf and each other)."""
    out: dict[str, Path] = {}
    for tree in trees:
        for path in sorted((root / tree).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _known(name: str, modules: Mapping[str, Path]) -> str | None:
    """The module of `name` itself, or of the nearest enclosing package."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _targets(node: ast.AST, module: str, is_package: bool,
             modules: Mapping[str, Path]) -> Iterable[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            if (hit := _known(alias.name, modules)) is not None:
                yield hit
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".")[: None if is_package else -1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join([*base, *([node.module] if node.module else [])])
        else:
            source = node.module or ""
        for alias in node.names:
            # `from pkg import mod` imports mod; `from mod import name`, mod.
            name = f"{source}.{alias.name}"
            hit = name if name in modules else _known(source, modules)
            if hit is not None:
                yield hit


def import_graph(root: Path, trees: Iterable[str] = TREES) -> Graph:
    """Module -> the modules of these trees it imports (itself left out)."""
    modules = module_files(root, trees)
    graph: Graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        found = {t for node in ast.walk(tree) for t in _targets(node, module, is_package, modules)}
        found.discard(module)
        graph[module] = found
    return graph


def top(module: str) -> str:
    return module.split(".", 1)[0]


def floor_violations(graph: Graph) -> list[str]:
    """Imports that run up the house or between the daemons."""
    bad = []
    for module, imports in sorted(graph.items()):
        here = top(module)
        for target in sorted(imports):
            there = top(target)
            if here in GROUND and there in (*DAEMONS, *UPPER):
                bad.append(f"{module} (ground) imports {target}")
            elif here in DAEMONS and there != here and there in (*DAEMONS, *UPPER):
                bad.append(f"{module} (daemon) imports {target}")
    return bad


def daemon_reach_violations(graph: Graph) -> list[str]:
    """The issue's rule as stated: of everything a daemon imports, directly
    or not, outside the daemon itself, nothing imports a daemon."""
    bad = []
    for daemon in DAEMONS:
        seen: set[str] = set()
        todo = [m for m in graph if top(m) == daemon]
        while todo:
            module = todo.pop()
            for target in graph.get(module, ()):
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        for module in sorted(m for m in seen if top(m) != daemon):
            for target in sorted(graph.get(module, ())):
                if top(target) in DAEMONS:
                    bad.append(f"{module} (imported by {daemon}) imports {target}")
    return bad


def import_cycles(graph: Graph) -> list[list[str]]:
    """Every group of modules that import each other, round a loop of any
    length (the strongly connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(root: str) -> None:  # Tarjan's, iterative: no recursion limit
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    cycles.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(cycles)

"""Benchmarks stand on the public surface: they import no test module (tests may
import benchmarks, so the other way would be a circle) and reach no private
name of kvloom's packages (a benchmark that calls `runner._prepare_inputs`
breaks silently when the runner changes). A private name a benchmark defines
itself (its own helpers and classes) is fine."""

from __future__ import annotations

import ast
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _modules() -> dict[str, ast.Module]:
    return {p.name: ast.parse(p.read_text(), str(p)) for p in sorted(BENCHMARKS.glob("*.py"))}


def _defined_names(trees) -> set[str]:
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return names


def test_benchmarks_import_no_test_module():
    offenders = []
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            elif isinstance(node, ast.Import):
                mods = [alias.name for alias in node.names]
            else:
                continue
            offenders += [f"{name}:{node.lineno} {m}" for m in mods
                          if m == "tests" or m.startswith("tests.")]
    assert not offenders, offenders


def test_benchmarks_reach_no_private_name():
    trees = _modules()
    own = _defined_names(trees.values())
    offenders = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            private = (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                       and not node.attr.startswith("__"))
            if private and node.attr not in own:
                offenders.append(f"{name}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith(
                    "benchmarks"):
                offenders += [f"{name}:{node.lineno} {node.module}.{a.name}" for a in node.names
                              if a.name.startswith("_") and a.name != "__future__"]
    assert not offenders, offenders


# Cycles among benchmarks/ modules (and everywhere else): tests/test_import_layers.py.

"""Every file of benchmarks/ is a script that some test runs as its user runs
it (script_runner.run_script("NAME", ...): `python benchmarks/NAME.py`), or a
helper that script_runner.HELPERS names with the scripts that exercise it. A
new script without a smoke test fails here."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.benchmarks.script_runner import BENCHMARKS, HELPERS

TESTS = Path(__file__).resolve().parent


def _modules() -> set[str]:
    return {p.stem for p in BENCHMARKS.glob("*.py") if p.stem != "__init__"}


def smoked_scripts() -> dict[str, list[str]]:
    """{script: the tests that call run_script on it} over tests/benchmarks."""
    out: dict[str, list[str]] = {}
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for test in ast.walk(tree):
            if not (isinstance(test, ast.FunctionDef) and test.name.startswith("test_")):
                continue
            for node in ast.walk(test):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id == "run_script" and node.args
                        and isinstance(node.args[0], ast.Constant)):
                    out.setdefault(node.args[0].value, []).append(f"{path.name}::{test.name}")
    return out


def test_every_script_has_a_smoke_test_and_every_other_module_is_a_helper():
    smoked = smoked_scripts()
    modules = _modules()
    lacking = sorted(modules - set(smoked) - set(HELPERS))
    assert not lacking, (f"benchmarks/ scripts with no smoke test: {lacking}. Run each with its "
                         "smallest arguments through tests/benchmarks/script_runner.run_script, "
                         "or, for a module that is no script, list it in HELPERS")


def test_the_lists_name_only_what_exists():
    modules = _modules()
    assert not set(smoked_scripts()) - modules, "run_script of a script benchmarks/ lacks"
    assert not set(HELPERS) - modules, "a helper benchmarks/ lacks"
    # A helper has no smoke test of its own: the scripts that use it run it.
    assert not set(HELPERS) & set(smoked_scripts())


def test_a_helper_is_no_script():
    """A module with a command line of its own (argparse) is a script, unless
    it is a helper whose command line the scripts run (null_worker's ranks)."""
    commands = {name for name in HELPERS
                if "ArgumentParser(" in (BENCHMARKS / f"{name}.py").read_text()}
    assert commands == {"null_worker"}, commands

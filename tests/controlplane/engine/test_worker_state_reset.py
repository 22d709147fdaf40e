"""One helper forgets the worker state (EngineCore._forget_worker_state): the
steps in flight and which requests the workers hold are reset there and
nowhere else in the engine, and no second record of either is left."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ENGINE = ROOT / "controlplane" / "engine"
HELPER = "_forget_worker_state"


def _resets(tree: ast.Module) -> list[tuple[str, str]]:
    """(enclosing function, reset) for every steps.clear() and
    worker_requests.forget() call."""
    found = []
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef):
            continue
        for node in ast.walk(func):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            reset = f"{name}.{node.func.attr}"
            if reset in ("steps.clear", "worker_requests.forget"):
                found.append((func.name, reset))
    return found


def test_only_the_helper_resets_the_worker_state():
    found = {path.name: _resets(ast.parse(path.read_text())) for path in ENGINE.glob("*.py")}
    assert sorted(found["core.py"]) == [(HELPER, "steps.clear"),
                                        (HELPER, "worker_requests.forget")]
    assert all(not resets for name, resets in found.items() if name != "core.py"), found


def test_no_second_record_of_the_worker_state_is_left():
    # The engine's old copies, Request's flag, SchedulerOutput's Request
    # objects, and the merge of a failure reported twice.
    gone = re.compile(r"\b(_in_flight|_worker_req_ids|_flush_req_ids|sent_to_workers|"
                      r"scheduled_requests|failed_again|_unannounced)\b")
    offenders = [f"{path.relative_to(ROOT)}: {match}"
                 for package in ("engine", "core", "executor")
                 for path in sorted((ROOT / "controlplane" / package).glob("*.py"))
                 for match in gone.findall(path.read_text())]
    assert not offenders, offenders

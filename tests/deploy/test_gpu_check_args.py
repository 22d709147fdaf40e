"""scripts/gpu_check.sh refuses hostile time limits before doing any work."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


@pytest.mark.parametrize(("name", "value"), [
    ("STEP_TIMEOUT_S", "abc"), ("STEP_TIMEOUT_S", "0"), ("STEP_TIMEOUT_S", "-5"),
    ("TOTAL_BUDGET_S", "1e9"), ("TOTAL_BUDGET_S", "999999"), ("TOTAL_BUDGET_S", "$(id)"),
])
def test_hostile_time_limits_are_refused(tmp_path, name, value):
    env = {**os.environ, name: value}
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--out", str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"{name}={value}: expected whole seconds, 1 to 99999" in done.stderr
    # Refused up front: no model generated, no step run.
    assert (tmp_path / "out" / "summary.txt").read_text() == ""

"""Running a benchmark as its user runs it: `python benchmarks/NAME.py ARGS` from
the repository root, in a process of its own, with this venv's Python and no
PYTHONPATH (a script must find the repository itself), then reading the JSON
it wrote. The smoke tests (test_script_smoke.py, test_cluster_script_smoke.py)
run every script through run_script; test_every_script_is_smoked.py checks
that each file of benchmarks/ is such a script or a helper listed here."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
# The scripts that serve through the SMG gateway's OpenAI API.
needs_gateway = pytest.mark.skipif(
    shutil.which("smg") is None or importlib.util.find_spec("openai") is None,
    reason="needs the smg gateway and the openai client (pip install smg openai)")

# Modules of benchmarks/ that are no script of their own, and the scripts
# whose smoke tests exercise them.
HELPERS = {
    "null_worker": "control_plane and token_path_cpu start its ranks "
                   "(python -m benchmarks.null_worker, paced with --step-ms)",
    "null_checkpoint": "control_plane and token_path_cpu serve its config-only checkpoint",
    "proc_cpu": "control_plane and token_path_cpu read their processes' CPU with it",
    "control_plane_report": "control_plane's tables and figures",
    "structured_report": "structured_outputs' series and tables",
    "hf_baseline": "engine_core --hf-baseline (serving.py --hf-baseline too)",
    "recovery_netns": "recovery --netns (it has no command line of its own)",
    "arg_types": "pd_disaggregation and spec_decode bound their arguments with it",
}


def run_script(name: str, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """`python benchmarks/<name>.py *args`; fails the test, with the script's
    output, unless it exits 0 within `timeout` seconds."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), *args], cwd=REPO,
                          env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert done.returncode == 0, (f"benchmarks/{name}.py exited {done.returncode}\n"
                                  f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-5000:]}")
    return done


def read_json(path: Path):
    assert path.is_file(), f"{path} was not written"
    return json.loads(path.read_text())

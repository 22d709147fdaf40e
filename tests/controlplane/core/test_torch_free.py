"""controlplane/core has no torch (DESIGN §6), and neither do its tests or the
conftests above them: run them in a child interpreter where torch cannot be
imported, as in an install without it, and check nothing tried to."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

# Replaces the path finder with one that never finds torch, so `import torch`
# raises and importlib.util.find_spec("torch") is None, as where it is not
# installed; then runs pytest on the arguments.
_WITHOUT_TORCH = """
import sys
from importlib.machinery import PathFinder

class WithoutTorch:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            return None
        return PathFinder.find_spec(name, path, target)

    @classmethod
    def find_distributions(cls, *args, **kwargs):
        return PathFinder.find_distributions(*args, **kwargs)

    @classmethod
    def invalidate_caches(cls):
        PathFinder.invalidate_caches()

sys.meta_path[sys.meta_path.index(PathFinder)] = WithoutTorch
import pytest

code = pytest.main(sys.argv[1:])
print("torch imported:", "torch" in sys.modules)
sys.exit(code)
"""


def test_core_tests_run_without_torch():
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TORCH, "tests/controlplane/core", "-q",
         "-p", "no:cacheprovider", f"--ignore={Path(__file__).resolve()}"],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    assert "torch imported: False" in result.stdout, report
    assert " passed" in result.stdout, report

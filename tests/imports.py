"""What a piece of code imports, seen from a fresh interpreter (nothing the
test process already imported hides it)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def modules_imported(code: str, package: str) -> list[str]:
    """Run `code` in a new interpreter at the repo root; the modules of
    top-level `package` it left in sys.modules (at most 3, sorted)."""
    probe = code + (
        "\nimport sys as _sys\n"
        f"print(sorted(m for m in _sys.modules if m.split('.')[0] == {package!r})[:3])\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    # literal_eval: the line is our own print of a list of names.
    return list(ast.literal_eval(out.stdout.strip().splitlines()[-1]))


"""Structured outputs: the controlplane's grammar backend (xgrammar) and the
engine running constrained requests against a real worker in this process.
Skipped where xgrammar is not installed (scripts/install.sh installs it)."""

import pytest

from tests.torch_fixtures import tiny_model_dir  # noqa: F401 (a fixture)

pytest.importorskip("xgrammar", reason="xgrammar is not installed (scripts/install.sh)")

"""Tests of benchmarks/: each script runs small and reports what it measured.
Torch in-process: one thread and the tiny checkpoint (tests.torch_fixtures)."""

from tests.torch_fixtures import tiny_model_dir  # noqa: F401 (a fixture)

"""The docs' examples run against a live tiny cluster, started like the
integration tests' (tests/integration/conftest.py)."""

from tests.torch_fixtures import tiny_model_dir  # noqa: F401 (a fixture)

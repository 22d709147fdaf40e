"""The tiny checkpoint's files, built with torch only when a test asks for them,
so the other tests here collect and run without torch."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from tests.torch_fixtures import tiny_model_path

    return tiny_model_path(tmp_path_factory)

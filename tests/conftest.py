"""Suite-wide test tiers, and nothing that needs torch: the controlplane core and
the client tests must run in an install without it. Torch set-up and the tiny
checkpoint live in the conftests of the directories that use them
(tests/torch_fixtures.py).

Tiers (markers registered in pyproject.toml):
  integration  spawns daemon processes: everything under tests/integration/, the
               local deploy runs (tests/deploy/test_*_local.py), and any test
               that uses the fake daemons (fixture fake_daemons).
  slow         loads the default SmolLM2 model, spawns torch ranks, or is
               otherwise long; marked in the test modules themselves.
  gpu          needs CUDA; skipped where none is available.
The fast tier is `pytest -m "not slow and not integration and not gpu"`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_TESTS = Path(__file__).parent
# Fixtures whose use means the test starts (fake) daemon processes.
_DAEMON_FIXTURES = {"fake_daemons"}


def _spawns_daemons(item: pytest.Item) -> bool:
    path = Path(item.path).resolve()
    if (_TESTS / "integration") in path.parents:
        return True
    if path.parent == _TESTS / "deploy" and path.name.endswith("_local.py"):
        return True
    return bool(_DAEMON_FIXTURES & set(getattr(item, "fixturenames", ())))


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _spawns_daemons(item):
            item.add_marker(pytest.mark.integration)
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    # torch is imported only when a collected test needs CUDA.
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """Tests that run a daemon's main() in process (e.g. `--check`) install its
    stderr handler on the root logger; left there, it outlives pytest's
    capture stream and every later log line (an engine thread of another
    test, a fatal exit's flush) fails with "I/O operation on closed file"."""
    import logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)

"""Runs torch in-process: one thread and the tiny checkpoint (tests.torch_fixtures);
and the ControlplaneConnections a test opens, closed even on failure."""

import pytest

from tests.torch_fixtures import tiny_model_dir  # noqa: F401 (a fixture)
from workerd.connection import ControlplaneConnection


@pytest.fixture
def connections():
    """open_(target) -> ControlplaneConnection; every one is closed afterwards."""
    opened: list[ControlplaneConnection] = []

    def open_(target: str) -> ControlplaneConnection:
        conn = ControlplaneConnection(target)
        opened.append(conn)
        return conn

    yield open_
    for conn in opened:
        conn.close(grace_s=1.0)

"""A controlplane whose API, worker or metrics port another process holds
fails at start-up with one line naming the port, exit code 2, never sharing
the port (gRPC's default SO_REUSEPORT) with whoever holds it."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import grpc
import pytest

from controlplane.__main__ import build_config, build_parser
from controlplane.executor.worker_plane import WorkerPlane
from controlplane.server import grpc_options
from kvloom.common.ports import EXCLUSIVE_PORT, PortInUse, add_port
from tests.checkpoints import config_only_checkpoint
from tests.controlplane.executor.test_worker_plane import Plane


@pytest.fixture
def held_port():
    """A free port listened on with SO_REUSEPORT, as a gRPC server with
    default options (an earlier controlplane) listens."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture
def model_dir(tmp_path):
    return config_only_checkpoint(tmp_path)


def _controlplane(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "controlplane", *argv],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("flag", ["--port", "--worker-port", "--metrics-port"])
def test_a_held_port_is_one_line_and_exit_2(model_dir, held_port, flag):
    argv = ["--model", model_dir, "--host", "127.0.0.1", "--check",
            "--port", "0", "--worker-port", "0", flag, str(held_port)]
    done = _controlplane(*argv)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith(
        f"kvloom-controlplane: error: port {held_port} is already in use by another process"
    ), done.stderr
    assert flag in lines[-1]
    assert "usage:" not in done.stderr and "Traceback" not in done.stderr


def test_check_passes_with_free_ports(model_dir):
    done = _controlplane("--model", model_dir, "--host", "127.0.0.1", "--check",
                         "--port", "0", "--worker-port", "0")
    assert done.returncode == 0, done.stderr


def test_api_server_bind_refuses_a_reuseport_holder(model_dir, held_port):
    """The API server's own options (past the start-up check)."""
    config, _ = build_config(build_parser().parse_args(["--model", model_dir]))
    assert EXCLUSIVE_PORT in grpc_options(config)
    server = grpc.server(None, options=grpc_options(config))
    try:
        with pytest.raises(PortInUse, match=f"port {held_port} is already in use"):
            add_port(server, "127.0.0.1", held_port)
    finally:
        server.stop(None)


def test_worker_port_bind_refuses_a_reuseport_holder(held_port):
    """The bind itself, past the start-up check: with gRPC's defaults this
    server would have bound beside the holder."""
    async def scenario():
        plane = WorkerPlane(Plane().executor, "127.0.0.1", held_port, [])
        with pytest.raises(PortInUse, match=f"port {held_port} is already in use"):
            await plane.start()
        await plane.stop()

    asyncio.run(scenario())

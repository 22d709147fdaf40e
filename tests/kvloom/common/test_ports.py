"""Exclusive ports: a server whose port another process holds fails with one
clear line instead of sharing it (gRPC's SO_REUSEPORT) or tracing back."""

from __future__ import annotations

import socket

import grpc
import prometheus_client
import pytest

from kvloom.common.metrics_http import MetricsEndpoint
from kvloom.common.ports import EXCLUSIVE_PORT, PortInUse, PortReservation, add_port, port_in_use


@pytest.fixture
def held_port():
    """A free port, listened on by a socket with SO_REUSEPORT set, as a gRPC
    server with default options does: only another SO_REUSEPORT socket could
    bind beside it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_port_in_use_sees_a_listener_and_not_a_free_port(held_port):
    assert port_in_use("127.0.0.1", held_port)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    assert not port_in_use("127.0.0.1", free)


def test_grpc_server_with_exclusive_option_refuses_a_held_port(held_port):
    server = grpc.server(None, options=[EXCLUSIVE_PORT])
    try:
        with pytest.raises(PortInUse) as caught:
            add_port(server, "127.0.0.1", held_port, "--port")
    finally:
        server.stop(None)
    assert str(caught.value).startswith(f"port {held_port} is already in use by another process")
    assert "\n" not in str(caught.value)


def test_grpc_default_options_would_share_the_port(held_port):
    """Why EXCLUSIVE_PORT exists: without it gRPC binds beside the holder."""
    server = grpc.server(None)
    try:
        assert server.add_insecure_port(f"127.0.0.1:{held_port}") == held_port
    finally:
        server.stop(None)


def test_metrics_endpoint_refuses_a_held_port(held_port):
    endpoint = MetricsEndpoint(prometheus_client.CollectorRegistry())
    with pytest.raises(PortInUse, match=f"^port {held_port} is already in use by another process"):
        endpoint.serve("127.0.0.1", held_port)
    endpoint.close()


def test_a_reserved_port_is_held_until_released_and_a_new_take_moves_it():
    reservation = PortReservation()
    port = reservation.take("127.0.0.1")
    assert port_in_use("127.0.0.1", port)  # held: nothing else binds it
    moved = reservation.take("127.0.0.1")
    assert moved != port and port_in_use("127.0.0.1", moved)
    assert not port_in_use("127.0.0.1", port)  # the old one was let go
    reservation.release()
    assert not port_in_use("127.0.0.1", moved)
    with socket.socket() as server:  # what a TCPStore does right after release()
        server.bind(("127.0.0.1", moved))
        server.listen()
    reservation.release()  # nothing held: a no-op

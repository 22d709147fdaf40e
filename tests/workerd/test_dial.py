"""Dialing the controlplane: start order does not matter, a wrong peer is a
clear error, and no registration attempt waits without a bound.

Servers are in-test gRPC servers on free loopback ports; every wait polls a
condition (the timeouts below only bound a poll that must succeed).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from kvloom.worker.v1 import worker_pb2_grpc
from tests.workerd.test_connection import ScriptedControlplane, _register_request
from workerd import connection
from workerd.connection import ControlplaneConnection, RegistrationError, free_port

ROOT = Path(__file__).resolve().parents[2]
POLL_S = 60.0  # bounds polls that must succeed; never asserted as a duration


def _poll(what: str, check, timeout: float = POLL_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout:.0f} s")
        time.sleep(0.05)


def _server(port: int = 0) -> tuple[grpc.Server, int]:
    # Exclusive port: a leftover listener must fail the test, not share the port.
    server = grpc.server(ThreadPoolExecutor(max_workers=4), options=[("grpc.so_reuseport", 0)])
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    assert bound, f"could not bind 127.0.0.1:{port}"
    return server, bound


@pytest.fixture
def servers():
    started: list[grpc.Server] = []

    def start(port: int = 0, controlplane: ScriptedControlplane | None = None) -> int:
        server, bound = _server(port)
        if controlplane is not None:
            worker_pb2_grpc.add_WorkerControlServicer_to_server(controlplane, server)
        else:  # a gRPC server that is not a kvloom controlplane
            health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        server.start()
        started.append(server)
        return bound

    yield start
    for server in started:
        server.stop(0).wait(10)


@pytest.fixture
def conns():
    opened: list[ControlplaneConnection] = []

    def open_(target: str) -> ControlplaneConnection:
        conn = ControlplaneConnection(target)
        opened.append(conn)
        return conn

    yield open_
    for conn in opened:
        conn.close(grace_s=1.0)


def test_channel_reconnect_backoff_is_capped():
    opts = dict(connection.channel_options())
    assert opts["grpc.max_reconnect_backoff_ms"] <= 2000
    assert opts["grpc.initial_reconnect_backoff_ms"] <= opts["grpc.max_reconnect_backoff_ms"]
    # gRPC's default floor is 20 s; it must not stay above the cap.
    assert opts["grpc.min_reconnect_backoff_ms"] <= 2000


def test_non_kvloom_grpc_server_is_a_clear_registration_error(servers, conns):
    port = servers()
    conn = conns(f"127.0.0.1:{port}")
    conn.connect(POLL_S)
    with pytest.raises(RegistrationError) as err:
        conn.register(_register_request())
    assert err.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert "not a kvloom controlplane" in str(err.value)
    assert f"127.0.0.1:{port}" in str(err.value)


def test_wrong_protocol_version_is_refused_not_retried(servers, conns):
    scripted = ScriptedControlplane()
    scripted.refusal = (grpc.StatusCode.FAILED_PRECONDITION, "worker speaks protocol version 9")
    port = servers(controlplane=scripted)
    conn = conns(f"127.0.0.1:{port}")
    conn.connect(POLL_S)
    with pytest.raises(RegistrationError) as err:
        conn.register(_register_request(protocol_version=9))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert scripted.received.qsize() == 1  # one attempt: a refusal is final


def test_silent_peer_registration_attempt_is_bounded(servers, conns, monkeypatch):
    """A peer that accepts the stream but never answers: each attempt is
    cancelled after REGISTER_ATTEMPT_S and the dial gives up at its deadline."""
    monkeypatch.setattr(connection, "REGISTER_ATTEMPT_S", 0.3)
    scripted = ScriptedControlplane()
    silent = threading.Event()

    def never_answers(request_iterator, context):
        scripted.received.put(next(request_iterator))
        silent.wait(POLL_S)
        yield from ()

    scripted.Connect = never_answers
    port = servers(controlplane=scripted)
    conn = conns(f"127.0.0.1:{port}")
    conn.connect(1.0)
    try:
        with pytest.raises(ConnectionError, match="could not register"):
            conn.register(_register_request())
    finally:
        silent.set()
    assert scripted.received.qsize() >= 2  # retried before giving up


def test_worker_started_before_its_controlplane_joins_once_it_listens(servers, conns, caplog):
    port = free_port()
    target = f"127.0.0.1:{port}"
    conn = conns(target)
    result: dict = {}

    def dial() -> None:
        try:
            conn.connect(POLL_S * 2)
            result["reply"] = conn.register(_register_request())
        except Exception as exc:  # surfaced by the assertions below
            result["error"] = exc

    caplog.set_level("INFO", logger="workerd.connection")
    worker = threading.Thread(target=dial, daemon=True)
    worker.start()
    waiting = f"waiting for controlplane at {target} (attempt 2)"
    _poll("two logged dial attempts", lambda: waiting in caplog.text)
    assert conn.dial_attempts >= 2
    assert "reply" not in result and "error" not in result

    scripted = ScriptedControlplane()
    servers(port, controlplane=scripted)
    _poll("registration", lambda: "reply" in result or "error" in result)
    worker.join(POLL_S)
    assert "error" not in result, result.get("error")
    assert (result["reply"].rank, result["reply"].world_size) == (1, 2)
    assert scripted.next_received().WhichOneof("payload") == "register"


def test_workerd_exits_nonzero_with_one_line_against_a_non_kvloom_server(servers):
    port = servers()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLOOM_")}
    done = subprocess.run(
        [sys.executable, "-m", "workerd", f"--controlplane=127.0.0.1:{port}",
         "--device=cpu", "--connect-timeout=60"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if "not a kvloom controlplane" in line]
    assert len(errors) == 1, done.stderr
    assert "Traceback" not in done.stderr

"""Dialing the controlplane: start order does not matter, a wrong peer is a
clear error, and no registration attempt waits without a bound.

Servers are in-test gRPC servers on free loopback ports; every wait polls a
condition (the timeouts below only bound a poll that must succeed).
"""

from __future__ import annotations

import asyncio
import datetime
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

from kvloom.common.ports import free_port
from kvloom.worker.v1 import worker_pb2_grpc
from tests.workerd.test_connection import ScriptedControlplane, _register_request
from workerd import connection
from workerd.connection import ControlplaneConnection, RegistrationError

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




def test_channel_reconnect_backoff_is_capped():
    opts = dict(connection.channel_options())
    assert opts["grpc.max_reconnect_backoff_ms"] <= 2000
    assert opts["grpc.initial_reconnect_backoff_ms"] <= opts["grpc.max_reconnect_backoff_ms"]
    # gRPC's default floor is 20 s; it must not stay above the cap.
    assert opts["grpc.min_reconnect_backoff_ms"] <= 2000


def test_non_kvloom_grpc_server_is_a_clear_registration_error(servers, connections):
    port = servers()
    conn = connections(f"127.0.0.1:{port}")
    conn.connect(POLL_S)
    with pytest.raises(RegistrationError) as err:
        conn.register(_register_request())
    assert err.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert "not a kvloom controlplane" in str(err.value)
    assert f"127.0.0.1:{port}" in str(err.value)


def test_wrong_protocol_version_is_refused_not_retried(servers, connections):
    scripted = ScriptedControlplane()
    scripted.refusal = (grpc.StatusCode.FAILED_PRECONDITION, "worker speaks protocol version 9")
    port = servers(controlplane=scripted)
    conn = connections(f"127.0.0.1:{port}")
    conn.connect(POLL_S)
    with pytest.raises(RegistrationError) as err:
        conn.register(_register_request(protocol_version=9))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert scripted.received.qsize() == 1  # one attempt: a refusal is final


def test_silent_peer_registration_attempt_is_bounded(servers, connections, monkeypatch):
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
    conn = connections(f"127.0.0.1:{port}")
    conn.connect(1.0)
    try:
        with pytest.raises(ConnectionError, match="could not register"):
            conn.register(_register_request())
    finally:
        silent.set()
    assert scripted.received.qsize() >= 2  # retried before giving up


def test_worker_started_before_its_controlplane_joins_once_it_listens(servers, connections, caplog):
    port = free_port()
    target = f"127.0.0.1:{port}"
    conn = connections(target)
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


# ---- TLS on the worker port (issue 11) ----------------------------------------
#
# A real WorkerPlane (the controlplane's worker port, with --worker-ssl-* set)
# on a free loopback port, and real ControlplaneConnections dialing it.


class _Pki:
    """A CA with the controlplane's and a worker's certificates, and the
    certificates a worker must be refused with: from a second CA, expired."""

    def __init__(self, root: Path) -> None:
        from kvloom.common.certs import CertAuthority

        self.ca = CertAuthority.create(root / "ca")
        self.other_ca = CertAuthority.create(root / "other", name="other-ca")
        self.server = self.ca.issue(root, "controlplane")
        self.worker = self.ca.issue(root, "worker")
        self.stranger = self.other_ca.issue(root, "stranger")
        self.expired = self.ca.issue(root, "expired", days=1, not_before=datetime.datetime.now(
            datetime.UTC) - datetime.timedelta(days=3))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> _Pki:
    return _Pki(tmp_path_factory.mktemp("pki"))


class _TlsPlane:
    """The controlplane's WorkerPlane and Executor (world size 1) with worker mTLS."""

    def __init__(self, pki: _Pki, auth_token: str = "", mtls: bool = True) -> None:
        from controlplane.config import (
            CacheConfig,
            ModelConfig,
            ParallelConfig,
            WorkerGroupConfig,
        )
        from controlplane.executor.grpc_executor import Executor
        from controlplane.executor.worker_plane import WorkerPlane

        self.ready = threading.Event()
        cfg = WorkerGroupConfig(
            auth_token=auth_token, heartbeat_timeout_s=3600,
            worker_ssl_certfile=str(pki.server.certfile),
            worker_ssl_keyfile=str(pki.server.keyfile),
            worker_ssl_ca_certs=str(pki.ca.ca_path) if mtls else "")
        self.executor = Executor(
            ParallelConfig(), cfg, ModelConfig(model="/m", served_model_name="m",
                                               worker_model_path="/m"),
            CacheConfig(), on_ready=lambda n: self.ready.set(),
            on_failed=lambda reason, kind: None, vocab_size=32000)
        self.plane = WorkerPlane(self.executor, "127.0.0.1", 0, [])
        self.target = f"127.0.0.1:{asyncio.run(self.plane.start())}"

    def stop(self) -> None:
        asyncio.run(self.plane.stop(grace=0.5))


@pytest.fixture
def tls_plane(pki):
    planes: list[_TlsPlane] = []

    def start(**kwargs) -> _TlsPlane:
        planes.append(_TlsPlane(pki, **kwargs))
        return planes[-1]

    yield start
    for plane in planes:
        plane.stop()


def _credentials(pki: _Pki, leaf=None, ca=None):
    from workerd.connection import channel_credentials

    ca_path = str(ca or pki.ca.ca_path)
    if leaf is None:
        return channel_credentials(ca_path, "", "")
    return channel_credentials(ca_path, str(leaf.certfile), str(leaf.keyfile))


def _answer_commands(conn: ControlplaneConnection) -> threading.Thread:
    """Acks start-up commands and pings, as a worker's main loop would."""
    from tests.controlplane.executor.replies import command_reply

    def loop() -> None:
        while (msg := conn.commands.get()) is not None:
            conn.send(command_reply(msg))

    conn.start_reader(threading.Event())
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def fast_dial(monkeypatch):
    """Dial attempts of 0.2 s: the refusals below take a few attempts each."""
    monkeypatch.setattr(connection, "DIAL_ATTEMPT_S", 0.2)


def test_an_mtls_worker_registers_and_its_refused_peers_leave_the_group_serving(
        pki, tls_plane, fast_dial, caplog):
    from workerd.connection import TlsRefused

    plane = tls_plane()
    good = ControlplaneConnection(plane.target, _credentials(pki, pki.worker))
    try:
        good.connect(POLL_S)
        reply = good.register(_register_request(auth_token=""))
        assert (reply.rank, reply.world_size) == (0, 1)
        _answer_commands(good)
        assert plane.ready.wait(POLL_S), "the mTLS worker's group never became ready"

        refused = {
            "no certificate": _credentials(pki),
            "another CA's certificate": _credentials(pki, pki.stranger),
            "an expired certificate": _credentials(pki, pki.expired),
        }
        for what, creds in refused.items():
            bad = ControlplaneConnection(plane.target, creds)
            started = time.monotonic()
            with pytest.raises(TlsRefused, match="refused this worker's certificate") as info:
                bad.connect(POLL_S)
            bad.close(grace_s=0)
            assert "--ssl-certfile" in str(info.value), what
            assert time.monotonic() - started < POLL_S / 2, what  # not the whole timeout

        # The attached rank never noticed: still one rank, ready, and answering.
        status = plane.executor.status()
        assert status.num_attached == 1 and plane.ready.is_set()
        before = status.last_success
        asyncio.run(plane.plane.canary(timeout_s=POLL_S))
        assert plane.executor.status().last_success > before
    finally:
        good.close(grace_s=1.0)


def test_a_controlplane_certificate_from_another_ca_is_a_handshake_error(pki, tls_plane,
                                                                         fast_dial):
    from workerd.connection import TlsRefused

    plane = tls_plane()
    conn = ControlplaneConnection(plane.target, _credentials(pki, pki.worker,
                                                             ca=pki.other_ca.ca_path))
    with pytest.raises(TlsRefused) as info:
        conn.connect(POLL_S)
    conn.close(grace_s=0)
    message = str(info.value)
    assert "TLS handshake with the controlplane" in message and "--ssl-ca-certs" in message
    assert "CERTIFICATE_VERIFY_FAILED" in message


def test_a_plaintext_worker_at_a_tls_port_is_told_to_pass_ssl_ca_certs(pki, tls_plane,
                                                                      fast_dial):
    from workerd.connection import TlsRefused

    plane = tls_plane(mtls=False)
    conn = ControlplaneConnection(plane.target)
    with pytest.raises(TlsRefused, match="probably requires TLS.*--ssl-ca-certs"):
        conn.connect(POLL_S)
    conn.close(grace_s=0)


def test_a_tls_worker_at_a_plaintext_port_is_a_handshake_error(pki, servers, fast_dial):
    from workerd.connection import TlsRefused

    port = servers(controlplane=ScriptedControlplane())
    conn = ControlplaneConnection(f"127.0.0.1:{port}", _credentials(pki, pki.worker))
    with pytest.raises(TlsRefused, match="TLS handshake with the controlplane"):
        conn.connect(POLL_S)
    conn.close(grace_s=0)


def test_tls_without_client_auth_accepts_a_worker_without_a_certificate(pki, tls_plane):
    plane = tls_plane(mtls=False)
    conn = ControlplaneConnection(plane.target, _credentials(pki))
    try:
        conn.connect(POLL_S)
        assert conn.register(_register_request(auth_token="")).world_size == 1
    finally:
        conn.close(grace_s=1.0)


def _workerd_config(target: str, *flags: str):
    from workerd.__main__ import build_config, build_parser

    return build_config(build_parser().parse_args(["--controlplane", target, "--device", "cpu",
                                                   "--connect-timeout", str(POLL_S), *flags]))


def _run_workerd(config) -> int:
    """workerd's run() on a thread of its own (so it installs no signal handler)."""
    from workerd.__main__ import run

    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", run(config)),
                              daemon=True)
    thread.start()
    thread.join(POLL_S * 2)
    assert not thread.is_alive(), "workerd did not give up"
    return result["code"]


def test_workerd_with_a_refused_certificate_logs_one_line_and_exits_2(pki, tls_plane,
                                                                      fast_dial, caplog):
    plane = tls_plane()
    caplog.set_level("INFO", logger="workerd")
    config = _workerd_config(plane.target, "--ssl-ca-certs", str(pki.ca.ca_path),
                             "--ssl-certfile", str(pki.stranger.certfile),
                             "--ssl-keyfile", str(pki.stranger.keyfile))
    assert _run_workerd(config) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "refused this worker's certificate" in errors[0], errors
    assert plane.executor.status().num_attached == 0


def test_workerd_with_a_wrong_token_file_is_refused_unauthenticated(pki, tls_plane, tmp_path,
                                                                   caplog):
    plane = tls_plane(auth_token="s3cret")
    token = tmp_path / "token"
    token.write_text("not-the-token\n")
    caplog.set_level("INFO", logger="workerd")
    config = _workerd_config(plane.target, "--ssl-ca-certs", str(pki.ca.ca_path),
                             "--ssl-certfile", str(pki.worker.certfile),
                             "--ssl-keyfile", str(pki.worker.keyfile),
                             "--auth-token-file", str(token))
    assert config.registration.auth_token == "not-the-token"
    assert _run_workerd(config) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "UNAUTHENTICATED" in errors[0], errors


def test_workerd_with_the_right_token_file_registers(pki, tls_plane, tmp_path):
    plane = tls_plane(auth_token="s3cret")
    token = tmp_path / "token"
    token.write_text("  s3cret\n")
    config = _workerd_config(plane.target, "--ssl-ca-certs", str(pki.ca.ca_path),
                             "--ssl-certfile", str(pki.worker.certfile),
                             "--ssl-keyfile", str(pki.worker.keyfile),
                             "--auth-token-file", str(token))
    conn = ControlplaneConnection(plane.target, config.connection.credentials)
    try:
        conn.connect(POLL_S)
        conn.register(_register_request(auth_token=config.registration.auth_token))
    finally:
        conn.close(grace_s=1.0)


def test_a_timed_out_tcp_connect_is_no_tls_verdict():
    """A host cut off makes gRPC report "tcp handshaker shutdown": an
    unreachable peer to keep dialing, not a refused certificate."""
    assert not connection._handshake_failure(
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.1:5: "
        "tcp handshaker shutdown")
    assert connection._handshake_failure("Ssl handshake failed: SSL_ERROR_SSL")
    # A certificate that does not name the address dialed (gRPC 1.85's words).
    assert connection._handshake_failure(
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.1:5: Custom "
        "verification check failed with error: UNAUTHENTICATED: Hostname Verification Check "
        "failed.")


def test_keepalive_probes_follow_the_heartbeat_and_link_timeout():
    opts = dict(connection.channel_options(keepalive_s=5.0, link_timeout_s=3.0))
    assert (opts["grpc.keepalive_time_ms"], opts["grpc.keepalive_timeout_ms"]) == (5000, 3000)
    # Never more often than the controlplane's port accepts pings.
    opts = dict(connection.channel_options(keepalive_s=0.25, link_timeout_s=1.0))
    assert opts["grpc.keepalive_time_ms"] == 1000 * connection.KEEPALIVE_MIN_S

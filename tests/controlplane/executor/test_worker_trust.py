"""Trust on the worker plane, controlplane side: the rendezvous address is
where rank 0 was seen, not what it claims; the token is compared in constant
time and may come from a file; the worker port's TLS flags are checked at
start-up with one line naming the flag (exit 2).

The refusals at the TLS handshake itself, seen from a real workerd
connection, are in tests/workerd/test_dial.py.
"""

from __future__ import annotations

import asyncio
import datetime
import os
from pathlib import Path

import grpc
import pytest

from controlplane.__main__ import main as controlplane_main
from controlplane.config import WorkerGroupConfig
from controlplane.executor.registration import (
    RegistrationRefused,
    check_registration,
    claim_differs,
    new_handle,
    observed_host,
)
from controlplane.executor.status import GroupState
from controlplane.executor.worker_plane import WorkerTlsError, worker_server_credentials
from kvloom.common.certs import CertAuthority
from kvloom.worker.v1 import worker_pb2
from tests.checkpoints import config_only_checkpoint
from tests.controlplane.executor.test_grpc_executor import FakeWorker, Harness

# ---- rendezvous: observed, not claimed ---------------------------------------


@pytest.mark.parametrize(
    ("peer", "host"),
    [
        ("ipv4:10.0.0.5:41234", "10.0.0.5"),
        ("ipv4:127.0.0.1:1", "127.0.0.1"),
        ("ipv6:[::1]:5555", "::1"),
        ("ipv6:[fe80::1%eth0]:5555", "fe80::1"),
        ("ipv6:[::ffff:10.0.0.5]:7", "10.0.0.5"),  # a dual-stack listener's IPv4 peer
        ("unix:/run/kvloom.sock", "127.0.0.1"),
    ],
)
def test_observed_host_reads_grpc_peer_strings(peer, host):
    assert observed_host(peer) == host


@pytest.mark.parametrize("peer", ["", "ipv4:", "ipv4:evil.example:1", "tcp:10.0.0.5:1",
                                  "ipv6:[not-an-ip]:1", "10.0.0.5:1"])
def test_an_unreadable_peer_is_refused_never_trusted(peer):
    with pytest.raises(RegistrationRefused) as info:
        observed_host(peer)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize(
    ("claimed", "observed", "differs"),
    [
        ("127.0.0.1", "127.0.0.1", False),
        ("localhost", "127.0.0.1", False),
        ("::ffff:10.0.0.5", "10.0.0.5", False),
        ("10.9.9.9", "127.0.0.1", True),
        ("workerd-0", "172.18.0.4", True),  # a name is never resolved on the loop
        ("", "10.0.0.5", True),
    ],
)
def test_claim_differs(claimed, observed, differs):
    assert claim_differs(claimed, observed) is differs


class _InitRecorder(FakeWorker):
    """A FakeWorker that keeps the InitDistributed it is sent."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.init = asyncio.get_running_loop().create_future()

    async def _on(self, msg):
        if msg.WhichOneof("command") == "init_distributed" and not self.init.done():
            self.init.set_result(msg.init_distributed)
        await super()._on(msg)


def test_a_worker_claiming_another_host_gets_the_observed_master_addr(caplog):
    """Rank 0 claims 10.9.9.9 (it could be any machine); its stream comes from
    loopback, so every rank is told to rendezvous at 127.0.0.1."""

    async def scenario():
        async with Harness() as h:
            caplog.set_level("INFO", logger="controlplane.executor.grpc_executor")
            workers = [_InitRecorder(h.address, 10, rank=0, host="10.9.9.9"),
                       _InitRecorder(h.address, 10, rank=1, host="127.0.0.1")]
            tasks = [asyncio.create_task(w.run()) for w in workers]
            inits = await asyncio.wait_for(asyncio.gather(*(w.init for w in workers)), 10)
            assert {i.master_addr for i in inits} == {"127.0.0.1"}
            assert {i.master_port for i in inits} == {1234}
            await asyncio.wait_for(h.ready, 10)
            ranks = {r.rank: r for r in h.executor.status().ranks}
            assert ranks[0].host == "10.9.9.9"  # the claim, kept for display
            for w in workers:
                await w.close()
            await asyncio.gather(*tasks, return_exceptions=True)
        claims = [r.message for r in caplog.records if "claims host" in r.getMessage()]
        assert len(claims) == 1 and "'10.9.9.9'" in claims[0] and "127.0.0.1" in claims[0]

    asyncio.run(scenario())


@pytest.mark.parametrize("claimed", ["127.0.0.1", "127.0.1.1", "localhost", "::1",
                                     "::ffff:127.0.0.1"])
def test_a_remote_worker_advertising_loopback_is_refused_naming_both(claimed):
    """Its gloo group would bind loopback: the group could never form."""
    req = worker_pb2.RegisterRequest(host=claimed)
    with pytest.raises(RegistrationRefused) as info:
        new_handle(req, "ipv4:10.0.0.5:41234", 0)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"connected from 10.0.0.5 advertises {claimed}" in info.value.message
    assert "--advertise-host" in info.value.message
    # The same claim from loopback is a local cluster; other claims are display.
    assert new_handle(req, "ipv4:127.0.0.1:1", 0).peer_host == "127.0.0.1"
    assert new_handle(worker_pb2.RegisterRequest(host="10.9.9.9"), "ipv4:10.0.0.5:1",
                      0).host == "10.9.9.9"


@pytest.mark.parametrize(("host", "words"), [
    ("h" * 254, "has 254 characters"), ("a\nforged log line", "not a host name"),
    ("höst", "not a host name"), ("a b", "not a host name"),
])
def test_a_hostile_claimed_host_is_invalid_argument(host, words):
    req = worker_pb2.RegisterRequest(protocol_version=worker_pb2.PROTOCOL_VERSION_CURRENT,
                                     host=host)
    with pytest.raises(RegistrationRefused) as info:
        check_registration(req, WorkerGroupConfig(), GroupState.FORMING, 1)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert words in info.value.message and "--advertise-host" in info.value.message
    assert "\n" not in info.value.message  # the refusal forges no log line either


# ---- the token ------------------------------------------------------------------


def _request(token: str) -> worker_pb2.RegisterRequest:
    return worker_pb2.RegisterRequest(protocol_version=worker_pb2.PROTOCOL_VERSION_CURRENT,
                                      auth_token=token)


@pytest.mark.parametrize("given", ["", "s3cre", "s3cret ", "S3CRET", "s3cretx", "ü"])
def test_a_wrong_token_is_unauthenticated(given):
    with pytest.raises(RegistrationRefused) as info:
        check_registration(_request(given), WorkerGroupConfig(auth_token="s3cret"),
                           GroupState.FORMING, 1)
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "--auth-token-file" in info.value.message


def test_the_right_token_passes_non_ascii_included():
    cfg = WorkerGroupConfig(auth_token="s3crét")
    check_registration(_request("s3crét"), cfg, GroupState.FORMING, 1)


# ---- start-up checks of the flags (controlplane --check) ---------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pki")
    ca = CertAuthority.create(root / "ca")
    other = CertAuthority.create(root / "other", name="other-ca")
    server = ca.issue(root, "controlplane")
    stranger = other.issue(root, "stranger")
    expired = ca.issue(root, "expired", days=1, not_before=datetime.datetime.now(
        datetime.UTC) - datetime.timedelta(days=3))
    garbage = root / "garbage.pem"
    garbage.write_text("hello\n")
    big = root / "big.pem"
    big.write_bytes(b"-----BEGIN CERTIFICATE-----\n" + b"A" * (2 << 20))
    return {"cert": server.certfile, "key": server.keyfile, "ca": ca.ca_path,
            "other_key": stranger.keyfile, "expired": expired.certfile,
            "expired_key": expired.keyfile, "garbage": garbage, "big": big, "dir": root}


def test_worker_tls_off_by_default():
    assert worker_server_credentials(WorkerGroupConfig()) is None


def test_worker_tls_credentials_build(pki):
    cfg = WorkerGroupConfig(worker_ssl_certfile=str(pki["cert"]),
                            worker_ssl_keyfile=str(pki["key"]),
                            worker_ssl_ca_certs=str(pki["ca"]))
    assert isinstance(worker_server_credentials(cfg), grpc.ServerCredentials)


HOSTILE_TLS = [
    # (certfile, keyfile, ca, flag named, fragment)
    ("cert", "", "", "--worker-ssl-certfile", "needs --worker-ssl-keyfile"),
    ("", "key", "", "--worker-ssl-keyfile", "needs --worker-ssl-certfile"),
    ("", "", "ca", "--worker-ssl-ca-certs", "needs --worker-ssl-certfile"),
    ("/nonexistent.pem", "key", "", "--worker-ssl-certfile", "No such file"),
    ("cert", "/nonexistent.key", "", "--worker-ssl-keyfile", "No such file"),
    ("cert", "key", "/nonexistent.pem", "--worker-ssl-ca-certs", "No such file"),
    ("dir", "key", "", "--worker-ssl-certfile", "not a regular file"),
    ("/dev/zero", "key", "", "--worker-ssl-certfile", "not a regular file"),
    ("cert", "key", "/dev/null", "--worker-ssl-ca-certs", "not a regular file"),
    ("garbage", "key", "", "--worker-ssl-certfile", "not a PEM file"),
    ("big", "key", "", "--worker-ssl-certfile", "more than a PEM file holds"),
    ("cert", "other_key", "", "--worker-ssl-keyfile", "its own unencrypted key"),
    ("cert", "cert", "", "--worker-ssl-keyfile", "its own unencrypted key"),
    ("cert", "key", "garbage", "--worker-ssl-ca-certs", "not a PEM file"),
    ("cert", "key", "key", "--worker-ssl-ca-certs", "CA that signs"),
    ("expired", "expired_key", "ca", "--worker-ssl-certfile", "expired on"),
]


def _path(pki, name: str) -> str:
    return str(pki[name]) if name in pki else name


@pytest.mark.parametrize(("cert", "key", "ca", "flag", "fragment"), HOSTILE_TLS)
def test_hostile_worker_tls_flags_are_one_line_naming_the_flag(pki, cert, key, ca, flag,
                                                                fragment):
    cfg = WorkerGroupConfig(worker_ssl_certfile=_path(pki, cert),
                            worker_ssl_keyfile=_path(pki, key),
                            worker_ssl_ca_certs=_path(pki, ca))
    with pytest.raises(WorkerTlsError) as info:
        worker_server_credentials(cfg)
    message = str(info.value)
    assert flag in message and fragment in message and "\n" not in message


@pytest.fixture
def no_kvloom_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("KVLOOM_"):
            monkeypatch.delenv(name)


def _check(tmp_path, *argv: str) -> None:
    model = config_only_checkpoint(tmp_path)
    controlplane_main(["--model", model, "--port", "0", "--worker-port", "0", "--check",
                       *argv])


def test_check_accepts_worker_mtls_and_a_token_file(tmp_path, pki, no_kvloom_env, capsys):
    token = tmp_path / "token"
    token.write_text("  s3cret\n")
    _check(tmp_path, "--worker-ssl-certfile", str(pki["cert"]), "--worker-ssl-keyfile",
           str(pki["key"]), "--worker-ssl-ca-certs", str(pki["ca"]),
           "--auth-token-file", str(token))
    assert "ports are usable" in capsys.readouterr().out


def test_check_refuses_hostile_worker_tls_in_one_line(tmp_path, pki, no_kvloom_env, capsys):
    with pytest.raises(SystemExit) as info:
        _check(tmp_path, "--worker-ssl-certfile", str(pki["expired"]),
               "--worker-ssl-keyfile", str(pki["expired_key"]))
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvloom-controlplane: error: --worker-ssl-certfile")
    assert "expired on" in err and len(err.splitlines()) == 1


def _token_file(tmp_path: Path, name: str) -> str:
    if name == "missing":
        return str(tmp_path / "missing")
    if name == "dir":
        return str(tmp_path)
    if name == "devzero":
        return "/dev/zero"
    path = tmp_path / name
    path.write_bytes({"empty": b"", "blank": b" \n\t\n", "binary": b"\xff\xfe\x00",
                      "huge": b"x" * (65 * 1024)}[name])
    return str(path)


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("missing", "No such file"),
        ("dir", "not a regular file"),
        ("devzero", "not a regular file"),
        ("empty", "the file is empty"),
        ("blank", "the file is empty"),
        ("binary", "not UTF-8"),
        ("huge", "a token file holds one line"),
    ],
)
def test_hostile_auth_token_files_are_refused_naming_the_flag(tmp_path, no_kvloom_env, capsys,
                                                               name, fragment):
    path = _token_file(tmp_path, name)
    with pytest.raises(SystemExit) as info:
        _check(tmp_path, "--auth-token-file", path)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvloom-controlplane: error: --auth-token-file {path}")
    assert fragment in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("token_from", ["flag", "env"])
def test_auth_token_file_excludes_auth_token(tmp_path, no_kvloom_env, monkeypatch, capsys,
                                             token_from):
    token = tmp_path / "token"
    token.write_text("s3cret")
    argv = ["--auth-token-file", str(token)]
    if token_from == "flag":
        argv += ["--auth-token", "other"]
    else:
        monkeypatch.setenv("KVLOOM_AUTH_TOKEN", "other")
    with pytest.raises(SystemExit) as info:
        _check(tmp_path, *argv)
    assert info.value.code == 2
    assert "pass one" in capsys.readouterr().err


def test_the_token_file_reaches_the_executor_config_stripped(tmp_path, no_kvloom_env):
    from controlplane.__main__ import build_config, build_parser

    token = tmp_path / "token"
    token.write_text("\n  s3cret \n")
    model = config_only_checkpoint(tmp_path)
    config, _ = build_config(build_parser().parse_args(
        ["--model", model, "--auth-token-file", str(token)]))
    assert config.workers.auth_token == "s3cret"

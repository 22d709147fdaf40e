"""kvloom.client and the `kvloom` CLI against secured servers (conftest's
secure_server: the fake Generation server behind TLS / mTLS and the
controlplane's API-key interceptor): TLS, client certificates, the bearer
key on every call, and mismatches (TLS vs plaintext, missing key) failing
at once with a KvloomError that says what to pass."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import grpc
import pytest

from kvloom.client import AsyncKvloomClient, InvalidArgument, KvloomClient, KvloomError
from kvloom_cli import main as cli
from tests.kvloom.conftest import API_KEY

FAST_S = 5.0  # a refused connection must fail at once, not wait for a timeout


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch):
    monkeypatch.delenv("KVLOOM_API_KEY", raising=False)


def _fails_fast(client) -> KvloomError:
    started = time.monotonic()
    with pytest.raises(KvloomError) as info:
        client.generate_text("hi")
    assert time.monotonic() - started < FAST_S
    return info.value


def test_tls_client_with_the_ca_and_key(secure_server, pki):
    server, servicer = secure_server(tls=True, api_key=API_KEY)
    with KvloomClient(server, ssl_ca_certs=pki.ca, api_key=API_KEY) as client:
        assert client.generate_text("hi").text == "abc"
        assert client.tokenize("hi").token_ids == [104, 105]
        assert client.abort("x") == 1
        assert client.model_info().model_name == "tiny"
        assert client.health() == "SERVING"
    assert servicer.requests[0].text == "hi"


def test_async_client_with_mtls_and_key(secure_server, pki):
    server, _ = secure_server(tls=True, mtls=True, api_key=API_KEY)

    async def scenario():
        async with AsyncKvloomClient(
                server, ssl_ca_certs=str(pki.ca), ssl_certfile=str(pki.client.certfile),
                ssl_keyfile=str(pki.client.keyfile), api_key=API_KEY) as client:
            assert (await client.generate_text("hi")).text == "abc"
            assert (await client.server_info()).num_ranks_attached == 2
        async with AsyncKvloomClient(server, ssl_ca_certs=str(pki.ca),
                                     api_key=API_KEY) as certless:
            with pytest.raises(KvloomError) as info:
                await certless.generate_text("hi")
            assert info.value.code == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())


def test_api_key_defaults_to_the_environment(secure_server, monkeypatch):
    server, _ = secure_server(tls=False, api_key=API_KEY)
    monkeypatch.setenv("KVLOOM_API_KEY", API_KEY)
    with KvloomClient(server) as client:
        assert client.generate_text("hi").text == "abc"
    with KvloomClient(server, api_key="") as keyless:  # "" = send none, whatever the env
        assert _fails_fast(keyless).code == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("key", [None, "wrong-key-123"], ids=["keyless", "wrong key"])
def test_missing_or_wrong_key_says_what_to_pass(secure_server, key):
    server, _ = secure_server(tls=False, api_key=API_KEY)
    with KvloomClient(server, api_key=key) as client:
        error = _fails_fast(client)
        assert error.code == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer <key>" in str(error)
        assert "--api-key" in str(error) and "KVLOOM_API_KEY" in str(error)
        assert "wrong-key-123" not in str(error)
        assert client.health() == "SERVING"  # probes need no key


def test_plaintext_client_to_a_tls_server_fails_fast(secure_server):
    server, _ = secure_server(tls=True)
    with KvloomClient(server) as client:
        error = _fails_fast(client)
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert "if it serves TLS, pass --ssl-ca-certs" in str(error)


def test_tls_client_to_a_plaintext_server_fails_fast(fake_server, pki):
    server, _ = fake_server
    with KvloomClient(server, ssl_ca_certs=pki.ca) as client:
        error = _fails_fast(client)
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert "the TLS handshake failed" in str(error)


@pytest.mark.parametrize("which", ["none", "other_client", "expired_client"])
def test_mtls_refusal_reaches_the_client_as_a_tls_error(secure_server, pki, which):
    server, _ = secure_server(tls=True, mtls=True)
    files = getattr(pki, which) if which != "none" else None
    with KvloomClient(server, ssl_ca_certs=pki.ca,
                      ssl_certfile=files and files.certfile,
                      ssl_keyfile=files and files.keyfile) as client:
        error = _fails_fast(client)
    assert error.code == grpc.StatusCode.UNAVAILABLE


def test_client_arguments_are_checked_before_connecting(pki, tmp_path):
    with pytest.raises(InvalidArgument, match="ssl_certfile and ssl_keyfile .* go together"):
        KvloomClient("127.0.0.1:1", ssl_certfile=pki.client.certfile)
    with pytest.raises(InvalidArgument, match="ssl_ca_certs .*absent.pem: cannot read it"):
        KvloomClient("127.0.0.1:1", ssl_ca_certs=tmp_path / "absent.pem")
    with pytest.raises(InvalidArgument, match="api_key must be visible ASCII") as info:
        KvloomClient("127.0.0.1:1", api_key="two words")
    assert "two words" not in str(info.value)


# ---- the CLI -----------------------------------------------------------------------


def test_cli_flags_reach_the_client(secure_server, pki, capsys):
    server, _ = secure_server(tls=True, mtls=True, api_key=API_KEY)
    tls = ["--server", server, "--ssl-ca-certs", str(pki.ca), "--ssl-certfile",
           str(pki.client.certfile), "--ssl-keyfile", str(pki.client.keyfile)]
    assert cli.main(["generate", "hi", *tls, "--api-key", API_KEY]) == 0
    assert capsys.readouterr().out == "abc\n"
    assert cli.main(["info", *tls, "--api-key", API_KEY]) == 0
    assert cli.main(["generate", "hi", *tls]) == 1
    err = capsys.readouterr().err
    assert "UNAUTHENTICATED" in err and "--api-key" in err
    assert cli.main(["health", *tls]) == 0  # health needs no key


def test_cli_reads_the_key_from_the_environment(secure_server, monkeypatch, capsys):
    server, _ = secure_server(tls=False, api_key=API_KEY)
    monkeypatch.setenv("KVLOOM_API_KEY", API_KEY)
    assert cli.main(["tokenize", "hi", "--server", server]) == 0
    assert capsys.readouterr().out == "104 105\n"


def test_cli_plaintext_to_tls_is_a_one_line_error(secure_server, capsys):
    server, _ = secure_server(tls=True)
    assert cli.main(["generate", "hi", "--server", server]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvloom: error: ") and "--ssl-ca-certs" in err


def test_cli_help_never_shows_the_env_key(monkeypatch, capsys):
    monkeypatch.setenv("KVLOOM_API_KEY", "s3cr3t-api-key")
    with pytest.raises(SystemExit):
        cli.parse_args(["generate", "--help"])
    out = capsys.readouterr().out
    assert "--api-key" in out and "--ssl-ca-certs" in out and "--ssl-certfile" in out
    assert "s3cr3t-api-key" not in out


def _imports_heavy(module: str) -> str:
    code = (f"import sys, {module}; "
            "bad = [m for m in ('cryptography', 'torch') if m in sys.modules]; "
            "sys.exit(str(bad) if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    return done.stderr if done.returncode else ""


def test_the_client_imports_neither_cryptography_nor_torch():
    """`pip install kvloom` (no server extra) has neither."""
    assert _imports_heavy("kvloom.client") == ""


def test_the_cli_imports_neither_cryptography_nor_torch():
    assert _imports_heavy("kvloom_cli.main") == ""

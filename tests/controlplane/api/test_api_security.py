"""The client API secured, in one process (service_harness.Api): TLS and mTLS
refusals, API keys on every kvloom.v1.Generation method with health open,
key reloads while serving, and tenants kept apart (request ids, Abort,
per-key limits, the prefix cache's cached_tokens). Start-up checks of the
TLS flags (api/tls.check_api_tls) are at the end."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from controlplane.api.auth import ApiKeys
from controlplane.api.tls import check_api_tls
from controlplane.config import ApiSecurityConfig
from kvloom.v1 import generation_pb2 as pb
from kvloom.v1 import generation_pb2_grpc
from tests.controlplane.api.service_harness import WAIT_S, drain, request, rpc_error, until

KEY_A = "tenant-a-key-0001"
KEY_B = "tenant-b-key-0002"
# A refused handshake must fail the call at once, never wait for a deadline.
FAST_S = 5.0


def bearer(key: str):
    return (("authorization", f"Bearer {key}"),)


def tls_config(pki, mtls: bool = False, **kw) -> ApiSecurityConfig:
    return ApiSecurityConfig(
        ssl_certfile=str(pki.server.certfile), ssl_keyfile=str(pki.server.keyfile),
        ssl_ca_certs=str(pki.ca) if mtls else "", **kw)


def client_credentials(ca, files=None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=files.keyfile.read_bytes() if files else None,
        certificate_chain=files.certfile.read_bytes() if files else None,
    )


async def generate_on(channel, metadata=None, **fields):
    stub = generation_pb2_grpc.GenerationStub(channel)
    call = stub.Generate(request(**fields), metadata=metadata, timeout=WAIT_S)
    return await drain(call)


async def refused_quickly(channel) -> grpc.aio.AioRpcError:
    started = time.monotonic()
    error = await rpc_error(generate_on(channel, sampling={"max_tokens": 2}))
    assert time.monotonic() - started < FAST_S
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    return error


# ---- TLS -------------------------------------------------------------------------


def test_tls_serves_a_tls_client_and_refuses_a_plaintext_one(api, pki):
    async def scenario():
        creds = client_credentials(pki.ca)
        async with api(api_security=tls_config(pki), channel_credentials=creds) as h:
            msgs = await h.generate(sampling={"max_tokens": 3})
            assert msgs[-1].finish.reason == pb.LENGTH
            async with grpc.aio.insecure_channel(h.address) as plain:
                await refused_quickly(plain)
            # A client that does not trust the server's CA refuses the server.
            async with grpc.aio.secure_channel(
                    h.address, client_credentials(pki.other_ca)) as distrustful:
                error = await refused_quickly(distrustful)
                assert "ssl" in error.details().lower() or "handshake" in error.details().lower()

    asyncio.run(scenario())


@pytest.mark.parametrize("client", ["none", "other_ca", "expired"])
def test_mtls_refuses_clients_without_a_valid_certificate(api, pki, client):
    async def scenario():
        good = client_credentials(pki.ca, pki.client)
        async with api(api_security=tls_config(pki, mtls=True), channel_credentials=good) as h:
            files = {"none": None, "other_ca": pki.other_client,
                     "expired": pki.expired_client}[client]
            async with grpc.aio.secure_channel(
                    h.address, client_credentials(pki.ca, files)) as channel:
                await refused_quickly(channel)
            # The server keeps serving the clients it trusts.
            msgs = await h.generate(sampling={"max_tokens": 2})
            assert msgs[-1].finish.reason == pb.LENGTH

    asyncio.run(scenario())


# ---- API keys ----------------------------------------------------------------------


def _every_method(stub, metadata):
    return [
        drain(stub.Generate(request(sampling={"max_tokens": 1}), metadata=metadata)),
        stub.Abort(pb.AbortRequest(), metadata=metadata),  # no ids: nothing to find
        stub.Tokenize(pb.TokenizeRequest(text="hi"), metadata=metadata),
        stub.Detokenize(pb.DetokenizeRequest(token_ids=[1]), metadata=metadata),
        stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata),
        stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=metadata),
    ]


@pytest.mark.parametrize("metadata", [None, bearer("not-a-key-of-ours")],
                         ids=["keyless", "wrong key"])
def test_every_generation_method_needs_a_key_and_health_stays_open(api, metadata, caplog):
    caplog.set_level(logging.WARNING, "controlplane.api.auth")

    async def scenario():
        async with api(api_keys=ApiKeys(env_key=KEY_A)) as h:
            for call in _every_method(h.stub, metadata):
                error = await rpc_error(call)
                assert error.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "authorization: Bearer <key>" in error.details()
                assert "not-a-key-of-ours" not in error.details()
            assert not h.added  # nothing reached the engine
            health = health_pb2_grpc.HealthStub(h.channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            # The right key opens every method.
            for call in _every_method(h.stub, bearer(KEY_A)):
                await call

    asyncio.run(scenario())
    # One line (rate-limited) names the refusal, never the key.
    assert "without a valid API key (UNAUTHENTICATED)" in caplog.text
    assert "not-a-key-of-ours" not in caplog.text and KEY_A not in caplog.text


def test_keys_and_mtls_together(api, pki):
    async def scenario():
        good = client_credentials(pki.ca, pki.client)
        async with api(api_security=tls_config(pki, mtls=True), channel_credentials=good,
                       api_keys=ApiKeys(env_key=KEY_A)) as h:
            error = await rpc_error(h.generate(sampling={"max_tokens": 1}))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            msgs = await generate_on(h.channel, bearer(KEY_A), sampling={"max_tokens": 2})
            assert msgs[-1].finish.reason == pb.LENGTH

    asyncio.run(scenario())


def test_a_reload_while_serving_adds_and_removes_keys(api, tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"{KEY_A}\n")

    async def scenario():
        keys = ApiKeys(str(path))
        async with api(api_keys=keys) as h:
            assert (await generate_on(h.channel, bearer(KEY_A), sampling={"max_tokens": 1}))
            error = await rpc_error(generate_on(h.channel, bearer(KEY_B)))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            path.write_text(f"{KEY_B}\n")
            assert keys.reload()
            assert (await generate_on(h.channel, bearer(KEY_B), sampling={"max_tokens": 1}))
            error = await rpc_error(generate_on(h.channel, bearer(KEY_A)))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(scenario())


# ---- tenants ----------------------------------------------------------------------


@pytest.fixture
def two_tenants(tmp_path):
    """Api keywords for a server that accepts KEY_A and KEY_B, with these flags."""
    path = tmp_path / "keys"
    path.write_text(f"{KEY_A}\n{KEY_B}\n")

    def make(**security) -> dict:
        return {"api_keys": ApiKeys(str(path)), "api_security": ApiSecurityConfig(**security)}

    return make


def test_two_tenants_may_use_the_same_request_id(api, two_tenants):
    async def scenario():
        async with api(**two_tenants()) as h:
            h.model.hold()
            first = h.stub.Generate(request(request_id="a", sampling={"max_tokens": 3}),
                                    metadata=bearer(KEY_A))
            await until(lambda: h.in_flight("a"))
            second = h.stub.Generate(request(request_id="a", sampling={"max_tokens": 3}),
                                     metadata=bearer(KEY_B))
            await until(lambda: len(h.service.in_flight.held_keys()) == 2)
            # The same tenant may not reuse an id still in flight.
            error = await rpc_error(generate_on(h.channel, bearer(KEY_A), request_id="a"))
            assert error.code() == grpc.StatusCode.ALREADY_EXISTS
            h.model.release()
            for call in (first, second):
                msgs = await asyncio.wait_for(drain(call), WAIT_S)
                assert msgs[-1].finish.reason == pb.LENGTH
                assert all(m.request_id == "a" for m in msgs)

    asyncio.run(scenario())


def test_a_tenant_cannot_abort_or_detect_anothers_request(api, two_tenants):
    async def scenario():
        async with api(**two_tenants()) as h:
            h.model.hold()
            call = h.stub.Generate(request(request_id="a", sampling={"max_tokens": 3}),
                                   metadata=bearer(KEY_A))
            await until(lambda: h.in_flight("a"))
            # B's answer for A's id is the answer for an id never sent: NOT_FOUND.
            errors = []
            for ids in (["a"], ["never-sent"]):
                errors.append(await rpc_error(h.stub.Abort(pb.AbortRequest(request_ids=ids),
                                                           metadata=bearer(KEY_B))))
            assert [(e.code(), e.details()) for e in errors] == [
                (grpc.StatusCode.NOT_FOUND, errors[0].details())] * 2
            assert "in flight for this API key" in errors[0].details()
            h.model.release()
            msgs = await asyncio.wait_for(drain(call), WAIT_S)
            assert msgs[-1].finish.reason == pb.LENGTH
            assert sum(len(m.token_ids) for m in msgs) == 3
            # Its owner can abort it.
            h.model.hold()
            call = h.stub.Generate(request(request_id="b", sampling={"max_tokens": 30}),
                                   metadata=bearer(KEY_A))
            await until(lambda: h.in_flight("b"))
            reply = await h.stub.Abort(pb.AbortRequest(request_ids=["b"]),
                                       metadata=bearer(KEY_A))
            assert reply.num_aborted == 1
            h.model.release()
            msgs = await asyncio.wait_for(drain(call), WAIT_S)
            assert msgs[-1].finish.reason == pb.ABORT

    asyncio.run(scenario())


def test_max_requests_per_key(api, two_tenants):
    async def scenario():
        async with api(**two_tenants(max_requests_per_key=2)) as h:
            h.model.hold()
            held = h.stub.Generate(request(request_id="a", sampling={"max_tokens": 3, "n": 2}),
                                   metadata=bearer(KEY_A))
            await until(lambda: h.in_flight("a"))
            error = await rpc_error(generate_on(h.channel, bearer(KEY_A), request_id="c"))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-requests-per-key" in error.details()
            error = await rpc_error(generate_on(h.channel, bearer(KEY_B),
                                                sampling={"n": 3}))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            other = h.stub.Generate(request(request_id="a", sampling={"max_tokens": 3}),
                                    metadata=bearer(KEY_B))
            await until(lambda: len(h.service.in_flight.held_keys()) == 2)
            h.model.release()
            for call in (held, other):
                assert (await asyncio.wait_for(drain(call), WAIT_S))[-1].finish.reason == \
                    pb.LENGTH
            # The slots came back.
            assert (await generate_on(h.channel, bearer(KEY_A), sampling={"max_tokens": 1}))
            assert h.service.in_flight.samples_per_tenant() == {}

    asyncio.run(scenario())


# 12 tokens: the 2 full blocks before the last token can come from the cache.
SHARED_PROMPT = list(range(100, 112))


async def cached_tokens(h, key, **fields) -> int:
    msgs = await generate_on(h.channel, bearer(key), token_ids=SHARED_PROMPT,
                             sampling={"max_tokens": 1}, **fields)
    return msgs[-1].finish.cached_tokens


@pytest.mark.parametrize("scope", ["key", "global"])
def test_cached_tokens_reveal_nothing_across_keys(api, two_tenants, scope):
    async def scenario():
        async with api(**two_tenants(prefix_cache_scope=scope)) as h:
            assert await cached_tokens(h, KEY_A) == 0
            assert await cached_tokens(h, KEY_A) > 0  # A's own prefix is cached
            b = await cached_tokens(h, KEY_B)
            # A salt B picks cannot reach A's blocks either.
            salted = await cached_tokens(h, KEY_B, cache_salt="x")
            if scope == "key":
                assert b == 0 and salted == 0
            else:
                assert b > 0 and salted == 0
            salts = {r.cache_salt for r in h.added}
            assert len(salts) == (3 if scope == "key" else 2)

    asyncio.run(scenario())


def _vllm_generate(channel, metadata=None):
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    req = vpb.GenerateRequest(request_id="g/1", tokenized=vpb.TokenizedInput(input_ids=[5, 6]),
                              sampling_params=vpb.SamplingParams(max_tokens=2))
    return drain(stub.Generate(req, metadata=metadata, timeout=WAIT_S))


@pytest.mark.parametrize("auth", ["api-key", "client-certificate"])
def test_vllm_engine_needs_a_key_unless_the_client_certificate_admits_it(api, pki, auth):
    async def scenario():
        good = client_credentials(pki.ca, pki.client)
        async with api(api_security=tls_config(pki, mtls=True, vllm_engine_auth=auth),
                       channel_credentials=good, api_keys=ApiKeys(env_key=KEY_A)) as h:
            keyed = await _vllm_generate(h.channel, bearer(KEY_A))
            assert keyed[-1].complete.finish_reason == "length"
            if auth == "api-key":
                error = await rpc_error(_vllm_generate(h.channel))
                assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            else:  # the gateway's case: its certificate is the credential
                assert (await _vllm_generate(h.channel))[-1].complete.finish_reason == "length"
            # kvloom.v1 needs its key either way.
            error = await rpc_error(h.generate(sampling={"max_tokens": 1}))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(scenario())


# ---- start-up checks of the TLS flags ----------------------------------------------


def test_check_api_tls(pki, tmp_path):
    ok = tls_config(pki, mtls=True)
    assert check_api_tls(ok) is None
    assert check_api_tls(ApiSecurityConfig()) is None
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cases = {
        dataclasses.replace(ok, ssl_keyfile=""): "--ssl-certfile .*server.crt needs --ssl-keyfile",
        dataclasses.replace(ok, ssl_certfile=""): "--ssl-keyfile .*server.key needs --ssl-certfile",
        ApiSecurityConfig(ssl_ca_certs=str(pki.ca)): "--ssl-ca-certs needs --ssl-certfile",
        dataclasses.replace(ok, ssl_certfile=str(tmp_path / "absent.crt")):
            "--ssl-certfile .*absent.crt: cannot read it",
        dataclasses.replace(ok, ssl_ca_certs=str(tmp_path / "absent.crt")):
            "--ssl-ca-certs .*absent.crt: cannot read it",
        dataclasses.replace(ok, ssl_keyfile=str(pki.client.keyfile)):
            "not a PEM certificate and its matching private key",
        dataclasses.replace(ok, ssl_ca_certs=str(garbage)): "--ssl-ca-certs .*not a PEM CA",
        # VllmEngine without a key is only ever behind a client certificate.
        tls_config(pki, vllm_engine_auth="client-certificate"):
            "--vllm-engine-auth client-certificate needs mTLS",
        ApiSecurityConfig(vllm_engine_auth="client-certificate"):
            "--vllm-engine-auth client-certificate needs mTLS",
    }
    assert check_api_tls(dataclasses.replace(ok, vllm_engine_auth="client-certificate")) is None
    for cfg, problem in cases.items():
        assert re.search(problem, check_api_tls(cfg) or ""), (cfg, check_api_tls(cfg))

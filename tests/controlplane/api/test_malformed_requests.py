"""Bytes that are no valid request message get INVALID_ARGUMENT naming the
problem (not grpc's UNKNOWN with a Python exception), on unary and streaming
methods alike, and well-formed requests pass through untouched."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from controlplane.api.malformed_requests import MalformedRequestInterceptor
from kvloom.v1 import generation_pb2 as pb
from kvloom.v1 import generation_pb2_grpc

GENERATE = "/kvloom.v1.Generation/Generate"
ABORT = "/kvloom.v1.Generation/Abort"
HEALTH = "/grpc.health.v1.Health/Check"

BAD_UTF8_TEXT = b"\x12\x02\xff\xfe"  # field 2 (text): two bytes that are not UTF-8
BAD_UTF8_ID = b"\x0a\x01\x80"  # field 1 (request_id)
CORRUPT = b"\x12\x05ab"  # a length past the end


class Echo(generation_pb2_grpc.GenerationServicer):
    def __init__(self):
        self.closed = 0

    async def Generate(self, request, context):
        try:
            for word in request.text.split():
                yield pb.GenerateResponse(request_id=request.request_id, text=word)
        finally:
            self.closed += 1

    async def Abort(self, request, context):
        return pb.AbortResponse(num_aborted=len(request.request_ids))


async def _with_server(scenario, interceptors):
    servicer = Echo()
    server = grpc.aio.server(interceptors=interceptors)
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            return await scenario(channel, servicer)
    finally:
        await server.stop(0)


def _raw_stream(channel, method):
    return channel.unary_stream(method, request_serializer=lambda b: b,
                                response_deserializer=pb.GenerateResponse.FromString)


def _raw_unary(channel, method, response):
    return channel.unary_unary(method, request_serializer=lambda b: b,
                               response_deserializer=response.FromString)


async def _statuses(channel, servicer):
    out = {}
    for name, raw in (("text", BAD_UTF8_TEXT), ("id", BAD_UTF8_ID), ("corrupt", CORRUPT)):
        try:
            [m async for m in _raw_stream(channel, GENERATE)(raw)]
            out[name] = (grpc.StatusCode.OK, "")
        except grpc.aio.AioRpcError as exc:
            out[name] = (exc.code(), exc.details())
    for method, response in ((ABORT, pb.AbortResponse),
                             (HEALTH, health_pb2.HealthCheckResponse)):
        try:
            await _raw_unary(channel, method, response)(BAD_UTF8_ID)
            out[method] = (grpc.StatusCode.OK, "")
        except grpc.aio.AioRpcError as exc:
            out[method] = (exc.code(), exc.details())
    good = pb.GenerateRequest(request_id="r", text="a b").SerializeToString()
    out["good"] = [m.text async for m in _raw_stream(channel, GENERATE)(good)]
    out["abort"] = (await _raw_unary(channel, ABORT, pb.AbortResponse)(
        pb.AbortRequest(request_ids=["a", "b"]).SerializeToString())).num_aborted
    out["closed"] = servicer.closed
    return out


def test_malformed_bytes_are_invalid_argument_naming_the_problem():
    out = asyncio.run(_with_server(_statuses, [MalformedRequestInterceptor()]))
    for key in ("text", "id", "corrupt", ABORT, HEALTH):
        code, details = out[key]
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (key, code, details)
        assert "no valid request message" in details and "UTF-8" in details
    assert "bad UTF-8" in out["text"][1] and GENERATE in out["text"][1]
    assert "corrupt" in out["corrupt"][1]
    # Well-formed requests are untouched; the handler's generator was closed.
    assert out["good"] == ["a", "b"] and out["abort"] == 2 and out["closed"] == 1


def test_without_the_interceptor_grpc_says_unknown():
    """Why the interceptor exists (this fails if grpc ever maps it itself)."""
    out = asyncio.run(_with_server(_statuses, []))
    assert out["text"][0] == grpc.StatusCode.UNKNOWN

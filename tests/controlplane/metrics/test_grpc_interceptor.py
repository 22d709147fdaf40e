"""The gRPC metrics interceptor on a real grpc.aio server over loopback: each
call is counted once with the status it really ended with (OK, an abort's
code, a client cancel, a deadline), and unknown methods share one label."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from controlplane.metrics.grpc_interceptor import UNKNOWN_METHOD, GrpcMetricsInterceptor

SERVICE = "test.Stream"


async def _count(request, context):
    """Streams `request[0]` messages; 0 aborts with INVALID_ARGUMENT."""
    n = request[0]
    if n == 0:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "zero")
    for i in range(n):
        yield bytes([i % 256])
        await asyncio.sleep(0.05)


def _stream_handler():
    method = grpc.unary_stream_rpc_method_handler(_count)
    return grpc.method_handlers_generic_handler(SERVICE, {"Count": method})


async def _run_calls():
    seen: list[tuple[str, str]] = []
    server = grpc.aio.server(interceptors=[GrpcMetricsInterceptor(
        lambda method, code: seen.append((method, code)))])
    servicer = health.aio.HealthServicer()
    await servicer.set("up", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((_stream_handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            await stub.Check(health_pb2.HealthCheckRequest(service="up"))
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
            count = ch.unary_stream(f"/{SERVICE}/Count")
            assert len([m async for m in count(bytes([3]))]) == 3
            with pytest.raises(grpc.aio.AioRpcError):
                _ = [m async for m in count(bytes([0]))]
            call = count(bytes([100]))
            await call.read()
            call.cancel()
            with pytest.raises(grpc.aio.AioRpcError):
                _ = [m async for m in count(bytes([100]), timeout=0.2)]
            with pytest.raises(grpc.aio.AioRpcError):
                await ch.unary_unary("/no.Such/Method")(b"")
            # The server learns of the cancel and the deadline asynchronously.
            for _ in range(50):
                if len(seen) >= 7:
                    break
                await asyncio.sleep(0.05)
    finally:
        await server.stop(None)
    return seen


def test_calls_are_counted_with_their_final_status():
    seen = asyncio.run(_run_calls())
    check = "/grpc.health.v1.Health/Check"
    count = f"/{SERVICE}/Count"
    assert sorted(seen) == sorted([
        (check, "OK"),
        (check, "NOT_FOUND"),
        (count, "OK"),
        (count, "INVALID_ARGUMENT"),
        (count, "CANCELLED"),
        (count, "DEADLINE_EXCEEDED"),
        (UNKNOWN_METHOD, "UNIMPLEMENTED"),
    ])

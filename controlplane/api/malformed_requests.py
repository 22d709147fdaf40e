"""Malformed request bytes are INVALID_ARGUMENT, not UNKNOWN.

grpc parses a request before any handler runs; bytes that are no valid
message (a string field that is not UTF-8, a corrupt wire format) make its
deserializer raise, and grpc answers UNKNOWN with a Python exception in the
details. This server interceptor swaps each unary-request method's
deserializer for one that returns a Malformed marker instead, and the
method's behaviour refuses the marker with INVALID_ARGUMENT saying what was
wrong. Methods with streamed requests (reflection) keep their own
deserializer: none of the client API streams requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from controlplane.api.handler_wrap import relay_stream, rewrap, run_unary


@dataclass(frozen=True)
class Malformed:
    reason: str


def _safe(deserializer):
    if deserializer is None:
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError and anything a parser may raise
            return Malformed(str(exc) or type(exc).__name__)

    return parse


def _refusal(method: str, malformed: Malformed) -> str:
    return (
        f"the request bytes are no valid request message of {method} "
        f"({malformed.reason[:200]}): string fields must be UTF-8; build the message "
        f"from the published protos"
    )


def _wrap_unary(behavior, method: str):
    async def wrapped(request, context):
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refusal(method, request))
        return await run_unary(behavior, request, context)

    return wrapped


def _wrap_stream(behavior, method: str):
    async def wrapped(request, context):
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refusal(method, request))
        async with relay_stream(behavior, request, context) as items:
            async for item in items:
                yield item

    return wrapped


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method
        return rewrap(handler, lambda b: _wrap_unary(b, method),
                      lambda b: _wrap_stream(b, method), _safe(handler.request_deserializer))

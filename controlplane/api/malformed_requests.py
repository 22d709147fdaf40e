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

import inspect
from dataclasses import dataclass

import grpc


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
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result

    return wrapped


def _wrap_stream(behavior, method: str):
    async def wrapped(request, context):
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refusal(method, request))
        result = behavior(request, context)
        try:
            if hasattr(result, "__aiter__"):
                async for item in result:
                    yield item
            elif inspect.isawaitable(result):
                await result  # a handler that writes with context.write()
            else:
                for item in result:
                    yield item
        finally:
            # Close the handler's generator now, so its own finally (e.g.
            # Generate releasing its request) runs at once, not at GC time.
            if hasattr(result, "aclose"):
                await result.aclose()

    return wrapped


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method
        parse = _safe(handler.request_deserializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method), parse, handler.response_serializer)
        return grpc.unary_stream_rpc_method_handler(
            _wrap_stream(handler.unary_stream, method), parse, handler.response_serializer)

"""Wrapping a grpc.aio method handler's behaviour, for the server
interceptors (malformed requests, API keys, gRPC metrics): run a unary
behaviour whether it returns a value or an awaitable, relay a streaming one
whether it is an async generator, an awaitable that writes with
context.write() or a plain iterable, and rebuild the handler around the
wrappers. The relay closes the handler's generator as soon as the call ends,
so its own finally (e.g. Generate releasing its request) runs at once, not at
garbage collection.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Callable

import grpc


async def run_unary(behavior, request, context):
    result = behavior(request, context)
    return await result if inspect.isawaitable(result) else result


async def _relay(result) -> AsyncIterator:
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
        if hasattr(result, "aclose"):
            await result.aclose()


def relay_stream(behavior, request, context) -> contextlib.aclosing:
    """`async with relay_stream(...) as items: async for item in items: yield item`
    (aclosing: an outer generator closed early closes this one, and the handler's)."""
    return contextlib.aclosing(_relay(behavior(request, context)))


def rewrap(handler, unary: Callable, stream: Callable,
           request_deserializer=None) -> grpc.RpcMethodHandler:
    """handler with its behaviour passed through unary (unary responses) or
    stream (streamed responses); request_deserializer replaces its own."""
    des = request_deserializer or handler.request_deserializer
    ser = handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), des, ser)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(stream(handler.unary_stream), des, ser)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), des, ser)
    return grpc.stream_stream_rpc_method_handler(stream(handler.stream_stream), des, ser)

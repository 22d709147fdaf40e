"""Counts client API calls by method and final status code.

A grpc.aio server interceptor wraps each registered method's behaviour and
reports (method, code) once per call when the call ends, however it ends:
returned (OK, or whatever set_code() said), context.abort() (its code),
cancelled by the client or by its deadline, or a handler bug (UNKNOWN).
Methods the server does not implement are counted under one "unknown"
label so a scanner cannot grow label cardinality.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from controlplane.api.handler_wrap import relay_stream, rewrap, run_unary

UNKNOWN_METHOD = "unknown"
_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def status_name(context, exc: BaseException | None) -> str:
    """The status a call ended with, as grpc.StatusCode's name."""
    code = context.code()
    if isinstance(code, int):
        code = _BY_VALUE.get(code)
    if isinstance(code, grpc.StatusCode):
        return code.name
    if exc is None:
        return "OK"
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        remaining = context.time_remaining()
        expired = remaining is not None and remaining <= 0
        return "DEADLINE_EXCEEDED" if expired else "CANCELLED"
    return "UNKNOWN"


class GrpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, record: Callable[[str, str], None]):
        # record(method, code), e.g. ("/kvloom.v1.Generation/Generate", "OK").
        self._record = record

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            self._record(UNKNOWN_METHOD, grpc.StatusCode.UNIMPLEMENTED.name)
            return None
        method = handler_call_details.method
        record = self._record
        return rewrap(handler, lambda b: _wrap_unary(b, method, record),
                      lambda b: _wrap_stream(b, method, record))


def _wrap_unary(behavior, method: str, record):
    async def wrapped(request, context):
        exc: BaseException | None = None
        try:
            return await run_unary(behavior, request, context)
        except BaseException as e:
            exc = e
            raise
        finally:
            record(method, status_name(context, exc))

    return wrapped


def _wrap_stream(behavior, method: str, record):
    async def wrapped(request, context):
        exc: BaseException | None = None
        try:
            async with relay_stream(behavior, request, context) as items:
                async for item in items:
                    yield item
        except BaseException as e:
            exc = e
            raise
        finally:
            record(method, status_name(context, exc))

    return wrapped

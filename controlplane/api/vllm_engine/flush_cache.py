"""FlushCache: forget the prefix cache without preempting anyone (vLLM's
reset_prefix_cache behind the gateway's /flush_cache).

The reset itself runs on the engine thread (EngineCore.reset_prefix_cache)
and succeeds only when no request holds a KV block, since a held block's KV
stays valid for its owner. timeout_s 0 tries once; more retries every
RETRY_INTERVAL_S until the engine goes idle or the time is up. The answer
says why it failed; the gateway reports it per worker. Its cleared event
reaches subscribers like any other (kv_events.py).
"""

from __future__ import annotations

import asyncio
import math

import grpc
from smg_grpc_proto.generated import common_pb2

from controlplane.engine.core import EngineCore

# Longest wait a caller may ask for; a bound so that no call parks a handler
# for ever (vLLM sets none).
MAX_TIMEOUT_S = 300.0
RETRY_INTERVAL_S = 0.05
# The engine reads its input between two steps; no answer in this long means
# it is stuck or stopping, which the caller hears instead of hanging.
ENGINE_ANSWER_S = 5.0


async def flush_cache(engine: EngineCore, request: common_pb2.FlushCacheRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.FlushCacheResponse:
    timeout_s = request.timeout_s
    if not (math.isfinite(timeout_s) and 0.0 <= timeout_s <= MAX_TIMEOUT_S):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"timeout_s must be a finite number of seconds in [0, {MAX_TIMEOUT_S:g}], "
            f"got {timeout_s}")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            done = await asyncio.wait_for(asyncio.wrap_future(engine.reset_prefix_cache()),
                                          ENGINE_ANSWER_S)
        except TimeoutError:
            return common_pb2.FlushCacheResponse(
                success=False, message=f"the engine did not answer within {ENGINE_ANSWER_S:g} s")
        if done:
            return common_pb2.FlushCacheResponse(success=True, message="prefix cache flushed")
        if loop.time() + RETRY_INTERVAL_S > deadline:
            return common_pb2.FlushCacheResponse(success=False,
                                                 message=_why_not(engine, timeout_s))
        await asyncio.sleep(RETRY_INTERVAL_S)


def _why_not(engine: EngineCore, timeout_s: float) -> str:
    # Read off the engine's snapshot, so it may lag the refusal by a step.
    if engine.scheduler is None:
        return "worker group not ready"
    stats = engine.last_stats
    running = stats.num_running_reqs if stats is not None else 0
    held = f"{running} requests hold KV blocks" if running else "KV blocks are in use"
    return held if timeout_s == 0 else f"{held} after waiting {timeout_s:g} s"

"""The producer's KVTransfer service (kvloom.kvtransfer.v1), on the API port.

Consumers' controlplanes ask it for this cluster's KV layout and NIXL agents
(the handshake), renew the leases of prefills they will read, and release
them once read. Leases live on the engine thread (core/kv_leases.py): each
call crosses over with EngineCore.call and waits for its answer. Every list
a consumer sends is bounded, and a lease id this producer never issued is
simply not held: nothing a consumer says can free blocks it was not given.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from controlplane.core.scheduler import Scheduler
from kvloom.kvtransfer.v1 import kv_transfer_pb2 as pb
from kvloom.kvtransfer.v1 import kv_transfer_pb2_grpc

# Leases one call may name (a consumer renews those of its waiting requests).
MAX_LEASE_IDS = 4096
MAX_LEASE_ID_LEN = 128
# The engine thread answers between steps; a wedged one must not hang callers.
ENGINE_CALL_TIMEOUT_S = 30.0


class KVTransferService(kv_transfer_pb2_grpc.KVTransferServicer):
    def __init__(self, engine, engine_id: str, layout: Callable[[], pb.KVEngineLayout | None],
                 lease_s: float) -> None:
        self.engine = engine
        self.engine_id = engine_id
        self._layout = layout
        self.lease_s = lease_s

    async def GetEngineLayout(self, request, context):
        await self._check_engine(request.engine_id, context)
        layout = self._layout()
        if layout is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"engine {self.engine_id}: the worker group is not ready")
        return layout

    async def RenewLeases(self, request, context):
        ids = await self._lease_ids(request, context)
        # Not through the engine thread, which may be in a long prefill step
        # (KVLeases.renew takes the record's lock).
        scheduler = self.engine.scheduler
        found = scheduler.kv_leases.renew(ids) if _leases(scheduler) else None
        layout = self._layout()
        reply = pb.LeasesReply(lease_s=self.lease_s,
                               group_epoch=layout.group_epoch if layout is not None else 0)
        for held, block_ids, num_tokens in found or [(False, [], 0)] * len(ids):
            reply.held.append(held)
            reply.leases.add(block_ids=block_ids, num_tokens=num_tokens)
        return reply

    async def ReleaseLeases(self, request, context):
        ids = await self._lease_ids(request, context)
        held = await self._on_engine(
            lambda s: s.kv_leases.release(s.kv_cache_manager, ids) if _leases(s) else None,
            context)
        return pb.LeasesReply(held=held or [False] * len(ids), lease_s=self.lease_s)

    async def _check_engine(self, engine_id: str, context) -> None:
        if engine_id != self.engine_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"engine_id {engine_id[:80]!r} is not this producer's "
                                f"({self.engine_id!r}): the transfer parameters name another "
                                f"engine")

    async def _lease_ids(self, request, context) -> list[str]:
        await self._check_engine(request.engine_id, context)
        ids = list(request.lease_ids)
        if len(ids) > MAX_LEASE_IDS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"lease_ids has {len(ids)} ids; at most {MAX_LEASE_IDS}")
        if any(len(i) > MAX_LEASE_ID_LEN for i in ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"a lease id is longer than {MAX_LEASE_ID_LEN} characters")
        return ids

    async def _on_engine(self, fn: Callable[[Scheduler], object], context):
        try:
            return await asyncio.wait_for(asyncio.wrap_future(self.engine.call(fn)),
                                          ENGINE_CALL_TIMEOUT_S)
        except TimeoutError:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the engine did not answer within "
                                f"{ENGINE_CALL_TIMEOUT_S:g} s")


def _leases(scheduler: Scheduler | None) -> bool:
    return scheduler is not None and scheduler.kv_leases is not None

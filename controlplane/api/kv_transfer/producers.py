"""The consumer's client of its producers' KVTransfer services.

A decode leg is admitted only after this has checked its parameters against
the producer itself (prepare): the lease is still held and holds exactly the
blocks named (RenewLeases, which also says the producer's group epoch), the
producer's layout is known for that epoch (GetEngineLayout, cached per
engine and epoch) and compatible with this cluster's (model shape, KV dtype,
block size: a mismatch is refused naming the field). Then the request
carries a RemotePrefill and the scheduler reads it (core/kv_remote.py).

While such requests wait, their leases are renewed every third of the
producer's lease (vLLM's heartbeat); once the scheduler is done with one
(read, or never will be) it is released, off the engine thread. A producer
that cannot be reached, or no longer holds the lease, costs a prefill here
under the recompute policy (the request runs as if it had no parameters)
and ends the request with UNAVAILABLE under `fail`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from controlplane.api.kv_transfer.params import FIELD, DecodeLeg
from controlplane.api.validation import InvalidRequest
from controlplane.core.kv_remote import RemotePrefill
from controlplane.core.kv_transfer_config import KVTransferConfig
from kvloom.kvtransfer.v1 import kv_transfer_pb2 as pb
from kvloom.kvtransfer.v1 import kv_transfer_pb2_grpc

logger = logging.getLogger(__name__)

# Fields a producer's layout must share with this cluster's.
COMPATIBILITY = ("model_architecture", "num_layers", "total_num_kv_heads", "head_dim",
                 "kv_cache_dtype", "block_size")
# Producers one consumer keeps channels and layouts for.
MAX_PRODUCERS = 64
# How often the heartbeat looks for leases due for renewal.
RENEW_POLL_S = 0.25


class ProducerUnavailable(Exception):
    """The fail policy's refusal: the producer cannot serve this leg."""


@dataclass(slots=True)
class _Producer:
    address: str
    stub: kv_transfer_pb2_grpc.KVTransferStub
    channel: grpc.aio.Channel
    layout: pb.KVEngineLayout | None = None
    lease_s: float = 30.0
    # Loop time of the heartbeat's last renewal of its leases.
    renewed_at: float = 0.0


class RemoteProducers:
    def __init__(self, config: KVTransferConfig, own: Callable[[], pb.KVEngineLayout]) -> None:
        """own: this cluster's layout facts (the COMPATIBILITY fields)."""
        self.config = config
        self._own = own
        self._producers: dict[str, _Producer] = {}
        # (engine id, lease id) of requests that wait to read: renewed.
        self._renewing: set[tuple[str, str]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._heartbeat: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        # Cumulative, for metrics and tests: legs that fell back to a prefill
        # here, and leases released.
        self.num_fallbacks = 0
        self.num_released = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._heartbeat = loop.create_task(self._renew_forever())

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        for task in list(self._tasks):
            await asyncio.wait([task], timeout=2)
        for producer in self._producers.values():
            await producer.channel.close()
        self._producers.clear()

    # ---- admission ---------------------------------------------------------

    async def prepare(self, leg: DecodeLeg) -> RemotePrefill | None:
        """The checked RemotePrefill of a decode leg; None to prefill it here
        (recompute policy). Raises InvalidRequest (bad parameters) or
        ProducerUnavailable (the fail policy)."""
        producer = self._producer(leg)
        timeout = self.config.handshake_timeout_s
        try:
            renewed = await producer.stub.RenewLeases(
                pb.LeasesRequest(engine_id=leg.engine_id, lease_ids=[leg.lease_id]),
                timeout=timeout)
            if not renewed.held or not renewed.held[0]:
                return self._fallback(leg, "the producer no longer holds its blocks")
            producer.lease_s = renewed.lease_s or producer.lease_s
            if producer.layout is None or producer.layout.group_epoch != renewed.group_epoch:
                producer.layout = await producer.stub.GetEngineLayout(
                    pb.GetEngineLayoutRequest(engine_id=leg.engine_id), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequest(f"{FIELD}.remote_engine_id: the producer at "
                                     f"{leg.address} refused it: {exc.details()}") from None
            return self._fallback(leg, f"{exc.code().name}: {exc.details()}")
        held = renewed.leases[0]
        if list(held.block_ids) != list(leg.block_ids) or leg.num_tokens > held.num_tokens:
            raise InvalidRequest(f"{FIELD}.remote_block_ids: the producer does not hold these "
                                 f"blocks for remote_request_id")
        self._check_compatible(producer.layout, leg)
        self._renewing.add((leg.engine_id, leg.lease_id))
        return RemotePrefill(leg.engine_id, producer.layout, leg.lease_id, leg.block_ids,
                             leg.num_tokens)

    def _producer(self, leg: DecodeLeg) -> _Producer:
        producer = self._producers.get(leg.engine_id)
        if producer is not None and producer.address != leg.address:
            raise InvalidRequest(f"{FIELD}.remote_host/remote_port: engine {leg.engine_id!r} "
                                 f"is at {producer.address}, not {leg.address}")
        if producer is None:
            if len(self._producers) >= MAX_PRODUCERS:
                raise InvalidRequest(f"{FIELD}.remote_engine_id: this consumer already reads "
                                     f"from {MAX_PRODUCERS} producers")
            channel = grpc.aio.insecure_channel(leg.address)
            producer = _Producer(leg.address, kv_transfer_pb2_grpc.KVTransferStub(channel),
                                 channel)
            self._producers[leg.engine_id] = producer
        return producer

    def _check_compatible(self, theirs: pb.KVEngineLayout, leg: DecodeLeg) -> None:
        ours = self._own()
        for name in COMPATIBILITY:
            mine, other = getattr(ours, name), getattr(theirs, name)
            if mine != other:
                raise InvalidRequest(f"{FIELD}: producer {leg.engine_id!r} cannot feed this "
                                     f"consumer: its {name} is {other!r}, here {mine!r}")
        if leg.tp_size != theirs.tensor_parallel_size:
            raise InvalidRequest(f"{FIELD}.tp_size is {leg.tp_size}, but the producer runs "
                                 f"TP={theirs.tensor_parallel_size}")

    def _fallback(self, leg: DecodeLeg, why: str) -> None:
        if self.config.kv_load_failure_policy == "fail":
            raise ProducerUnavailable(f"producer {leg.engine_id!r} at {leg.address}: {why} "
                                      f"(kv_load_failure_policy fail)")
        self.num_fallbacks += 1
        logger.warning("decode leg from producer %s at %s prefills here instead: %s",
                       leg.engine_id, leg.address, why)
        return None

    # ---- leases ------------------------------------------------------------

    def release_threadsafe(self, engine_id: str, lease_id: str) -> None:
        """The scheduler is done with a lease (engine thread): release it."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._release, engine_id, lease_id)

    def _release(self, engine_id: str, lease_id: str) -> None:
        self._renewing.discard((engine_id, lease_id))
        producer = self._producers.get(engine_id)
        if producer is None:
            return
        task = asyncio.ensure_future(self._call_leases(
            producer, producer.stub.ReleaseLeases, engine_id, [lease_id]))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self.num_released += 1

    async def _renew_forever(self) -> None:
        """Each producer's waiting leases, every third of its lease (checked
        every RENEW_POLL_S, so a short lease is renewed in time too)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(RENEW_POLL_S)
            by_engine: dict[str, list[str]] = defaultdict(list)
            for engine_id, lease_id in self._renewing:
                by_engine[engine_id].append(lease_id)
            for engine_id, lease_ids in by_engine.items():
                producer = self._producers[engine_id]
                if loop.time() - producer.renewed_at < producer.lease_s / 3:
                    continue
                producer.renewed_at = loop.time()
                await self._call_leases(producer, producer.stub.RenewLeases, engine_id,
                                        lease_ids)

    async def _call_leases(self, producer: _Producer, method, engine_id: str,
                           lease_ids: list[str]) -> None:
        try:
            await method(pb.LeasesRequest(engine_id=engine_id, lease_ids=lease_ids),
                         timeout=self.config.handshake_timeout_s)
        except grpc.aio.AioRpcError as exc:
            # The producer's lease runs out by itself; nothing is lost here.
            logger.warning("a lease call to producer %s at %s failed: %s", engine_id,
                           producer.address, exc.code().name)

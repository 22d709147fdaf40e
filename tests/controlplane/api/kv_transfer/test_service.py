"""The producer's KVTransfer service and the consumer's client of it over a
real gRPC channel on loopback, with the producer's scheduler in this
process: a decode leg is admitted only for a lease the producer holds with
exactly the blocks named, from a compatible producer; a producer gone, or
a lease it let go, costs a prefill (recompute) or the request (fail);
releases and renewals reach the producer; hostile calls are refused."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import grpc
import pytest

from controlplane.api.kv_transfer.params import DecodeLeg
from controlplane.api.kv_transfer.producers import ProducerUnavailable, RemoteProducers
from controlplane.api.kv_transfer.service import MAX_LEASE_IDS, KVTransferService
from controlplane.api.validation import InvalidRequest
from controlplane.core.kv_transfer_config import KVTransferConfig
from kvloom.common.ports import free_port
from kvloom.kvtransfer.v1 import kv_transfer_pb2 as pb
from kvloom.kvtransfer.v1 import kv_transfer_pb2_grpc
from tests.controlplane.core.test_kv_transfer import _prefill_leg, _producer

FACTS = dict(model_architecture="LlamaForCausalLM", num_layers=4, total_num_kv_heads=2,
             kv_cache_dtype="float32", block_size=4)


class InlineEngine:
    """EngineCore.call, run at once on the caller's thread."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler

    def call(self, fn) -> Future:
        future: Future = Future()
        future.set_result(fn(self.scheduler))
        return future


class BusyEngine(InlineEngine):
    """An engine thread deep in a long prefill step: no call is answered."""

    def call(self, fn) -> Future:
        return Future()


class Producer:
    def __init__(self, engine=InlineEngine) -> None:
        self.sched = _producer()
        self.engine = engine
        self.layout = pb.KVEngineLayout(engine_id="prod-1", group_epoch=11,
                                        tensor_parallel_size=2, **FACTS)
        self.port = free_port()

    async def __aenter__(self):
        self.server = grpc.aio.server()
        kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(KVTransferService(
            self.engine(self.sched), "prod-1", lambda: self.layout, 30.0), self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()
        return self

    async def __aexit__(self, *exc):
        await self.server.stop(None)

    def leg(self, prompt=None, **change) -> DecodeLeg:
        params = _prefill_leg(self.sched, prompt or list(range(10, 20)),
                              req_id=f"p{len(self.sched.kv_leases)}").kv_transfer_params
        fields = dict(engine_id="prod-1", lease_id=params["remote_request_id"],
                      block_ids=tuple(params["remote_block_ids"][0]), host="127.0.0.1",
                      port=self.port, tp_size=2, num_tokens=params["remote_num_tokens"])
        return DecodeLeg(**{**fields, **change})


def _consumer(policy="recompute", **facts) -> RemoteProducers:
    config = KVTransferConfig("NixlConnector", "kv_consumer", "dec-1", policy, 30.0, 2.0)
    return RemoteProducers(config, lambda: pb.KVEngineLayout(**{**FACTS, **facts}))


def test_a_held_lease_from_a_compatible_producer_is_admitted_then_released():
    async def main():
        async with Producer() as prod:
            consumer = _consumer()
            consumer.start(asyncio.get_running_loop())
            leg = prod.leg()
            remote = await consumer.prepare(leg)
            assert (remote.engine_id, remote.lease_id, remote.remote_block_ids) == (
                "prod-1", leg.lease_id, leg.block_ids)
            assert remote.layout.group_epoch == 11 and remote.num_tokens == 10
            kv = prod.sched.kv_cache_manager
            assert leg.lease_id in kv.req_to_blocks
            consumer.release_threadsafe("prod-1", leg.lease_id)
            for _ in range(100):
                if leg.lease_id not in kv.req_to_blocks:
                    break
                await asyncio.sleep(0.02)
            assert leg.lease_id not in kv.req_to_blocks and consumer.num_released == 1
            await consumer.close()

    asyncio.run(main())


@pytest.mark.parametrize("change,names", [
    (dict(block_ids=(9, 10, 11)), "does not hold these blocks"),
    (dict(num_tokens=11), "does not hold these blocks"),
    (dict(engine_id="prod-2"), "remote_engine_id"),
    (dict(tp_size=1), "tp_size"),
])
def test_parameters_the_producer_does_not_back_are_refused_naming_the_field(change, names):
    async def main():
        async with Producer() as prod:
            consumer = _consumer()
            with pytest.raises(InvalidRequest, match=names):
                await consumer.prepare(prod.leg(**change))
            await consumer.close()

    asyncio.run(main())


@pytest.mark.parametrize("fact,value", [("kv_cache_dtype", "bfloat16"), ("block_size", 16),
                                        ("num_layers", 5), ("total_num_kv_heads", 4),
                                        ("model_architecture", "Qwen2ForCausalLM")])
def test_an_incompatible_producer_is_refused_naming_the_field(fact, value):
    async def main():
        async with Producer() as prod:
            consumer = _consumer(**{fact: value})
            with pytest.raises(InvalidRequest, match=fact):
                await consumer.prepare(prod.leg())
            await consumer.close()

    asyncio.run(main())


def test_a_lost_lease_or_a_dead_producer_costs_a_prefill_or_under_fail_the_request():
    async def main():
        async with Producer() as prod:
            leg = prod.leg()
            prod.sched.kv_leases.release(prod.sched.kv_cache_manager, [leg.lease_id])
            consumer = _consumer()
            assert await consumer.prepare(leg) is None and consumer.num_fallbacks == 1
            with pytest.raises(ProducerUnavailable, match="no longer holds"):
                await _consumer("fail").prepare(leg)
        dead = DecodeLeg("prod-9", "kvlease-x", (1,), "127.0.0.1", free_port(), 1, 4)
        assert await _consumer().prepare(dead) is None
        with pytest.raises(ProducerUnavailable, match="UNAVAILABLE"):
            await _consumer("fail").prepare(dead)

    asyncio.run(main())


def test_a_re_formed_producer_is_asked_for_its_layout_again():
    async def main():
        async with Producer() as prod:
            consumer = _consumer()
            first = await consumer.prepare(prod.leg())
            prod.layout = pb.KVEngineLayout(engine_id="prod-1", group_epoch=12,
                                            tensor_parallel_size=2, **FACTS)
            second = await consumer.prepare(prod.leg(list(range(30, 40))))
            assert (first.layout.group_epoch, second.layout.group_epoch) == (11, 12)
            await consumer.close()

    asyncio.run(main())


def test_hostile_calls_are_refused_and_free_nothing():
    async def main():
        async with Producer() as prod:
            leg = prod.leg()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{prod.port}") as channel:
                stub = kv_transfer_pb2_grpc.KVTransferStub(channel)
                for request, names in [
                    (pb.LeasesRequest(engine_id="other", lease_ids=[leg.lease_id]), "engine_id"),
                    (pb.LeasesRequest(engine_id="prod-1",
                                      lease_ids=["x"] * (MAX_LEASE_IDS + 1)), "at most"),
                    (pb.LeasesRequest(engine_id="prod-1", lease_ids=["x" * 129]), "longer"),
                ]:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await stub.ReleaseLeases(request)
                    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                    assert names in err.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.GetEngineLayout(pb.GetEngineLayoutRequest(engine_id=""))
                assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                guessed = await stub.ReleaseLeases(pb.LeasesRequest(
                    engine_id="prod-1", lease_ids=["kvlease-" + "0" * 32]))
                assert list(guessed.held) == [False]
                prod.layout = None
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.GetEngineLayout(pb.GetEngineLayoutRequest(engine_id="prod-1"))
                assert err.value.code() is grpc.StatusCode.UNAVAILABLE
            assert leg.lease_id in prod.sched.kv_cache_manager.req_to_blocks

    asyncio.run(main())


def test_a_busy_producer_engine_still_admits_a_decode_leg():
    """Checking a lease never waits behind the producer's step (a consumer
    would time out and prefill the prompt itself)."""
    async def main():
        async with Producer(BusyEngine) as prod:
            consumer = _consumer()
            remote = await consumer.prepare(prod.leg())
            assert remote is not None and consumer.num_fallbacks == 0
            await consumer.close()

    asyncio.run(main())

"""SubscribeKvEvents and FlushCache over a real grpc.aio server on a loopback
port (controlplane/api/vllm_engine/kv_events.py, flush_cache.py): headers
come before any batch, batches are numbered 1, 2, 3 and carry the events as
the gateway reads them, a resume replays what the history holds and is
OUT_OF_RANGE otherwise, a subscriber that stops reading ends with
DATA_LOSS, too many subscribers get RESOURCE_EXHAUSTED, and FlushCache
refuses hostile timeouts and retries until the engine can reset.

The servicer is a tiny one exposing only these two calls; the engine behind
FlushCache is a stand-in answering as EngineCore.reset_prefix_cache does."""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import Future
from types import SimpleNamespace

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc

from controlplane.api.vllm_engine.flush_cache import flush_cache
from controlplane.api.vllm_engine.kv_events import KvEventPublisher
from controlplane.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVTier

WAIT_S = 10.0
HEADERS_S = 2.0  # the gateway's patience for SubscribeKvEvents' headers


class Servicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    def __init__(self, publisher: KvEventPublisher, engine) -> None:
        self.publisher = publisher
        self.engine = engine

    async def SubscribeKvEvents(self, request, context):
        async for batch in self.publisher.subscribe(request, context):
            yield batch

    async def FlushCache(self, request, context):
        return await flush_cache(self.engine, request, context)


class Engine:
    """Answers reset_prefix_cache with the next of `answers` (then True)."""

    def __init__(self, *answers: bool, scheduler: object | None = object()) -> None:
        self.answers = list(answers)
        self.calls = 0
        self.scheduler = scheduler
        self.last_stats = SimpleNamespace(num_running_reqs=2)

    def reset_prefix_cache(self) -> Future:
        self.calls += 1
        future: Future = Future()
        future.set_result(self.answers.pop(0) if self.answers else True)
        return future


def serve(test, publisher: KvEventPublisher | None = None, engine=None) -> None:
    """Runs test(publisher, stub) against a server on a free loopback port."""

    async def main() -> None:
        pub = publisher or KvEventPublisher()
        pub.bind(asyncio.get_running_loop())
        server = grpc.aio.server()
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(
            Servicer(pub, engine or Engine()), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await asyncio.wait_for(test(pub, vllm_engine_pb2_grpc.VllmEngineStub(channel)),
                                       WAIT_S * 3)
        finally:
            await server.stop(0)

    asyncio.run(main())


async def subscribed(stub, start: int = 0):
    """A SubscribeKvEvents call whose headers arrived (it is registered)."""
    call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=start))
    await asyncio.wait_for(call.initial_metadata(), HEADERS_S)
    return call


async def read(call, n: int) -> list[common_pb2.KvEventBatch]:
    return [await asyncio.wait_for(call.read(), WAIT_S) for _ in range(n)]


async def refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        while True:
            assert await asyncio.wait_for(call.read(), WAIT_S) is not grpc.aio.EOF
    return err.value


def stored(first_hash: int, parent: int | None = None) -> BlockStored:
    return BlockStored((first_hash, first_hash + 1), parent, tuple(range(8)), 4)


def publish_n(pub: KvEventPublisher, n: int) -> None:
    for i in range(n):
        pub.publish([BlockRemoved((i,))])


def test_headers_come_at_once_with_nothing_published():
    async def test(pub, stub):
        call = await subscribed(stub)
        assert pub.num_subscribers == 1 and pub.sequence_number == 0
        call.cancel()

    serve(test)


def test_batches_are_numbered_from_one_and_carry_the_events_as_the_gateway_reads_them():
    async def test(pub, stub):
        call = await subscribed(stub)
        # As the engine thread hands them over.
        await asyncio.to_thread(pub.publish_threadsafe, [stored(-5)])
        await asyncio.to_thread(pub.publish_threadsafe, [stored(10, parent=-4),
                                                         BlockRemoved((-5, -4))])
        await asyncio.to_thread(pub.publish_threadsafe, [AllBlocksCleared()])
        first, second, third = await read(call, 3)
        assert [b.sequence_number for b in (first, second, third)] == [1, 2, 3]
        assert [e.event_id for b in (first, second, third) for e in b.events] == [1, 2, 3, 4]
        assert first.timestamp > 0
        (event,) = first.events
        assert not event.stored.HasField("parent_block_hash")  # a chain from position 0
        assert [(b.block_hash, list(b.token_ids), b.block_size) for b in event.stored.blocks] == [
            (-5, [0, 1, 2, 3], 4), (-4, [4, 5, 6, 7], 4)]
        assert second.events[0].stored.parent_block_hash == -4
        assert list(second.events[1].removed.block_hashes) == [-5, -4]
        assert third.events[0].HasField("cleared")
        # The pool's events name the device tier (vLLM's medium "GPU").
        assert (event.stored.tier, event.stored.medium) == (common_pb2.KV_CACHE_TIER_DEVICE,
                                                            "GPU")
        removed = second.events[1].removed
        assert (removed.tier, removed.medium) == (common_pb2.KV_CACHE_TIER_DEVICE, "GPU")
        call.cancel()

    serve(test)


def test_the_host_tiers_events_name_it():
    async def test(pub, stub):
        call = await subscribed(stub)
        host = BlockStored((-9,), -3, (1, 2, 3, 4), 4, KVTier.HOST)
        await asyncio.to_thread(pub.publish_threadsafe,
                                [BlockRemoved((-9,)), host, BlockRemoved((-9,), KVTier.HOST)])
        (batch,) = await read(call, 1)
        device_removed, stored_, host_removed = batch.events
        assert device_removed.removed.tier == common_pb2.KV_CACHE_TIER_DEVICE
        assert (stored_.stored.tier, stored_.stored.medium) == (common_pb2.KV_CACHE_TIER_HOST,
                                                                "CPU")
        assert [(b.block_hash, list(b.token_ids)) for b in stored_.stored.blocks] == [
            (-9, [1, 2, 3, 4])]
        assert stored_.stored.parent_block_hash == -3
        assert (host_removed.removed.tier, host_removed.removed.medium) == (
            common_pb2.KV_CACHE_TIER_HOST, "CPU")
        call.cancel()

    serve(test)


def test_a_resume_replays_from_the_start_it_names_then_goes_live():
    async def test(pub, stub):
        publish_n(pub, 5)
        call = await subscribed(stub, start=3)  # the gateway: the last it saw
        publish_n(pub, 1)
        assert [b.sequence_number for b in await read(call, 4)] == [3, 4, 5, 6]
        call.cancel()
        newest = await subscribed(stub, start=6)
        assert [b.sequence_number for b in await read(newest, 1)] == [6]
        newest.cancel()

    serve(test)


def test_a_resume_the_history_no_longer_holds_is_out_of_range():
    async def test(pub, stub):
        publish_n(pub, 10)  # the history keeps 7..10
        err = await refused(await subscribed(stub, start=6))
        assert err.code() is grpc.StatusCode.OUT_OF_RANGE and "oldest" in err.details()
        assert " 7" in err.details()
        err = await refused(await subscribed(stub, start=11))  # e.g. after a restart
        assert err.code() is grpc.StatusCode.OUT_OF_RANGE and "newest" in err.details()
        oldest = await subscribed(stub, start=7)
        assert [b.sequence_number for b in await read(oldest, 4)] == [7, 8, 9, 10]
        oldest.cancel()

    serve(test, KvEventPublisher(history_batches=4))


def test_a_resume_before_anything_was_published_is_out_of_range():
    async def test(pub, stub):
        err = await refused(await subscribed(stub, start=1))
        assert err.code() is grpc.StatusCode.OUT_OF_RANGE

    serve(test)


def test_a_subscriber_that_stops_reading_ends_with_data_loss():
    big = [BlockStored(tuple(range(256)), None, tuple(range(256 * 16)), 16)]

    async def test(pub, stub):
        call = await subscribed(stub)
        for _ in range(1500):  # far more than any transport window holds
            pub.publish(big)
            await asyncio.sleep(0)
        err = await refused(call)
        assert err.code() is grpc.StatusCode.DATA_LOSS and "resubscribe" in err.details()
        for _ in range(100):
            if pub.num_subscribers == 0:
                break
            await asyncio.sleep(0.01)
        assert pub.num_subscribers == 0

    serve(test, KvEventPublisher(queue_batches=8))


def test_subscribers_beyond_the_bound_are_refused_and_a_cancel_frees_a_place():
    async def test(pub, stub):
        first, second = await subscribed(stub), await subscribed(stub)
        err = await refused(stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest()))
        assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        first.cancel()
        for _ in range(200):
            if pub.num_subscribers == 1:
                break
            await asyncio.sleep(0.01)
        assert pub.num_subscribers == 1
        third = await subscribed(stub)
        pub.publish([AllBlocksCleared()])
        assert [len(b.events) for b in await read(third, 1)] == [1]
        assert [b.sequence_number for b in await read(second, 1)] == [1]
        second.cancel()
        third.cancel()

    serve(test, KvEventPublisher(max_subscribers=2))


def test_a_disabled_publisher_answers_unimplemented():
    async def test(pub, stub):
        call = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
        err = await refused(call)
        assert err.code() is grpc.StatusCode.UNIMPLEMENTED
        pub.publish_threadsafe([AllBlocksCleared()])
        await asyncio.sleep(0.05)
        assert pub.sequence_number == 0

    serve(test, KvEventPublisher(enabled=False))


@pytest.mark.parametrize("timeout_s", [math.nan, -1.0, 1e9, math.inf])
def test_flush_cache_refuses_hostile_timeouts(timeout_s):
    engine = Engine()

    async def test(pub, stub):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=timeout_s))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "timeout_s" in err.value.details() and "300" in err.value.details()

    serve(test, engine=engine)
    assert engine.calls == 0


def test_flush_cache_tries_once_without_a_timeout_and_says_why_not():
    busy, down = Engine(False), Engine(False, scheduler=None)

    async def test(pub, stub):
        reply = await stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=0))
        assert not reply.success and reply.message == "2 requests hold KV blocks"
        reply = await stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=0))
        assert reply.success

    serve(test, engine=busy)
    assert busy.calls == 2

    async def test_down(pub, stub):
        reply = await stub.FlushCache(common_pb2.FlushCacheRequest())
        assert not reply.success and reply.message == "worker group not ready"

    serve(test_down, engine=down)


def test_flush_cache_retries_until_the_engine_is_idle_or_the_timeout():
    settles, never = Engine(False, False, False), Engine(*[False] * 1000)

    async def test(pub, stub):
        reply = await stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=5))
        assert reply.success

    serve(test, engine=settles)
    assert settles.calls == 4

    async def test_never(pub, stub):
        reply = await stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=0.2))
        assert not reply.success and "after waiting 0.2 s" in reply.message

    serve(test_never, engine=never)
    assert 2 <= never.calls <= 10

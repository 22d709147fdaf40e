"""GenerationService at its gRPC edge: admission (pool fit, ids, capacity,
limits), Abort, client cancel and the statuses of engine errors. Harness:
service_harness.py."""

from __future__ import annotations

import asyncio

import grpc

from controlplane.config import (
    ApiLimitsConfig,
)
from controlplane.core.request import FinishReason, Request
from kvloom.v1 import generation_pb2 as pb
from tests.controlplane.api.service_harness import (
    PROMPT,
    WAIT_S,
    client_of,
    drain,
    index_of,
    request,
    rpc_error,
    until,
)


def test_request_bigger_than_the_whole_pool_is_refused_naming_the_fix(api, tok):
    async def scenario():
        async with api(num_blocks=4) as h:  # 4 blocks x 4 tokens
            prompt = tok.encode(PROMPT)[:8]
            # 8 + 10 tokens, the last never fed back: 17 slots = 5 blocks.
            err = await rpc_error(
                h.generate(token_ids=prompt, sampling={"max_tokens": 10})
            )
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            details = err.details()
            assert "need 5 KV blocks" in details and "whole pool has 4" in details
            assert "lower max_tokens or shorten the prompt" in details
            assert h.added == []  # refused before the engine saw it

    asyncio.run(scenario())


def test_request_that_exactly_fills_the_pool_is_accepted_and_runs(api, tok):
    async def scenario():
        async with api(num_blocks=4) as h:
            prompt = tok.encode(PROMPT)[:8]
            # 8 + 9 tokens: 16 slots computed (the last token needs none) = 4 blocks.
            msgs = await h.generate(
                request_id="fit", token_ids=prompt, sampling={"max_tokens": 9}
            )
            assert sum(len(m.token_ids) for m in msgs) == 9
            assert msgs[-1].finish.reason == pb.LENGTH
            await h.pool_is_idle("fit")

    asyncio.run(scenario())


def test_duplicate_in_flight_id_is_already_exists(api):
    async def scenario():
        async with api() as h:
            model = h.model
            model.hold()
            first = h.stub.Generate(request(request_id="dup", sampling={"max_tokens": 3}))
            await until(lambda: h.in_flight("dup"))
            err = await rpc_error(h.generate(request_id="dup"))
            assert err.code() == grpc.StatusCode.ALREADY_EXISTS
            assert "'dup' is already in flight" in err.details()
            assert len(h.added) == 1
            model.release()
            msgs = [m async for m in first]
            assert msgs[-1].finish.reason == pb.LENGTH
            # Once the first call ended the id is free again.
            again = await h.generate(request_id="dup", sampling={"max_tokens": 1})
            assert again[-1].finish.reason == pb.LENGTH

    asyncio.run(scenario())


def test_client_ids_cannot_spell_sample_ids(api):
    """Reproduction 2: a request "x" (n=3) beside a client's "x/1" used to
    raise after registering "x", leaking it for good (ALREADY_EXISTS ever
    after), and Abort("x") could end the other client's "x/0". Sample ids
    are now unspellable: '/' is refused in client ids."""

    async def scenario():
        async with api() as h:
            model = h.model
            model.hold()
            call = h.stub.Generate(
                request(request_id="x", sampling={"n": 3, "max_tokens": 2})
            )
            await until(lambda: len(h.router) == 3)
            for other in ("x/1", "x/0", "/", "y/1"):
                err = await rpc_error(h.generate(request_id=other))
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, other
                assert "'/' is reserved" in err.details()
            # Aborting by sample id touches nothing; the id itself is taken.
            reply = await h.stub.Abort(pb.AbortRequest(request_ids=["x/0", "x/1", "x/2"]))
            assert reply.num_aborted == 0
            err = await rpc_error(h.generate(request_id="x"))
            assert err.code() == grpc.StatusCode.ALREADY_EXISTS
            assert [index_of(r) for r in h.samples("x")] == [0, 1, 2]
            model.release()
            finishes = [m.finish for m in await drain(call) if m.HasField("finish")]
            assert [f.reason for f in finishes] == [pb.LENGTH] * 3
            # Nothing of any refused request lingers: "x" is free again.
            assert len(h.router) == 0 and not h.service.in_flight.held_keys()
            later = await h.generate(request_id="x", sampling={"n": 3, "max_tokens": 1})
            assert sum(m.HasField("finish") for m in later) == 3
            await h.pool_is_idle("x")

    asyncio.run(scenario())


def test_a_failure_while_handing_samples_to_the_engine_leaks_nothing(api):
    """Registration happens inside the clean-up scope: whatever raises after
    the id is claimed, the id, the sample routes and the samples the engine
    already got are all released."""

    async def scenario():
        async with api() as h:
            add_request = h.engine.add_request

            def failing_add(req: Request) -> None:
                if index_of(req.request_id) == 1:
                    raise RuntimeError("injected")
                add_request(req)

            h.engine.add_request = failing_add
            err = await rpc_error(h.generate(request_id="f", sampling={"n": 3}))
            assert err.code() == grpc.StatusCode.UNKNOWN
            assert len(h.router) == 0 and not h.service.in_flight.held_keys()
            # The one sample the engine got was aborted: its blocks are free.
            assert [index_of(r) for r in h.samples("f")] == [0]
            await h.pool_is_idle("f")
            assert [o.finish_reason for o in h.finishes("f")] == [FinishReason.ABORT]
            h.engine.add_request = add_request
            msgs = await h.generate(request_id="f", sampling={"n": 3, "max_tokens": 1})
            assert sum(m.HasField("finish") for m in msgs) == 3

    asyncio.run(scenario())


def test_n_above_what_the_server_can_hold_is_invalid_not_retry_later(api):
    async def scenario():
        async with api(max_num_seqs=1, max_waiting_requests=1) as h:
            err = await rpc_error(h.generate(request_id="big-n", sampling={"n": 3}))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "holds at most 2 requests at once" in err.details()
            assert "lower n" in err.details()
            assert h.added == [] and len(h.router) == 0
            msgs = await h.generate(request_id="ok", sampling={"n": 2, "max_tokens": 1})
            assert sum(m.HasField("finish") for m in msgs) == 2

    asyncio.run(scenario())


def test_abort_with_more_ids_than_can_be_in_flight_is_invalid(api):
    async def scenario():
        async with api(max_num_seqs=2, max_waiting_requests=2) as h:
            assert (await h.stub.Abort(pb.AbortRequest(request_ids=["a"] * 4))).num_aborted == 0
            err = await rpc_error(h.stub.Abort(pb.AbortRequest(request_ids=["a"] * 5)))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "at most 4" in err.details()

    asyncio.run(scenario())


def test_limit_flags_reach_the_edge(api):
    async def scenario():
        limits = ApiLimitsConfig(max_logprobs=2, max_n=2)
        async with api(api_limits=limits) as h:
            err = await rpc_error(h.generate(sampling={"logprobs": 3}))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "sampling.logprobs must be <= 2 (the server's --max-logprobs)" in err.details()
            err = await rpc_error(h.generate(sampling={"n": 3}))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "--max-n" in err.details()
            assert h.added == []
            msgs = await h.generate(sampling={"n": 2, "logprobs": 2, "max_tokens": 1})
            assert sum(m.HasField("finish") for m in msgs) == 2

    asyncio.run(scenario())


def test_capacity_is_resource_exhausted_counting_samples(api):
    async def scenario():
        # At most max_num_seqs + max_waiting_requests = 2 samples in flight.
        async with api(max_num_seqs=1, max_waiting_requests=1) as h:
            model = h.model
            model.hold()
            calls = [
                h.stub.Generate(request(request_id=r, sampling={"max_tokens": 2}))
                for r in ("a", "b")
            ]
            await until(lambda: len(h.router) == 2)
            err = await rpc_error(h.generate(request_id="c"))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "2 requests are in flight and at most 2" in err.details()
            assert "retry later" in err.details()
            assert sorted(client_of(r.request_id) for r in h.added) == ["a", "b"]
            model.release()
            for call in calls:
                assert [m async for m in call][-1].finish.reason == pb.LENGTH
            # One in flight leaves room for one sample, not two.
            model.hold()
            one = h.stub.Generate(request(request_id="d", sampling={"max_tokens": 2}))
            await until(lambda: len(h.router) == 1)
            err = await rpc_error(h.generate(request_id="e", sampling={"n": 2}))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            model.release()
            [m async for m in one]
            assert len(await h.generate(request_id="c", sampling={"max_tokens": 1})) == 1

    asyncio.run(scenario())


# ---- ending requests early ------------------------------------------------------------


def test_abort_ends_every_sample_of_an_in_flight_request(api):
    async def scenario():
        async with api() as h:
            model = h.model
            model.hold()
            call = h.stub.Generate(
                request(request_id="ab", sampling={"n": 2, "max_tokens": 100})
            )
            await until(lambda: len(h.router) == 2)
            await asyncio.to_thread(model.waiting_at_gate.wait, WAIT_S)
            reply = await h.stub.Abort(pb.AbortRequest(request_ids=["ab", "ab", "nope"]))
            assert reply.num_aborted == 1  # unknown ids ignored, duplicates once
            model.release()
            msgs = [m async for m in call]
            finishes = [m.finish for m in msgs if m.HasField("finish")]
            assert sorted(m.index for m in msgs if m.HasField("finish")) == [0, 1]
            assert all(f.reason == pb.ABORT for f in finishes)
            assert all(f.output_tokens < 100 for f in finishes)
            await h.pool_is_idle("ab")
            # Aborting a finished request is a no-op.
            assert (await h.stub.Abort(pb.AbortRequest(request_ids=["ab"]))).num_aborted == 0

    asyncio.run(scenario())


def test_client_cancel_aborts_the_engine_request_and_frees_its_blocks(api):
    async def scenario():
        async with api() as h:
            model = h.model
            model.hold()
            call = h.stub.Generate(request(request_id="cc", sampling={"max_tokens": 200}))
            await until(lambda: h.in_flight("cc"))
            await asyncio.to_thread(model.waiting_at_gate.wait, WAIT_S)
            # The engine thread is parked in the step: its scheduler may be read.
            held = h.engine.scheduler.make_stats()
            assert held.num_running_reqs == 1 and held.num_free_blocks < held.num_total_blocks
            call.cancel()
            await until(lambda: not h.in_flight("cc"))  # the server saw the cancel
            model.release()
            await h.pool_is_idle("cc")
            (finish,) = h.finishes("cc")
            assert finish.finish_reason == FinishReason.ABORT
            assert finish.num_output_tokens < 200 and model.num_steps < 200

    asyncio.run(scenario())


def test_a_reused_id_gets_only_its_own_outputs(api, words):
    """A client cancels "x" mid-step and at once sends a new "x": the step
    under way and the abort still emit outputs for the first call. Engine
    ids are unique per call, so those reach no one, never the new call."""

    async def scenario():
        async with api() as h:
            model = h.model
            model.hold()
            first = h.stub.Generate(request(request_id="x", sampling={"max_tokens": 50}))
            await until(lambda: h.in_flight("x"))
            await asyncio.to_thread(model.waiting_at_gate.wait, WAIT_S)
            first.cancel()
            await until(lambda: not h.in_flight("x"))
            again = h.stub.Generate(
                request(request_id="x", sampling={"max_tokens": 3, "seed": 1})
            )
            await until(lambda: h.in_flight("x"))
            model.release()
            msgs = await drain(again)
            assert [t for m in msgs for t in m.token_ids] == words[1:4]  # seed 1's, only
            assert [m.finish.reason for m in msgs if m.HasField("finish")] == [pb.LENGTH]
            old, new = h.samples("x")
            assert old != new
            assert [o.finish_reason for o in h.finishes("x")] == [
                FinishReason.ABORT, FinishReason.LENGTH]
            await h.pool_is_idle("x")

    asyncio.run(scenario())


# ---- engine errors ----------------------------------------------------------------------


def test_worker_group_failure_mid_request_is_unavailable_with_the_reason(api):
    async def scenario():
        async with api() as h:
            model = h.model
            model.hold()
            call = h.stub.Generate(request(request_id="g", sampling={"max_tokens": 50}))
            await asyncio.to_thread(model.waiting_at_gate.wait, WAIT_S)
            h.engine.group_failed("rank 0 disconnected: test")
            model.release()
            err = await rpc_error(drain(call))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert err.details() == "rank 0 disconnected: test"
            await until(lambda: len(h.router) == 0)

    asyncio.run(scenario())


def test_scheduler_refusal_is_invalid_argument_with_its_message(api, tok):
    async def scenario():
        # Without chunked prefill a request must fit one step's token budget;
        # only the scheduler checks that.
        async with api(enable_chunked_prefill=False, max_num_batched_tokens=16) as h:
            err = await rpc_error(
                h.generate(request_id="big", sampling={"max_tokens": 20})
            )
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "chunked prefill is disabled" in err.details()
            assert "'big'" in err.details()
            assert len(h.router) == 0

    asyncio.run(scenario())

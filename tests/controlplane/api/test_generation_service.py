"""GenerationService at its gRPC edge: streaming, stop strings, per-sample
seeds, and (through kvloom_testing/inprocess.py's InProcessExecutor) the tiny checkpoint's
greedy tokens against transformers. Harness: service_harness.py."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from controlplane.config import ApiLimitsConfig
from controlplane.core.outputs import EngineCoreOutput, EngineErrorCode
from controlplane.core.request import FinishReason
from kvloom.v1 import generation_pb2 as pb
from tests.controlplane.api.service_harness import (
    BLOCK_SIZE,
    OUTPUT,
    PROMPT,
    WAIT_S,
    Api,
    WiredModel,
    by_index,
    client_of,
    index_of,
    request,
    until,
)


def test_generate_streams_the_engines_tokens_as_text(api, tok, words):
    async def scenario():
        async with api() as h:
            msgs = await h.generate(request_id="hello", sampling={"max_tokens": 10})
            assert [t for m in msgs for t in m.token_ids] == words
            assert "".join(m.text for m in msgs) == OUTPUT
            assert msgs[0].prompt_info.prompt_tokens == len(tok.encode(PROMPT))
            assert msgs[-1].finish.reason == pb.LENGTH
            assert all(m.request_id == "hello" for m in msgs)
            (req,) = h.added
            assert client_of(req.request_id) == "hello"
            assert req.prompt_token_ids == tok.encode(PROMPT)
            assert req.sampling_params.max_tokens == 10
            assert req.eos_token_ids == frozenset({tok.eos_token_id})
            assert len(h.router) == 0
            await h.pool_is_idle("hello")

    asyncio.run(scenario())


def test_stop_string_ends_the_engine_request_too(api):
    async def scenario():
        async with api() as h:
            model = h.model
            model.hold()  # one step per message read: the engine cannot outrun the API
            call = h.stub.Generate(
                request(request_id="s", sampling={"max_tokens": 40, "stop": [" lazy"]})
            )
            msgs = []
            responses = aiter(call)
            # A pipelined engine runs the next steps before it applies one.
            depth = h.engine.max_steps_in_flight
            model.grant(depth - 1)
            while not (msgs and msgs[-1].HasField("finish")):
                model.grant()
                msgs.append(await asyncio.wait_for(anext(responses), WAIT_S))
            assert "".join(m.text for m in msgs) == " jumps over the"
            assert msgs[-1].finish.reason == pb.STOP and msgs[-1].finish.stop_str == " lazy"
            sent = sum(len(m.token_ids) for m in msgs)
            model.release()
            await h.pool_is_idle("s")
            # The engine was told to stop: it ended the request with STOP, at
            # most the steps already under way after the stop string.
            (finish,) = h.finishes("s")
            assert finish.finish_reason == FinishReason.STOP
            assert finish.num_output_tokens <= sent + depth

    asyncio.run(scenario())


def test_tokens_before_an_error_in_the_same_batch_still_reach_the_client(api, words):
    # The engine's outputs for one request can queue up while its handler
    # sleeps: a token, then the group's failure. The token was generated and
    # goes out before the error status (a CI flake lost it).
    async def scenario():
        async with api() as h:
            h.model.hold()  # the engine produces nothing by itself
            responses = aiter(h.stub.Generate(request(request_id="e",
                                                      sampling={"max_tokens": 10})))
            first = asyncio.ensure_future(anext(responses))
            while not h.added:
                await asyncio.sleep(0.01)
            engine_id = h.added[0].request_id
            h.router.dispatch([
                EngineCoreOutput(engine_id, [words[0]]),
                EngineCoreOutput(engine_id, [], finish_reason=FinishReason.ERROR,
                                 error="worker group failed: rank 0 is gone",
                                 error_code=EngineErrorCode.UNAVAILABLE),
            ])
            msg = await asyncio.wait_for(first, WAIT_S)
            assert list(msg.token_ids) == [words[0]]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(anext(responses), WAIT_S)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "rank 0 is gone" in err.value.details()
            h.model.release()

    asyncio.run(scenario())


def test_the_servers_stream_interval_applies_when_the_request_leaves_it_unset(api, words):
    async def scenario():
        async with api(api_limits=ApiLimitsConfig(stream_interval=4)) as h:
            model = h.model
            model.hold()  # one engine output at a time, each consumed before the next
            call = asyncio.ensure_future(h.generate(request_id="d", sampling={"max_tokens": 9}))
            model.grant(h.engine.max_steps_in_flight - 1)
            for k in range(1, 10):
                model.grant()
                await until(lambda k=k: sum(len(o.new_token_ids) for o in h.emitted) >= k)
                await asyncio.sleep(0.02)  # the handler takes it alone
            model.release()
            default = await asyncio.wait_for(call, WAIT_S)
            own = await h.generate(request_id="o", stream_interval=2, sampling={"max_tokens": 9})
        assert [t for m in default for t in m.token_ids] == words[:9]
        assert [t for m in own for t in m.token_ids] == words[:9]
        # The first token at once, then 4 a message ([1, 4, 4]); a floor, should
        # a loaded box let two outputs reach the handler together.
        sizes = [len(m.token_ids) for m in default]
        assert sizes[0] <= 2 and all(n >= 4 for n in sizes[1:-1]), sizes

    asyncio.run(scenario())


def test_n_samples_get_consecutive_seeds(api, words):
    async def scenario():
        async with api() as h:
            msgs = await h.generate(
                request_id="p", sampling={"n": 3, "seed": 5, "max_tokens": 3}
            )
            assert [(client_of(r.request_id), index_of(r.request_id)) for r in h.added] == [
                ("p", 0), ("p", 1), ("p", 2)]
            assert [r.sampling_params.seed for r in h.added] == [5, 6, 7]
            # Nothing else about the samples differs.
            base = h.added[0].sampling_params
            for r in h.added[1:]:
                assert r.sampling_params == dataclasses.replace(base, seed=r.sampling_params.seed)
            # Each sample streams its own tokens under its index.
            n = len(words)
            assert by_index(msgs) == {
                i: [words[(5 + i + k) % n] for k in range(3)] for i in range(3)
            }
            assert all(m.request_id == "p" for m in msgs)
            assert sum(m.HasField("finish") for m in msgs) == 3

            h.added.clear()
            await h.generate(request_id="q", sampling={"n": 2, "max_tokens": 1})
            assert [r.sampling_params.seed for r in h.added] == [None, None]

    asyncio.run(scenario())


def test_every_uint64_seed_is_valid_for_every_sample(tiny_model_dir, tok, words):
    """Reproduction 1: seed 2^64-1 with n > 1 made seed + 1 overflow the
    wire's uint64 on the engine thread. Sample seeds wrap modulo 2^64."""
    top = (1 << 64) - 1

    async def scenario():
        async with Api(tiny_model_dir, tok, WiredModel(words)) as h:
            msgs = await asyncio.wait_for(
                h.generate(request_id="s", sampling={"n": 3, "seed": top, "max_tokens": 3}),
                WAIT_S,
            )
            assert [r.sampling_params.seed for r in h.added] == [top, 0, 1]
            assert sum(m.HasField("finish") for m in msgs) == 3
            n = len(words)
            assert by_index(msgs) == {
                i: [words[(seed + k) % n] for k in range(3)]
                for i, seed in enumerate([top, 0, 1])
            }
            # The engine lives on: the next request is served.
            assert (await h.generate(sampling={"max_tokens": 1}))[-1].finish.reason == pb.LENGTH
            await h.pool_is_idle("s")

    asyncio.run(scenario())


# ---- admission --------------------------------------------------------------------


# ---- the real tiny model -------------------------------------------------------------


def test_greedy_tokens_match_transformers_through_a_real_worker(tiny_model_dir, tok):
    from kvloom_testing.inprocess import InProcessExecutor
    from tests.integration.reference import hf_greedy

    executor = InProcessExecutor(tiny_model_dir, num_gpu_blocks=32, block_size=BLOCK_SIZE)
    prompt = tok.encode(PROMPT)

    async def scenario():
        async with Api(tiny_model_dir, tok, executor,
                       num_blocks=executor.num_gpu_blocks) as h:
            msgs = await h.generate(
                request_id="real",
                sampling={"temperature": 0.0, "max_tokens": 8, "ignore_eos": True},
                stream_interval=3,
            )
            await h.pool_is_idle("real")
        return msgs

    try:
        msgs = asyncio.run(scenario())
    finally:
        executor.close()
    ids = [t for m in msgs for t in m.token_ids]
    assert ids == hf_greedy(tiny_model_dir, prompt, 8)
    assert "".join(m.text for m in msgs) == tok.decode(ids, skip_special_tokens=True)
    # The first token goes at once; after it an interval is a floor: outputs
    # that queued up meanwhile go out together.
    assert len(msgs[0].token_ids) >= 1 and all(len(m.token_ids) >= 3 for m in msgs[1:-1])


def test_wrapped_sample_seed_samples_like_that_seed_on_a_real_worker(tiny_model_dir, tok):
    """Seed 2^64-1 with n=2 runs through the real wire and worker, and its
    sample 1 (seed wrapped to 0) draws exactly what a seed-0 request draws."""
    from kvloom_testing.inprocess import InProcessExecutor

    executor = InProcessExecutor(tiny_model_dir, num_gpu_blocks=32, block_size=BLOCK_SIZE)
    sampling = {"temperature": 1.0, "max_tokens": 6, "ignore_eos": True}

    async def scenario():
        async with Api(tiny_model_dir, tok, executor,
                       num_blocks=executor.num_gpu_blocks) as h:
            both = await h.generate(request_id="top", sampling={
                **sampling, "n": 2, "seed": (1 << 64) - 1})
            zero = await h.generate(request_id="zero", sampling={**sampling, "seed": 0})
            await h.pool_is_idle("top", "zero")
        return by_index(both), by_index(zero)[0]

    try:
        both, zero = asyncio.run(scenario())
    finally:
        executor.close()
    assert len(both[0]) == len(both[1]) == 6
    assert both[1] == zero

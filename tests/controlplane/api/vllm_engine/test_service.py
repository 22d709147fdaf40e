"""VllmEngineService at its gRPC edge, beside kvloom.v1 on one server, over a
real engine and a scripted model (service_harness.py): streaming and
non-streaming token ids, Abort ending every sample of a gateway id, the
shared capacity, statuses, health, model info, loads and the tokenizer zip."""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from transformers import AutoTokenizer

from tests.controlplane.api.service_harness import request, rpc_error, until

GATEWAY_ID = "chatcmpl-abc/tenant-x-" + "y" * 300  # '/' and past kvloom.v1's 256


def gen(tok, text="The quick brown fox", request_id=GATEWAY_ID, stream=True, **sampling):
    return vpb.GenerateRequest(
        request_id=request_id, tokenized=vpb.TokenizedInput(input_ids=tok.encode(text)),
        sampling_params=vpb.SamplingParams(**sampling), stream=stream)


async def read(call) -> list:
    return [m async for m in call]


def kinds(msgs) -> list[str]:
    return [m.WhichOneof("response") for m in msgs]


def test_streamed_ids_equal_kvloom_v1s_and_end_with_one_complete(api, tok, words):
    async def scenario():
        async with api() as h:
            msgs = await read(h.vllm_stub.Generate(gen(tok, max_tokens=6, temperature=0.0)))
            # Chunks (several steps' tokens may share one), then one complete.
            assert kinds(msgs)[-1] == "complete" and set(kinds(msgs)[:-1]) == {"chunk"}
            ids = [t for m in msgs[:-1] for t in m.chunk.token_ids]
            ref = await h.generate(sampling={"max_tokens": 6, "temperature": 0.0})
            assert ids == [t for m in ref for t in m.token_ids] == words[:6]
            done = msgs[-1].complete
            assert (done.finish_reason, done.completion_tokens) == ("length", 6)
            assert done.prompt_tokens == len(tok.encode("The quick brown fox"))
            await h.pool_is_idle("gw")

    asyncio.run(scenario())


def test_not_streaming_sends_only_the_complete_with_every_token(api, tok, words):
    async def scenario():
        async with api() as h:
            msgs = await read(h.vllm_stub.Generate(gen(tok, stream=False, max_tokens=5)))
            assert kinds(msgs) == ["complete"]
            assert list(msgs[0].complete.output_ids) == words[:5]

    asyncio.run(scenario())


def test_n_samples_each_complete_once_under_their_index(api, tok):
    async def scenario():
        async with api() as h:
            msgs = await read(h.vllm_stub.Generate(gen(tok, n=3, seed=7, max_tokens=4)))
            completes = [m.complete for m in msgs if m.WhichOneof("response") == "complete"]
            assert sorted(c.index for c in completes) == [0, 1, 2]
            per_index = {i: [t for m in msgs if m.WhichOneof("response") == "chunk"
                             and m.chunk.index == i for t in m.chunk.token_ids] for i in range(3)}
            # The scripted model's sample i starts at (seed + i): three different streams.
            assert len({tuple(v) for v in per_index.values()}) == 3
            assert all(len(v) == 4 for v in per_index.values())

    asyncio.run(scenario())


def test_abort_by_gateway_id_ends_every_sample_without_cancelling_the_stream(api, tok):
    async def scenario():
        async with api() as h:
            h.model.hold()
            call = h.vllm_stub.Generate(gen(tok, n=4, max_tokens=200))
            await until(lambda: len(h.samples("gw")) == 4)
            # An unknown id and another tenant's spelling are no-ops, never errors.
            await h.vllm_stub.Abort(vpb.AbortRequest(request_ids=["nope", GATEWAY_ID + "x"]))
            h.model.grant(1)
            await h.vllm_stub.Abort(vpb.AbortRequest(request_ids=[GATEWAY_ID]))
            h.model.release()
            msgs = await read(call)
            ends = sorted((m.complete.index, m.complete.finish_reason) for m in msgs
                          if m.WhichOneof("response") == "complete")
            assert ends == [(i, "abort") for i in range(4)]
            await h.pool_is_idle("gw")

    asyncio.run(scenario())


def test_calls_without_an_id_never_collide(api, tok):
    async def scenario():
        async with api() as h:
            h.model.hold()
            first = h.vllm_stub.Generate(gen(tok, request_id="", max_tokens=3))
            await until(lambda: len(h.router) == 1)
            second = h.vllm_stub.Generate(gen(tok, request_id="", max_tokens=3))
            await until(lambda: len(h.router) == 2)
            h.model.release()
            for call in (first, second):
                assert (await read(call))[-1].complete.finish_reason == "length"

    asyncio.run(scenario())


def test_a_cancelled_stream_frees_its_samples(api, tok):
    async def scenario():
        async with api() as h:
            h.model.hold()
            call = h.vllm_stub.Generate(gen(tok, n=2, max_tokens=200))
            await until(lambda: len(h.samples("gw")) == 2)
            call.cancel()
            h.model.release()
            await h.pool_is_idle("gw")

    asyncio.run(scenario())


def test_one_capacity_and_one_id_space_per_protocol(api, tok):
    async def scenario():
        async with api(max_num_seqs=2, max_waiting_requests=1) as h:
            h.model.hold()
            first = h.vllm_stub.Generate(gen(tok, max_tokens=50))
            await until(lambda: len(h.router) == 1)
            # The same gateway id in flight: 409 at the gateway, not retried.
            dup = await rpc_error(read(h.vllm_stub.Generate(gen(tok, max_tokens=5))))
            assert dup.code() == grpc.StatusCode.ALREADY_EXISTS
            # kvloom.v1 samples count against the same capacity (3 = 2 + 1).
            other = h.stub.Generate(request(request_id="k", sampling={"n": 2, "max_tokens": 50}))
            await until(lambda: len(h.router) == 3)
            full = await rpc_error(read(h.vllm_stub.Generate(gen(tok, request_id="z"))))
            assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            first.cancel()
            other.cancel()
            h.model.release()
            await h.pool_is_idle("gw", "k")

    asyncio.run(scenario())


def test_bad_requests_are_invalid_argument_naming_the_field(api, tok):
    async def scenario():
        async with api() as h:
            for bad, field in [(gen(tok, json_schema="{"), "sampling_params.json_schema"),
                               (gen(tok, top_p=2.0), "sampling_params.top_p"),
                               (gen(tok, "x" * 300), "max model length")]:
                error = await rpc_error(read(h.vllm_stub.Generate(bad)))
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert field in error.details()
            assert len(h.router) == 0 and not h.added

    asyncio.run(scenario())


def test_health_follows_readiness_and_an_unready_server_is_unavailable(api, tok):
    async def scenario():
        async with api() as h:
            ok = await h.vllm_stub.HealthCheck(vpb.HealthCheckRequest())
            assert ok.healthy
            h.not_ready = "worker group is re-forming"
            bad = await h.vllm_stub.HealthCheck(vpb.HealthCheckRequest())
            assert not bad.healthy and "re-forming" in bad.message

    asyncio.run(scenario())


def test_model_server_and_load_info(api, tok):
    async def scenario():
        async with api() as h:
            info = await h.vllm_stub.GetModelInfo(vpb.GetModelInfoRequest())
            assert info.is_generation and not info.supports_vision
            assert (info.served_model_name, info.max_context_length) == ("tiny", 256)
            assert list(info.eos_token_ids) == [tok.eos_token_id]
            assert info.model_type == "llama" and info.tokenizer_path == info.model_path
            server = await h.vllm_stub.GetServerInfo(vpb.GetServerInfoRequest())
            assert (server.block_size, server.max_num_seqs, server.data_parallel_size) == (4, 8, 1)
            await read(h.vllm_stub.Generate(gen(tok, max_tokens=5)))
            loads = await h.vllm_stub.GetLoads(vpb.GetLoadsRequest(include=["core"]))
            (load,) = loads.loads
            assert load.max_total_num_tokens == 64 * 4 and load.max_running_requests == 8
            bad = await rpc_error(h.vllm_stub.GetLoads(vpb.GetLoadsRequest(dp_rank=3)))
            assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(scenario())


def test_get_tokenizer_streams_the_zip_the_gateway_checks(api, tok, tmp_path):
    async def scenario():
        async with api() as h:
            chunks = await read(h.vllm_stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
            data = b"".join(c.data for c in chunks)
            assert all(not c.sha256 for c in chunks[:-1])
            assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
            with zipfile.ZipFile(io.BytesIO(data)) as zf:
                names = zf.namelist()
                assert "tokenizer.json" in names and all("/" not in n for n in names)
                assert "model.safetensors" not in names  # the tokenizer only
                zf.extractall(tmp_path)
            # The files rebuild the same tokenizer: same ids for the same text.
            text = "The quick brown fox jumps over the lazy dog </s>"
            rebuilt = AutoTokenizer.from_pretrained(str(tmp_path))
            assert rebuilt.encode(text) == tok.encode(text)

    asyncio.run(scenario())


def test_unimplemented_rpcs_say_so(api):
    async def scenario():
        async with api() as h:
            error = await rpc_error(h.vllm_stub.Embed(vpb.EmbedRequest()))
            assert error.code() == grpc.StatusCode.UNIMPLEMENTED

    asyncio.run(scenario())

"""kvloom.client and kvloom.api: request building (every knob lands in its
proto field, unset knobs stay unset), response parsing, and both clients
against the fake in-process Generation server (conftest.fake_server)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvloom.api import (
    Finish,
    GenerateChunk,
    InvalidArgument,
    build_detokenize_request,
    build_tokenize_request,
    chunk_from_pb,
)
from kvloom.client import (
    AsyncKvloomClient,
    Collector,
    KvloomClient,
    KvloomError,
    build_request,
)
from kvloom.v1 import generation_pb2 as pb
from kvloom_cli import launcher

# --- request building --------------------------------------------------------

EVERY_KNOB = {
    "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.05, "seed": 11,
    "max_tokens": 33, "min_tokens": 2, "repetition_penalty": 1.25,
    "presence_penalty": 0.5, "frequency_penalty": -0.25, "logprobs": 3,
    "prompt_logprobs": 2, "n": 4,
}


def test_every_sampling_knob_lands_in_its_field():
    request = build_request(
        "hi", **EVERY_KNOB, ignore_eos=True, stop_token_ids=[9, 8], stop=["\n", "END"],
        include_stop_str_in_output=True, stream=False, stream_interval=5, cache_salt="tenant",
        request_id="r1", priority=-7, lora_name="sql-lora",
    )
    sp = request.sampling
    for name, value in EVERY_KNOB.items():
        assert sp.HasField(name), name
        assert getattr(sp, name) == pytest.approx(value), name
    assert sp.ignore_eos and sp.include_stop_str_in_output
    assert list(sp.stop_token_ids) == [9, 8] and list(sp.stop) == ["\n", "END"]
    assert request.HasField("stream") and request.stream is False
    assert request.stream_interval == 5 and request.cache_salt == "tenant"
    assert (request.request_id, request.text) == ("r1", "hi")
    assert request.priority == -7 and request.lora_name == "sql-lora"


def test_unset_knobs_stay_unset():
    request = build_request("hi")
    sp = request.sampling
    for name in EVERY_KNOB:
        assert not sp.HasField(name), name
    assert not request.HasField("stream") and not request.HasField("stream_interval")
    assert not sp.ignore_eos and not sp.include_stop_str_in_output
    assert list(sp.stop) == [] and list(sp.stop_token_ids) == []
    assert request.cache_salt == "" and request.request_id == ""
    assert request.priority == 0  # the server's default (plain proto3 int32)
    assert request.lora_name == ""  # the base model


def test_zero_is_sent_not_dropped():
    sp = build_request("hi", temperature=0.0, top_k=0, min_p=0.0, presence_penalty=0.0).sampling
    assert all(sp.HasField(f) for f in ("temperature", "top_k", "min_p", "presence_penalty"))


def test_prompt_kinds():
    assert build_request("text").WhichOneof("prompt") == "text"
    request = build_request([1, 2, 3], stop_token_ids=[9])
    assert request.WhichOneof("prompt") == "token_ids"
    assert list(request.token_ids.ids) == [1, 2, 3]
    for turns in ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                  [("system", "be brief"), ("user", "hi")]):
        for request in (build_request(turns), build_request(messages=turns)):
            assert request.WhichOneof("prompt") == "messages"
            got = [(m.role, m.content) for m in request.messages.messages]
            assert got == [("system", "be brief"), ("user", "hi")]


def test_one_stop_string_is_not_split_into_characters():
    assert list(build_request("hi", stop="END").sampling.stop) == ["END"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": -1}, "max_tokens=-1"),
        ({"seed": -5}, "seed=-5"),
        ({"temperature": "hot"}, "temperature='hot'"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"messages": [("user",)]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0]"),
        ({"messages": "hi"}, "list of chat turns"),
        # int32 holds what the server bounds; beyond it the client says so itself.
        ({"priority": 1 << 31}, "priority=2147483648"),
        ({"priority": -(1 << 40)}, "priority=-1099511627776"),
        ({"priority": 1.5}, "priority=1.5"),
        ({"priority": "high"}, "priority='high'"),
    ],
)
def test_unsendable_arguments_raise_invalid_argument(kwargs, message):
    prompt = None if "messages" in kwargs else "hi"
    with pytest.raises(InvalidArgument, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_request(prompt, **kwargs)


def test_prompt_and_messages_are_exclusive():
    with pytest.raises(InvalidArgument, match="not both"):
        build_request("hi", messages=[("user", "hi")])
    with pytest.raises(InvalidArgument, match="prompt is required"):
        build_request()
    error = InvalidArgument("x")
    assert isinstance(error, ValueError) and error.code == grpc.StatusCode.INVALID_ARGUMENT


def test_tokenize_and_detokenize_requests():
    request = build_tokenize_request("hi")
    assert request.text == "hi" and not request.HasField("add_special_tokens")
    assert not request.HasField("add_generation_prompt")
    request = build_tokenize_request([("user", "hi")], add_special_tokens=False,
                                     add_generation_prompt=False)
    assert request.WhichOneof("input") == "messages"
    assert request.HasField("add_special_tokens") and not request.add_special_tokens
    assert request.HasField("add_generation_prompt") and not request.add_generation_prompt
    request = build_detokenize_request([1, 2])
    assert list(request.token_ids) == [1, 2] and not request.HasField("skip_special_tokens")
    assert build_detokenize_request([1], skip_special_tokens=False).HasField(
        "skip_special_tokens")


# --- response parsing --------------------------------------------------------


def test_chunk_parsing_of_index_prompt_info_logprobs_and_finish():
    msg = pb.GenerateResponse(request_id="r", index=2, token_ids=[5], text="x")
    msg.prompt_info.CopyFrom(pb.PromptInfo(
        prompt_tokens=6, cached_tokens=4,
        prompt_logprobs=[pb.Logprob(token_id=8, logprob=-1.5, rank=3, token="y")]))
    msg.logprobs.append(pb.Logprob(token_id=5, logprob=-0.25, rank=1, token="x",
                                   top=[pb.TopLogprob(token_id=5, logprob=-0.25, token="x"),
                                        pb.TopLogprob(token_id=6, logprob=-2.0, token="z")]))
    msg.finish.CopyFrom(pb.FinishInfo(reason=pb.STOP, prompt_tokens=6, output_tokens=1,
                                      stop_str="\n", cached_tokens=4))
    chunk = chunk_from_pb(msg)
    assert chunk.index == 2 and chunk.prompt_info.prompt_tokens == 6
    assert chunk.prompt_info.cached_tokens == 4
    [plp] = chunk.prompt_info.prompt_logprobs
    assert (plp.token_id, plp.logprob, plp.rank, plp.token, plp.top) == (8, -1.5, 3, "y", [])
    [lp] = chunk.logprobs
    assert (lp.token_id, lp.rank, lp.token) == (5, 1, "x")
    assert [(t.token_id, t.logprob, t.token) for t in lp.top] == [(5, -0.25, "x"),
                                                                  (6, -2.0, "z")]
    assert chunk.finish == Finish("stop", 6, 1, stop_token_id=None, stop_str="\n",
                                  cached_tokens=4, error="")


def test_chunk_without_optional_parts():
    chunk = chunk_from_pb(pb.GenerateResponse(request_id="r", token_ids=[1], text="a"))
    assert chunk == GenerateChunk("r", [1], "a")
    assert chunk.prompt_info is None and chunk.logprobs == [] and chunk.index == 0


def test_collector_requires_every_sample_to_finish():
    collector = Collector("srv", n=2)
    collector.add(GenerateChunk("r", [1], "a", Finish("stop", 1, 1), index=0))
    with pytest.raises(KvloomError, match=r"samples \[1\]"):
        collector.results()
    collector.add(GenerateChunk("r", [2], "b", Finish("length", 1, 1), index=1))
    assert [r.text for r in collector.result()] == ["a", "b"]


def test_kvloom_error_without_code():
    assert str(KvloomError("stream ended")) == "stream ended"


# --- against the fake server -------------------------------------------------


def test_sync_generate_streams_chunks(fake_server):
    address, servicer = fake_server
    with KvloomClient(address) as client:
        chunks = list(client.generate("hello", max_tokens=5, temperature=0.0))
    assert [c.text for c in chunks] == ["a", "b", "c"]
    assert [c.finish for c in chunks[:2]] == [None, None]
    assert chunks[0].prompt_info.prompt_tokens == 4 and chunks[1].prompt_info is None
    finish = chunks[-1].finish
    assert (finish.reason, finish.prompt_tokens, finish.output_tokens) == ("stop", 4, 3)
    assert finish.stop_token_id == 3 and finish.cached_tokens == 2
    sent = servicer.requests[0].sampling
    assert sent.max_tokens == 5 and sent.HasField("temperature") and sent.temperature == 0.0
    assert not sent.HasField("top_p") and not sent.HasField("seed")


def test_generate_text_collects(fake_server):
    address, _ = fake_server
    with KvloomClient(address) as client:
        result = client.generate_text([5, 6, 7], request_id="mine", logprobs=2, stop=["c"])
    assert (result.text, result.token_ids, result.request_id) == ("abc", [1, 2, 3], "mine")
    assert result.finish.reason == "stop" and result.finish.stop_str == "c"
    assert [lp.rank for lp in result.logprobs] == [1, 2, 3]
    assert all(len(lp.top) == 2 for lp in result.logprobs)
    assert result.prompt_info.cached_tokens == 2


def test_generate_text_with_n_returns_one_result_per_index(fake_server):
    address, servicer = fake_server
    with KvloomClient(address) as client:
        results = client.generate_text("hello", n=3, prompt_logprobs=1)
        single = client.generate_text("hello", n=1)
    assert [r.index for r in results] == [0, 1, 2]
    assert all(r.text == "abc" and r.finish.reason == "stop" for r in results)
    assert all(len(r.prompt_info.prompt_logprobs) == 3 for r in results)
    assert single.text == "abc"
    assert servicer.requests[0].sampling.n == 3


def test_bad_argument_raises_before_sending(fake_server):
    address, servicer = fake_server
    with KvloomClient(address) as client, pytest.raises(InvalidArgument):
        client.generate("hi", max_tokens=-3)
    assert servicer.requests == []


def test_priority_reaches_the_server_from_both_clients(fake_server):
    address, servicer = fake_server
    with KvloomClient(address) as client:
        client.generate_text("hi", priority=-4)

    async def scenario():
        async with AsyncKvloomClient(address) as client:
            await client.generate_text("hi", priority=9)
            await client.generate_text("hi")

    asyncio.run(scenario())
    assert [r.priority for r in servicer.requests] == [-4, 9, 0]


def test_rpc_error_becomes_kvloom_error(fake_server):
    address, _ = fake_server
    with KvloomClient(address) as client, pytest.raises(KvloomError) as info:
        list(client.generate("fail"))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details == "prompt too long"
    assert str(info.value) == f"kvloom server {address}: INVALID_ARGUMENT: prompt too long"


def test_unreachable_server_hints_at_kvloom_up():
    (port,) = launcher.pick_free_ports(1)
    with KvloomClient(f"127.0.0.1:{port}") as client, pytest.raises(KvloomError) as info:
        # Loopback refuses at once; the long deadline only keeps a loaded box
        # from turning the refusal into DEADLINE_EXCEEDED, which has no hint.
        client.health(timeout=30.0)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "kvloom up" in str(info.value)


def test_breaking_out_of_a_stream_cancels_it(fake_server):
    address, servicer = fake_server
    with KvloomClient(address) as client:
        stream = client.generate("slow")
        next(stream)
        stream.close()
        assert servicer.cancelled.wait(5)


def test_info_tokenize_and_health(fake_server):
    address, servicer = fake_server
    with KvloomClient(address) as client:
        model = client.model_info()
        server = client.server_info()
        ids, text = client.tokenize("hi")
        chat = client.tokenize([("user", "hi")], add_generation_prompt=False)
        detok = client.detokenize([104, 105], skip_special_tokens=False)
        assert client.health() == "SERVING"
        assert client.health("kvloom.v1.Generation") == "SERVING"
        with pytest.raises(KvloomError, match="NOT_FOUND"):
            client.health("nope")
    assert model.vocab_size == 511 and model.bos_token_id == 0 and model.has_chat_template
    assert model.special_tokens == {"<s>": 0, "</s>": 1}
    assert server.pipeline_parallel_size == 2
    assert (server.num_requests_running, server.num_requests_waiting,
            server.max_waiting_requests) == (3, 1, 64)
    assert (ids, text) == ([104, 105], "hi")
    assert chat.text == "<user>hi" and chat.token_ids[0] == ord("<")
    assert servicer.tokenize_requests[1].add_generation_prompt is False
    assert detok == "hi" and servicer.detokenize_requests[0].HasField("skip_special_tokens")


def test_async_abort_ends_stream_with_abort(fake_server):
    address, _ = fake_server

    async def scenario():
        async with AsyncKvloomClient(address) as client:
            texts, finish = [], None
            async for chunk in client.generate("slow", request_id="r1"):
                texts.append(chunk.text)
                if len(texts) == 2:
                    assert await client.abort("r1") == 1
                finish = chunk.finish or finish
            info = await client.model_info()
            return texts, finish, info

    texts, finish, info = asyncio.run(scenario())
    assert finish.reason == "abort" and len(texts) >= 2
    assert info.eos_token_ids == [1]


def test_async_cancelling_the_task_cancels_the_call(fake_server):
    address, servicer = fake_server

    async def scenario():
        async with AsyncKvloomClient(address) as client:
            streaming = asyncio.Event()

            async def consume():
                async for _ in client.generate("slow"):
                    streaming.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(streaming.wait(), 30)  # the call is live: cancel it
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(scenario())
    assert servicer.cancelled.wait(5)


def test_async_generate_text_and_tokenize(fake_server):
    address, _ = fake_server

    async def scenario():
        async with AsyncKvloomClient(address) as client:
            results = await client.generate_text(messages=[("user", "hi")], n=2)
            text = await client.detokenize((await client.tokenize("ab")).token_ids)
            return results, text, await client.server_info()

    results, text, server = asyncio.run(scenario())
    assert [r.index for r in results] == [0, 1] and text == "ab"
    assert server.max_waiting_requests == 64


def test_async_error_mapping(fake_server):
    address, _ = fake_server

    async def scenario():
        async with AsyncKvloomClient(address) as client:
            return await client.generate_text("fail")

    with pytest.raises(KvloomError, match="INVALID_ARGUMENT: prompt too long"):
        asyncio.run(scenario())


def test_chat_and_stream_names_mirror_the_cli(fake_server):
    address, servicer = fake_server
    with KvloomClient(address) as client:
        reply = client.chat("hi", max_tokens=4)
        turns = client.chat([("system", "be brief"), {"role": "user", "content": "yo"}])
        streamed = [c.text for c in client.stream_chat("hi")]
        plain = [c.text for c in client.stream("hello")]
        assert client.generate == client.stream  # the older name still streams
    assert str(reply) == "abc" and reply.finish.reason == "stop" and turns.text == "abc"
    assert streamed == plain == ["a", "b", "c"]
    sent = [
        [(m.role, m.content) for m in r.messages.messages] for r in servicer.requests[:3]
    ]
    assert sent == [[("user", "hi")], [("system", "be brief"), ("user", "yo")], [("user", "hi")]]
    assert servicer.requests[0].sampling.max_tokens == 4
    assert servicer.requests[3].WhichOneof("prompt") == "text"


def test_async_chat_and_stream_chat(fake_server):
    address, servicer = fake_server

    async def scenario():
        async with AsyncKvloomClient(address) as client:
            reply = await client.chat("hi")
            texts = [c.text async for c in client.stream_chat([("user", "yo")])]
            return reply, texts

    reply, texts = asyncio.run(scenario())
    assert str(reply) == "abc" and texts == ["a", "b", "c"]
    assert [r.messages.messages[0].content for r in servicer.requests] == ["hi", "yo"]

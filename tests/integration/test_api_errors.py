"""Bad requests get precise gRPC statuses, never reach the scheduler, never
disturb the batch, and leak no KV blocks."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest

from kvloom.v1 import generation_pb2 as pb
from tests.integration.api_helpers import (
    assert_no_leaked_blocks,
    collect,
    greedy_request,
    status_of,
    stub_for,
    tokens_of,
)
from tests.integration.conftest import running_cluster
from tests.integration.reference import hf_greedy

pytestmark = pytest.mark.slow

INVALID = grpc.StatusCode.INVALID_ARGUMENT
OK_IDS = [5, 6, 7]


def _sp(**kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=OK_IDS), sampling=pb.SamplingParams(**kw))


def _msgs(*turns) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in turns])
    )


BAD_REQUESTS = [
    ("no prompt", pb.GenerateRequest(), INVALID),
    ("empty text", pb.GenerateRequest(text=""), INVALID),
    ("empty token ids", pb.GenerateRequest(token_ids=pb.TokenIds()), INVALID),
    ("token id outside vocab", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 10**6])), INVALID),
    ("empty chat", _msgs(), INVALID),
    ("bad chat role", _msgs(("wizard", "hi")), INVALID),
    ("negative temperature", _sp(temperature=-0.5), INVALID),
    ("NaN temperature", _sp(temperature=math.nan), INVALID),
    ("infinite temperature", _sp(temperature=math.inf), INVALID),
    ("top_p zero", _sp(top_p=0.0), INVALID),
    ("top_p above one", _sp(top_p=1.01), INVALID),
    ("NaN top_p", _sp(top_p=math.nan), INVALID),
    ("negative top_k", _sp(top_k=-1), INVALID),
    ("negative min_p", _sp(min_p=-0.1), INVALID),
    ("min_p above one", _sp(min_p=1.5), INVALID),
    ("zero repetition_penalty", _sp(repetition_penalty=0.0), INVALID),
    ("NaN repetition_penalty", _sp(repetition_penalty=math.nan), INVALID),
    ("presence_penalty too big", _sp(presence_penalty=3.0), INVALID),
    ("frequency_penalty too small", _sp(frequency_penalty=-2.5), INVALID),
    ("zero max_tokens", _sp(max_tokens=0), INVALID),
    ("prompt + max_tokens over max_model_len", _sp(max_tokens=10**6), INVALID),
    ("min_tokens over max_tokens", _sp(max_tokens=4, min_tokens=5), INVALID),
    ("too many stop token ids", _sp(stop_token_ids=list(range(65))), INVALID),
    ("stop token id outside vocab", _sp(stop_token_ids=[10**6]), INVALID),
    ("too many stop strings", _sp(stop=[f"s{i}" for i in range(17)]), INVALID),
    ("empty stop string", _sp(stop=[""]), INVALID),
    ("overlong stop string", _sp(stop=["x" * 257]), INVALID),
    ("too many logprobs", _sp(logprobs=21), INVALID),
    ("too many prompt logprobs", _sp(prompt_logprobs=50), INVALID),
    ("n zero", _sp(n=0), INVALID),
    ("n too big", _sp(n=17), INVALID),
    ("zero stream interval", pb.GenerateRequest(text="hi", stream_interval=0), INVALID),
    ("overlong request id", pb.GenerateRequest(request_id="r" * 300, text="hi"), INVALID),
    ("overlong cache salt", pb.GenerateRequest(cache_salt="s" * 300, text="hi"), INVALID),
]


async def _scenario(address: str, model_dir: str):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = stub_for(channel)
        # A healthy request keeps generating while the bad ones arrive.
        bystander = asyncio.create_task(collect(stub, greedy_request(OK_IDS, max_tokens=48)))
        codes = {}
        for name, request, _ in BAD_REQUESTS:
            codes[name] = await status_of(stub, request)
        # A duplicate in-flight request id.
        long_req = greedy_request([9, 9], max_tokens=200, request_id="dup")
        first = stub.Generate(long_req, timeout=120)
        await first.read()  # it is in flight now
        codes["duplicate request id"] = await status_of(stub, long_req)
        first.cancel()

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Detokenize(pb.DetokenizeRequest(token_ids=[10**6]))
        codes["detokenize outside vocab"] = info.value.code()

        bystander_tokens = tokens_of(await bystander)
        normal = await collect(stub, greedy_request(OK_IDS, max_tokens=8))
        await assert_no_leaked_blocks(stub)
        return codes, bystander_tokens, normal


def test_invalid_requests_get_exact_statuses(tiny_model_dir):
    with running_cluster(tiny_model_dir) as cluster:
        codes, bystander, normal = asyncio.run(_scenario(cluster.api_address, tiny_model_dir))
        assert cluster.processes[0].popen.poll() is None, "the controlplane crashed"
    expected = {name: code for name, _, code in BAD_REQUESTS}
    expected["duplicate request id"] = grpc.StatusCode.ALREADY_EXISTS
    expected["detokenize outside vocab"] = INVALID
    assert len(expected) >= 30
    assert codes == expected
    # The batch was not disturbed: the bystander's greedy output is exact.
    assert bystander == hf_greedy(tiny_model_dir, OK_IDS, 48)
    assert tokens_of(normal) == hf_greedy(tiny_model_dir, OK_IDS, 8)


async def _exhaust(address: str):
    async with grpc.aio.insecure_channel(
        address, options=[("grpc.max_send_message_length", 1 << 22)]
    ) as channel:
        stub = stub_for(channel)
        running = [
            stub.Generate(greedy_request([5 + i], max_tokens=300), timeout=120) for i in range(2)
        ]
        for call in running:
            await call.read()  # both admitted
        over_bound = await status_of(stub, greedy_request([3], max_tokens=4))
        too_large = await status_of(stub, pb.GenerateRequest(text="x" * (1 << 21)))
        for call in running:
            call.cancel()
        await assert_no_leaked_blocks(stub)
        return over_bound, too_large


def test_queue_bound_and_message_size(tiny_model_dir):
    args = ("--max-num-seqs", "2", "--max-waiting-requests", "0",
            "--max-message-bytes", str(1 << 20))
    with running_cluster(tiny_model_dir, args=args) as cluster:
        over_bound, too_large = asyncio.run(_exhaust(cluster.api_address))
    assert over_bound == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert too_large == grpc.StatusCode.RESOURCE_EXHAUSTED

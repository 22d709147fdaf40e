"""The client API's behaviour against one running cluster: cancellation frees
every block, Abort is idempotent and ends streams with ABORT, stop strings
match across token boundaries, seeded sampling is reproducible in any batch,
n samples, stream_interval, one-message mode, Tokenize/Detokenize and
reflection."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from transformers import AutoTokenizer

from kvloom.v1 import generation_pb2 as pb
from tests.integration.api_helpers import (
    assert_no_leaked_blocks,
    collect,
    greedy_request,
    read_all,
    stub_for,
    tokens_of,
)
from tests.integration.conftest import running_cluster
from tests.integration.reference import hf_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with running_cluster(tiny_model_dir, args=("--max-num-seqs", "64")) as c:
        yield c


def _run(coro):
    return asyncio.run(coro)


async def _with_stub(address, fn):
    async with grpc.aio.insecure_channel(address) as channel:
        return await fn(stub_for(channel))


def test_cancel_half_of_50_streams(cluster, tiny_model_dir):
    prompts = [[3 + i, 7 + i % 5, 11] for i in range(50)]

    async def scenario(stub):
        async def one(i):
            call = stub.Generate(greedy_request(prompts[i], max_tokens=24), timeout=300)
            if i % 2:
                await call.read()  # mid-generation...
                call.cancel()  # ...the client walks away
                return None
            return await read_all(call)

        results = await asyncio.gather(*(one(i) for i in range(50)))
        await assert_no_leaked_blocks(stub)
        return results

    results = _run(_with_stub(cluster.api_address, scenario))
    for i in range(0, 50, 2):
        assert results[i][-1].finish.reason == pb.LENGTH
        assert tokens_of(results[i]) == hf_greedy(tiny_model_dir, prompts[i], 24)


def test_abort_call_is_idempotent_and_ends_with_abort(cluster):
    async def scenario(stub):
        call = stub.Generate(greedy_request([4, 4], max_tokens=400, request_id="to-abort"))
        messages = [await call.read()]
        first = await stub.Abort(pb.AbortRequest(request_ids=["to-abort", "unknown"]))
        messages += await read_all(call)
        second = await stub.Abort(pb.AbortRequest(request_ids=["to-abort"]))
        await assert_no_leaked_blocks(stub)
        return first.num_aborted, second.num_aborted, messages[-1]

    first, second, last = _run(_with_stub(cluster.api_address, scenario))
    assert (first, second) == (1, 0)
    assert last.finish.reason == pb.ABORT
    assert last.finish.output_tokens < 400


def test_stop_string_across_token_boundaries(cluster, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tok.encode("The little cat")
    expected_ids = hf_greedy(tiny_model_dir, prompt, 40)
    full = tok.decode(expected_ids, skip_special_tokens=True)
    # A stop string that starts inside one token and ends inside a later one.
    pieces = [tok.decode(expected_ids[:k], skip_special_tokens=True) for k in range(41)]
    k = next(k for k in range(3, 30) if len(pieces[k + 2]) - len(pieces[k]) >= 3)
    start = len(pieces[k]) - 1 if len(pieces[k]) - len(pieces[k - 1]) > 1 else len(pieces[k])
    stop = full[start : len(pieces[k + 1]) + 1]
    assert len(stop) >= 2 and full.find(stop) == start

    async def scenario(stub):
        base = greedy_request(prompt, max_tokens=40, stop=[stop, "never-appears"])
        plain = await collect(stub, base)
        base.sampling.include_stop_str_in_output = True
        kept = await collect(stub, base)
        await assert_no_leaked_blocks(stub)
        return plain, kept

    plain, kept = _run(_with_stub(cluster.api_address, scenario))
    assert "".join(m.text for m in plain) == full[:start]
    assert "".join(m.text for m in kept) == full[:start] + stop
    assert plain[-1].finish.reason == pb.STOP and plain[-1].finish.stop_str == stop


def test_seeded_sampling_reproducible_in_any_batch(cluster):
    def req(seed, ids=(8, 9, 10)):
        return pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=list(ids)),
            sampling=pb.SamplingParams(
                temperature=1.0, top_k=50, seed=seed, max_tokens=20, ignore_eos=True
            ),
        )

    async def scenario(stub):
        alone = tokens_of(await collect(stub, req(7)))
        noise = [collect(stub, req(None, ids=(20 + i, 3))) for i in range(6)]
        crowd = await asyncio.gather(collect(stub, req(7)), *noise)
        other_seed = tokens_of(await collect(stub, req(8)))
        return alone, tokens_of(crowd[0]), other_seed

    alone, in_batch, other_seed = _run(_with_stub(cluster.api_address, scenario))
    assert alone == in_batch
    assert alone != other_seed


def test_n_samples_interval_and_one_message_mode(cluster, tiny_model_dir):
    prompt = [12, 13, 14]
    expected = hf_greedy(tiny_model_dir, prompt, 12)

    async def scenario(stub):
        n_req = greedy_request(prompt, max_tokens=12, n=3)
        n_msgs = await collect(stub, n_req)
        interval = greedy_request(prompt, max_tokens=12)
        interval.stream_interval = 5
        interval_msgs = await collect(stub, interval)
        single = greedy_request(prompt, max_tokens=12)
        single.stream = False
        single_msgs = await collect(stub, single)
        return n_msgs, interval_msgs, single_msgs

    n_msgs, interval_msgs, single_msgs = _run(_with_stub(cluster.api_address, scenario))
    assert sorted({m.index for m in n_msgs}) == [0, 1, 2]
    for i in range(3):
        assert tokens_of(n_msgs, i) == expected
        firsts = [m for m in n_msgs if m.index == i]
        assert firsts[0].prompt_info.prompt_tokens == 3
        assert firsts[-1].finish.output_tokens == 12
    # The first token goes out at once, then a message per 5 tokens at least:
    # an interval is a floor, outputs that queued up meanwhile go out together
    # (exact counts: tests/controlplane/api/test_sample_stream.py).
    sizes = [len(m.token_ids) for m in interval_msgs]
    assert sum(sizes) == 12 and tokens_of(interval_msgs, 0) == expected
    assert len(sizes) >= 2 and all(n >= 5 for n in sizes[1:-1]), sizes
    assert len(single_msgs) == 1 and list(single_msgs[0].token_ids) == expected
    assert single_msgs[0].finish.reason == pb.LENGTH


def test_tokenize_detokenize_model_info(cluster, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    async def scenario(stub):
        t = await stub.Tokenize(pb.TokenizeRequest(text="hello world"))
        d = await stub.Detokenize(pb.DetokenizeRequest(token_ids=t.token_ids))
        info = await stub.GetModelInfo(pb.GetModelInfoRequest())
        return list(t.token_ids), d.text, info

    ids, text, info = _run(_with_stub(cluster.api_address, scenario))
    assert ids == tok.encode("hello world")
    assert text == "hello world"
    assert info.vocab_size == len(tok) and info.architecture == "LlamaForCausalLM"
    assert {s.content: s.id for s in info.special_tokens}["</s>"] == 1


def test_reflection_lists_the_services(cluster):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def scenario():
        async with grpc.aio.insecure_channel(cluster.api_address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")

            async def requests():
                yield request

            async for response in stub.ServerReflectionInfo(requests()):
                return {s.name for s in response.list_services_response.service}

    names = _run(scenario())
    assert {"kvloom.v1.Generation", "grpc.health.v1.Health"} <= names


def test_logprobs_match_transformers(cluster, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    prompt = [21, 22, 23, 24, 25]

    async def scenario(stub):
        req = greedy_request(prompt, max_tokens=6, logprobs=3, prompt_logprobs=2)
        return await collect(stub, req)

    messages = _run(_with_stub(cluster.api_address, scenario))
    tokens = tokens_of(messages)
    logprobs = [lp for m in messages for lp in m.logprobs]
    prompt_lps = list(messages[0].prompt_info.prompt_logprobs)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0], dim=-1)
    assert len(logprobs) == len(tokens) == 6
    for i, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == token and lp.rank == 1  # greedy picks the top token
        assert lp.logprob == pytest.approx(row[token].item(), abs=1e-4)
        top = torch.topk(row, 3)
        assert [t.token_id for t in lp.top] == top.indices.tolist()
        assert [t.logprob for t in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert [p.token_id for p in prompt_lps] == prompt[1:]
    for pos, p in enumerate(prompt_lps, start=1):
        row = ref[pos - 1]
        assert p.logprob == pytest.approx(row[prompt[pos]].item(), abs=1e-4)
        assert p.rank == 1 + int((row > row[prompt[pos]]).sum())
        assert len(p.top) == 2

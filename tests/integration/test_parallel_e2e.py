"""Tensor- and pipeline-parallel clusters of real processes (gloo on loopback),
with async scheduling on (the default: PP=1 runs two steps in flight, PP>1 one
micro-batch per stage) and off (--no-async-scheduling, one step at a time).

Every layout and mode must produce, token for token, what transformers'
generate produces on the same weights for greedy requests, and the same
seeded samples in both modes. Sampled tokens reach the first pipeline stage
over torch.distributed from the output rank, so a PP or TP>1 layout that
embedded a wrong or missing token would diverge here. The tiny model has 4
query heads and 2 KV heads and an odd vocabulary (511), so TP=2 splits heads
and pads the vocab.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from kvloom.v1 import generation_pb2, generation_pb2_grpc
from tests.integration.conftest import running_cluster
from tests.integration.reference import hf_greedy
from tests.integration.test_e2e_generate import _prompts

pytestmark = pytest.mark.slow

# Mixed output lengths: requests leave the batch at different steps, so
# micro-batches and placeholders see requests finish mid-pipeline.
MAX_TOKENS = [5, 32, 11, 24, 17, 8]


async def _generate(address: str, prompts: list[list[int]], seeded: bool):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(i: int, ids: list[int]) -> list[int]:
            sampling = generation_pb2.SamplingParams(
                max_tokens=MAX_TOKENS[i % len(MAX_TOKENS)], ignore_eos=True,
                temperature=0.8 if seeded else 0.0)
            if seeded:
                sampling.seed = 1000 + i
            req = generation_pb2.GenerateRequest(
                request_id=f"{'s' if seeded else 'g'}-{i}",
                token_ids=generation_pb2.TokenIds(ids=ids), sampling=sampling)
            return [t async for m in stub.Generate(req, timeout=180) for t in m.token_ids]

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def _serve(model_dir: str, tp: int, pp: int, args: tuple[str, ...], prompts):
    with running_cluster(model_dir, tp=tp, pp=pp, args=("--max-num-seqs", "6", *args)) as c:
        async def both():
            return await asyncio.gather(_generate(c.api_address, prompts, False),
                                        _generate(c.api_address, prompts, True))

        return asyncio.run(both())


def _check_greedy(model_dir: str, prompts, greedy) -> None:
    for i, (prompt, tokens) in enumerate(zip(prompts, greedy, strict=True)):
        max_tokens = MAX_TOKENS[i % len(MAX_TOKENS)]
        assert tokens == hf_greedy(model_dir, prompt, max_tokens), f"request {i} diverged"


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (1, 2), (2, 2)], ids=["tp1", "pp2", "tp2xpp2"])
def test_async_and_serial_match_transformers_and_each_other(tiny_model_dir, tp, pp):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    prompts = _prompts(vocab, n=6)
    random.Random(tp * 10 + pp).shuffle(prompts)
    greedy_async, seeded_async = _serve(tiny_model_dir, tp, pp, (), prompts)
    greedy_serial, seeded_serial = _serve(
        tiny_model_dir, tp, pp, ("--no-async-scheduling",), prompts)
    _check_greedy(tiny_model_dir, prompts, greedy_async)
    assert greedy_serial == greedy_async
    assert seeded_async == seeded_serial
    assert [len(t) for t in seeded_async] == [MAX_TOKENS[i] for i in range(len(prompts))]


def test_tensor_parallel_matches_transformers(tiny_model_dir):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    prompts = _prompts(vocab, n=4)
    greedy, _ = _serve(tiny_model_dir, 2, 1, (), prompts)
    _check_greedy(tiny_model_dir, prompts, greedy)

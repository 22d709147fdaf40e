"""A request crosses every layer: client -> controlplane -> worker -> model -> client.

Separate OS processes on loopback; greedy outputs must equal transformers'
generate on the same weights, token for token.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from kvloom.v1 import generation_pb2, generation_pb2_grpc
from tests.integration.conftest import running_cluster
from tests.integration.reference import hf_greedy

pytestmark = pytest.mark.slow

MAX_TOKENS = 32


def _prompts(vocab_size: int, n: int = 8) -> list[list[int]]:
    rng = random.Random(1234)
    lengths = [1, 3, 7, 12, 17, 24, 33, 47][:n]
    return [[rng.randrange(3, vocab_size) for _ in range(k)] for k in lengths]


async def _generate_all(address: str, prompts: list[list[int]]):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        info = await stub.GetModelInfo(generation_pb2.GetModelInfoRequest())

        async def one(i: int, ids: list[int]):
            req = generation_pb2.GenerateRequest(
                request_id=f"req-{i}",
                token_ids=generation_pb2.TokenIds(ids=ids),
                sampling=generation_pb2.SamplingParams(
                    temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True
                ),
            )
            return [msg async for msg in stub.Generate(req, timeout=180)]

        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return info, results


def test_concurrent_greedy_matches_transformers(tiny_model_dir):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    prompts = _prompts(vocab)
    with running_cluster(tiny_model_dir, args=("--max-num-seqs", "8")) as cluster:
        info, results = asyncio.run(_generate_all(cluster.api_address, prompts))

    assert info.vocab_size == vocab
    for i, (prompt, messages) in enumerate(zip(prompts, results, strict=True)):
        tokens = [t for m in messages for t in m.token_ids]
        assert all(m.request_id == f"req-{i}" for m in messages)
        final = messages[-1]
        assert final.HasField("finish"), f"request {i}: last message has no finish info"
        assert final.finish.reason == generation_pb2.LENGTH
        assert final.finish.prompt_tokens == len(prompt)
        assert final.finish.output_tokens == MAX_TOKENS
        assert tokens == hf_greedy(tiny_model_dir, prompt, MAX_TOKENS), f"request {i} diverged"

"""Families served end to end (controlplane + workers as processes): greedy
tokens equal transformers' generate on the same tiny checkpoint. The window
model runs with blocks of 4 and a pool of 5 (20 tokens), smaller than each
request's whole context (up to 37 tokens), so it generates past its window
of 5 only because the controlplane frees out-of-window blocks and reuses
them; the mixture of experts runs at TP=2."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvloom.v1 import generation_pb2_grpc
from kvloom_testing.families import make_tiny_checkpoint
from tests.integration.api_helpers import assert_no_leaked_blocks, collect, greedy_request
from tests.integration.conftest import running_cluster
from tests.integration.reference import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [[5, 9, 40, 41, 77, 12, 3, 8, 99, 100, 31], [7, 7, 120, 6, 43, 2, 19],
           [300, 301, 5, 17, 64, 65, 66, 67, 200, 13, 14, 15, 90], [33, 22, 11]]
MAX_TOKENS = 24


async def _generate(address: str) -> list[list[int]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        replies = await asyncio.gather(*(
            collect(stub, greedy_request(p, max_tokens=MAX_TOKENS, request_id=f"r{i}"))
            for i, p in enumerate(PROMPTS)))
        await assert_no_leaked_blocks(stub)  # freed window blocks are not freed twice
    return [[t for m in reply for t in m.token_ids] for reply in replies]


@pytest.mark.parametrize(("family", "tp", "args"), [
    ("mistral-window", 1, ("--block-size", "4", "--num-gpu-blocks-override", "5",
                           "--max-num-batched-tokens", "8")),
    ("gemma2", 1, ("--block-size", "4")),
    ("qwen3-moe", 2, ()),
    ("phi3", 1, ()),
])
def test_greedy_matches_transformers(family, tp, args, tmp_path):
    model_dir = str(make_tiny_checkpoint(tmp_path, family, seed=7))
    with running_cluster(model_dir, tp=tp, args=args) as cluster:
        got = asyncio.run(_generate(cluster.api_address))
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        assert tokens == hf_greedy(model_dir, prompt, MAX_TOKENS), family

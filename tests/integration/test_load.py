"""Load: 1,000 concurrent Generate streams on one client channel against a TP=1
cluster of the tiny model. Every stream finishes with exactly the tokens
transformers' greedy search gives for its prompt, none fails, and afterwards
every KV block is free and readiness is still SERVING.

All 1,000 calls go over one grpc.aio channel (AsyncKvloomClient's options), so
they are 1,000 HTTP/2 streams multiplexed on one connection. Neither side caps
that: the controlplane sets no grpc.max_concurrent_streams, and a grpc.aio
server with default options (grpcio 1.85) holds 1,000 streams of one channel
open at once. The controlplane admits up to --max-num-seqs +
--max-waiting-requests requests at once, so both are set to hold all of them.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvloom.client import READY_SERVICE, AsyncKvloomClient, Collector
from tests.integration.api_helpers import assert_no_leaked_blocks, stub_for
from tests.integration.conftest import running_cluster
from tests.integration.reference import hf_greedy

pytestmark = pytest.mark.slow

NUM_STREAMS = 1000
MAX_TOKENS = 4
# Distinct lengths: some fit in one KV block (16 tokens), some span several,
# so identical prompts also exercise prefix-cache hits on full blocks.
PROMPTS = [
    [5, 9, 14],
    [101, 7, 7, 3, 250, 42, 8],
    [(i * 37) % 200 + 3 for i in range(17)],
    [(i * 11) % 150 + 20 for i in range(33)],
    [300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    [77] * 20,
]
ADMISSION = ("--max-num-seqs", "512", "--max-waiting-requests", str(NUM_STREAMS))


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with running_cluster(tiny_model_dir, args=ADMISSION) as c:
        yield c


async def _generate_all(address: str) -> list:
    async with AsyncKvloomClient(address) as client:

        async def one(i: int):
            prompt = PROMPTS[i % len(PROMPTS)]
            collector = Collector(client.server)
            stream = client.generate(
                prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, timeout=600
            )
            async for chunk in stream:
                collector.add(chunk)
            return collector.result()

        return await asyncio.gather(*(one(i) for i in range(NUM_STREAMS)), return_exceptions=True)


async def _after(address: str) -> str:
    async with grpc.aio.insecure_channel(address) as channel:
        await assert_no_leaked_blocks(stub_for(channel))
    async with AsyncKvloomClient(address) as client:
        return await client.health(READY_SERVICE)


def test_1000_concurrent_streams_finish_exactly(cluster, tiny_model_dir):
    expected = [hf_greedy(tiny_model_dir, p, MAX_TOKENS) for p in PROMPTS]

    results = asyncio.run(_generate_all(cluster.api_address))

    errors = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} of {NUM_STREAMS} streams failed, first: {errors[:3]}"
    wrong = [
        (i, r.token_ids)
        for i, r in enumerate(results)
        if r.token_ids != expected[i % len(PROMPTS)] or r.finish.reason != "length"
    ]
    assert not wrong, f"{len(wrong)} streams differ from transformers, first: {wrong[:3]}"
    assert asyncio.run(_after(cluster.api_address)) == "SERVING"

"""Speculative decoding on clusters of real processes: n-gram drafts from the
controlplane verified at TP=2, PP=2 and TP=2 x PP=2 (gloo on loopback), and
across a killed output rank.

The model is the tiny Llama with tied embeddings, whose greedy output runs
in repeats, so drafts are accepted and rejected in every run. With drafts a
step emits a variable number of tokens per request, which the output rank
sends to every other rank (workerd/runner/sampled_tokens.py): a rank that
appended the wrong count would embed or lay out wrong positions and diverge
from transformers here.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from kvloom_testing.checkpoints import make_tiny_llama
from tests.integration.api_helpers import assert_no_leaked_blocks, greedy_request, stub_for
from tests.integration.conftest import running_cluster
from tests.integration.reference import hf_greedy
from tests.integration.test_recovery import (
    PROMPTS,
    _check,
    _generate_through,
    _metric,
    supervised,
)

pytestmark = pytest.mark.slow

SPEC = ("--speculative-config", json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
     "prompt_lookup_max": 4}))
MAX_TOKENS = [40, 17, 33]


@pytest.fixture(scope="module")
def echo_model_dir(tmp_path_factory) -> str:
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny_echo"), tie_word_embeddings=True))


async def _generate(address: str, prompts: list[list[int]]) -> list[list[int]]:
    import grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = stub_for(channel)

        async def one(i: int, prompt: list[int]) -> list[int]:
            request = greedy_request(prompt, MAX_TOKENS[i], request_id=f"g{i}")
            return [t async for m in stub.Generate(request, timeout=180) for t in m.token_ids]

        tokens = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        await assert_no_leaked_blocks(stub)
        return tokens


@pytest.mark.parametrize(("tp", "pp", "args"), [
    (2, 1, ()), (1, 2, ()), (2, 2, ()), (1, 2, ("--no-async-scheduling",)),
], ids=["tp2", "pp2", "tp2xpp2", "pp2-serial"])
def test_drafts_verified_across_ranks_match_transformers(echo_model_dir, tp, pp, args):
    prompts = [[5 + i, 6, 7, 8 + i, 9] for i in range(len(MAX_TOKENS))]
    with running_cluster(echo_model_dir, tp=tp, pp=pp, args=(*SPEC, *args)) as cluster:
        tokens = asyncio.run(_generate(cluster.api_address, prompts))
        accepted = _metric(cluster, "kvloom_spec_decode_num_accepted_tokens_total")
        drafted = _metric(cluster, "kvloom_spec_decode_num_draft_tokens_total")
    for prompt, got, max_tokens in zip(prompts, tokens, MAX_TOKENS, strict=True):
        assert got == hf_greedy(echo_model_dir, prompt, max_tokens)
    assert 0 < accepted < drafted


def test_a_draft_model_on_the_last_stage_matches_transformers(echo_model_dir):
    # The target drafting for itself at PP=2: the output rank (the last
    # stage) loads it beside its layers and proposes after every step.
    spec = ("--speculative-config", json.dumps(
        {"method": "draft_model", "model": echo_model_dir, "num_speculative_tokens": 3}))
    prompts = [[5 + i, 6, 7, 8 + i, 9] for i in range(len(MAX_TOKENS))]
    with running_cluster(echo_model_dir, pp=2, args=spec) as cluster:
        tokens = asyncio.run(_generate(cluster.api_address, prompts))
        accepted = _metric(cluster, "kvloom_spec_decode_num_accepted_tokens_total")
        drafted = _metric(cluster, "kvloom_spec_decode_num_draft_tokens_total")
    for prompt, got, max_tokens in zip(prompts, tokens, MAX_TOKENS, strict=True):
        assert got == hf_greedy(echo_model_dir, prompt, max_tokens)
    assert accepted >= 0.9 * drafted > 0


def test_a_killed_output_rank_with_drafts_in_flight_loses_nothing(echo_model_dir):
    with supervised(echo_model_dir, pp=2, args=SPEC) as cluster:
        tokens = asyncio.run(_generate_through(cluster, [[1]]))
        _check(cluster, echo_model_dir, tokens, survivors=[0], num_recoveries=1)
        assert _metric(cluster, "kvloom_spec_decode_num_accepted_tokens_total") > 0
    assert len(tokens) == len(PROMPTS) + 1

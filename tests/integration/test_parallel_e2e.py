"""Tensor- and pipeline-parallel clusters of real processes (gloo on loopback).

Every layout must produce, token for token, what transformers' generate
produces on the same weights. The tiny model has 4 query heads and 2 KV heads
and an odd vocabulary (511), so TP=2 splits heads and pads the vocab.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.conftest import running_cluster
from tests.integration.reference import hf_greedy
from tests.integration.test_e2e_generate import MAX_TOKENS, _generate_all, _prompts

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
def test_parallel_layouts_match_transformers(tiny_model_dir, tp, pp):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    prompts = _prompts(vocab, n=4)
    with running_cluster(tiny_model_dir, tp=tp, pp=pp) as cluster:
        info, results = asyncio.run(_generate_all(cluster.api_address, prompts))
    for i, (prompt, messages) in enumerate(zip(prompts, results, strict=True)):
        tokens = [t for m in messages for t in m.token_ids]
        assert tokens == hf_greedy(tiny_model_dir, prompt, MAX_TOKENS), f"request {i} diverged"

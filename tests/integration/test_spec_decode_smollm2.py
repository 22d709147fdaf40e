"""The embedded default model (SmolLM2-135M-Instruct) with n-gram drafts on a
task that repeats its prompt: the greedy answer is transformers' token for
token, most drafts are accepted, and a stop string that lands inside an
accepted run ends the text exactly where the model without drafts would.
n = 2 greedy samples are each the reference. At TP=1 and PP=2 (where the
output rank sends each request's emitted tokens back to the first stage)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import torch

from kvloom.v1 import generation_pb2, generation_pb2_grpc
from tests.integration.conftest import running_cluster
from tests.integration.test_recovery import _metric

pytestmark = pytest.mark.slow

PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, "
             "lit the great lamp, and wrote the weather in a small green notebook.")
QUESTION = f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}"
MAX_TOKENS = 40
SPEC = ("--speculative-config", json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
     "prompt_lookup_max": 5}))


@pytest.fixture(scope="module")
def default_model():
    from kvloom.common.default_model import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="module")
def prompt_and_answer(default_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    with torch.inference_mode():
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=MAX_TOKENS)
    return ids, out[0, len(ids):].tolist(), tok


async def _ask(address: str, ids: list[int], **sampling) -> dict[int, tuple[list[int], str]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        req = generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=ids),
            sampling=generation_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                   **sampling))
        got: dict[int, tuple[list[int], str]] = {}
        async for m in stub.Generate(req, timeout=300):
            tokens, text = got.get(m.index, ([], ""))
            got[m.index] = (tokens + list(m.token_ids), text + m.text)
        return got


@pytest.mark.parametrize("pp", [1, 2], ids=["tp1", "pp2"])
def test_a_repeated_paragraph_is_drafted_and_exact(default_model, prompt_and_answer, pp):
    ids, want, tok = prompt_and_answer
    want_text = tok.decode(want, skip_special_tokens=True)
    # The answer repeats the paragraph: what n-grams are for.
    assert "spiral stairs" in want_text
    # A word deep inside the repeated run, so the stop lands in an accepted run.
    stop = "great lamp"
    assert stop in want_text
    with running_cluster(default_model, pp=pp, args=SPEC, timeout=400) as cluster:
        plain = asyncio.run(_ask(cluster.api_address, ids, n=2))
        stopped = asyncio.run(_ask(cluster.api_address, ids, stop=[stop]))
        accepted = _metric(cluster, "kvloom_spec_decode_num_accepted_tokens_total")
        drafted = _metric(cluster, "kvloom_spec_decode_num_draft_tokens_total")
    assert plain[0][0] == want and plain[1][0] == want
    assert stopped[0][1] == want_text[:want_text.index(stop)]
    assert accepted > 0.5 * drafted > 0

"""Structured outputs on the real default model (SmolLM2-135M-Instruct, its
49,152-token vocabulary): the engine with a real worker in this process,
greedy, token for token against transformers + xgrammar's logits processor
on the same chat prompt and grammar, async scheduling on; the text parses.
The negative control: unconstrained, the model answers otherwise."""

from __future__ import annotations

import json
import re

import pytest

from controlplane.core.request import FinishReason, Request, SamplingParams
from kvloom_testing.structured import backend_for, choice, hf_constrained_greedy, json_schema, regex
from tests.inprocess.test_async_scheduling import Run

MAX_TOKENS = 64
CITY = {"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24},
                       "country": {"type": "string", "maxLength": 24},
                       "population_millions": {"type": "integer", "minimum": 0, "maximum": 50}},
        "required": ["city", "country", "population_millions"], "additionalProperties": False}
CASES = {
    "json_schema": ("Describe the capital of France as JSON.", json_schema(CITY)),
    "regex": ("Give today's date in ISO format.", regex(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]")),
    "choice": ("Is the Pacific the largest ocean? Answer yes or no.", choice("yes", "no")),
}


@pytest.fixture(scope="module")
def model_dir():
    from kvloom.common.default_model import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="module")
def backend(model_dir):
    b = backend_for(model_dir)
    yield b
    b.shutdown()


@pytest.fixture(scope="module")
def hf(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def run(model_dir, backend):
    r = Run(model_dir, async_scheduling=True, num_blocks=256)
    r.engine.grammar.install(backend)
    yield r
    r.close()


def _prompt(tokenizer, question: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_smollm2_constrained_greedy_equals_transformers(run, backend, hf, kind):
    model, tokenizer = hf
    question, params = CASES[kind]
    prompt = _prompt(tokenizer, question)
    want = hf_constrained_greedy(model, backend, prompt, params, MAX_TOKENS)
    eos = model.config.eos_token_id
    assert want[-1] == eos, "the reference must end within MAX_TOKENS"
    request = Request(kind, prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                   structured_output=params),
                      eos_token_ids=frozenset({eos}))
    got = run.run([request])[kind]
    assert got == want
    assert run.client.final(kind).finish_reason is FinishReason.STOP
    text = tokenizer.decode(want[:-1])
    if kind == "json_schema":
        value = json.loads(text)
        assert set(value) == set(CITY["required"]) and 0 <= value["population_millions"] <= 50
    elif kind == "regex":
        assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", text), text
    else:
        assert text in ("yes", "no"), text
    # Negative control: the model's own greedy answer is not this text.
    free = Request(f"{kind}-free", prompt, SamplingParams(temperature=0.0,
                                                          max_tokens=len(want)))
    assert run.run([free])[f"{kind}-free"] != got

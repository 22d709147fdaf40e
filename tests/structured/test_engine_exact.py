"""Constrained requests through the real engine and a real worker in this
process (kvloom_testing.inprocess), greedy, token for token against
transformers' generate with xgrammar's logits processor on the same grammar:
every constraint kind, async scheduling on and off, beside unconstrained
requests that must not change. The negative control: unconstrained, the
same prompt gives other tokens, so the grammar really decided them."""

from __future__ import annotations

import json
import re

import pytest

from controlplane.core.request import FinishReason, Request, SamplingParams
from kvloom_testing.structured import EXAMPLES, PERSON_SCHEMA, hf_constrained_greedy
from tests.inprocess.test_async_scheduling import Run
from tests.integration.reference import hf_greedy

MAX_TOKENS = 48
PROMPT = [12, 85, 301, 47, 9, 220, 18]


def constrained(req_id: str, kind: str, eos: int, prompt=PROMPT, **params) -> Request:
    return Request(req_id, list(prompt), SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, structured_output=EXAMPLES[kind], **params),
        eos_token_ids=frozenset({eos}))


def free(req_id: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(req_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                  ignore_eos=True))


def check_parses(kind: str, text: str) -> None:
    if kind == "json_schema":
        value = json.loads(text)
        assert set(value) == set(PERSON_SCHEMA["required"])
        assert isinstance(value["name"], str) and len(value["name"]) <= 6
        assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
        assert value["role"] in ("admin", "user", "guest")
    elif kind == "regex":
        assert re.fullmatch(r"[A-Z][a-z]{2,5}-[0-9]{3}", text), text
    elif kind == "ebnf":
        assert re.fullmatch(r"yes|no|maybe [0-9]", text), text
    elif kind == "lark":
        assert re.fullmatch(r"ok[0-9]{2}", text), text
    elif kind == "choice":
        assert text in ("red", "green", "blue sky"), text


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "serial"])
@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_each_kind_equals_transformers_with_xgrammar(runs, backend, hf_model, tokenizer,
                                                     tiny_model_dir, kind, async_scheduling):
    eos = tokenizer.eos_token_id
    want = hf_constrained_greedy(hf_model, backend, PROMPT, EXAMPLES[kind], MAX_TOKENS)
    assert want[-1] == eos, "the grammar must end the reference within MAX_TOKENS"
    run = runs(async_scheduling=async_scheduling)
    deferred = watch_deferred(run)
    neighbour_prompt = [33, 41, 5, 77]
    got = run.run([constrained("c", kind, eos), free("u", neighbour_prompt, 20)])
    assert got["c"] == want
    assert run.client.final("c").finish_reason is FinishReason.STOP
    check_parses(kind, tokenizer.decode(want[:-1]))
    # Negative control: the grammar changed the model's own choice.
    assert hf_greedy(tiny_model_dir, PROMPT, len(want)) != want
    # The unconstrained neighbour is what it is alone.
    assert got["u"] == hf_greedy(tiny_model_dir, neighbour_prompt, 20)
    run.assert_clean()
    assert run.engine.grammar.num_waiting == 0
    # Async: the request's previous token was in flight when later steps were
    # scheduled, so their masks went out after it was applied.
    assert bool(deferred) == async_scheduling


def watch_deferred(run: Run) -> list[int]:
    """The step ids whose masks were deferred behind a step in flight."""
    gate = run.engine.grammar
    plan = gate.plan
    deferred: list[int] = []

    def noting(step, requests, placeholders):
        plan(step, requests, placeholders)
        if step.masks_pending:
            deferred.append(step.scheduler_output.step_id)

    gate.plan = noting
    return deferred

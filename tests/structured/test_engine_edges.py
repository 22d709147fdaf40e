"""Structured outputs beside the engine's other features, in process (real
engine, real worker): seeded sampling, min_tokens and ignore_eos against an
ended grammar, raw logprobs, preemption, prefix caching, aborts while
compiling and while running. Each checks the constrained output against
transformers + xgrammar's logits processor, or against the grammar itself."""

from __future__ import annotations

import re
import threading
import time

from controlplane.core.request import FinishReason, Request, SamplingParams
from kvloom_testing.structured import EXAMPLES, hf_constrained_greedy, regex
from tests.structured.test_engine_exact import PROMPT, watch_deferred

CHOICE_RE = r"red|green|blue sky"


def request(req_id: str, params, eos: int, prompt=PROMPT, **sampling) -> Request:
    sampling = {"temperature": 0.0, "max_tokens": 40, **sampling}
    return Request(req_id, list(prompt), SamplingParams(structured_output=params, **sampling),
                   eos_token_ids=frozenset({eos}))


def test_seeded_sampling_is_valid_and_the_same_async_and_serial(runs, tokenizer):
    eos = tokenizer.eos_token_id
    params = regex(r"[a-z]{3,8}(-[0-9]{2}){1,3}")

    def batch():
        return [request(f"s{i}", params, eos, temperature=0.9, seed=7 + i) for i in range(4)]

    pipelined = runs(async_scheduling=True).run(batch())
    serial = runs(async_scheduling=False).run(batch())
    assert pipelined == serial
    texts = {tokenizer.decode(t[:-1]) for t in pipelined.values()}
    for tokens in pipelined.values():
        assert tokens[-1] == eos
        assert re.fullmatch(r"[a-z]{3,8}(-[0-9]{2}){1,3}", tokenizer.decode(tokens[:-1]))
    assert len(texts) > 1  # the seeds really sampled


def test_min_tokens_yields_to_an_ended_grammar(runs, backend, hf_model, tokenizer):
    """The grammar allows only EOS once a choice is complete; min_tokens would
    forbid it: the grammar wins and the request stops there."""
    eos = tokenizer.eos_token_id
    params = EXAMPLES["choice"]
    want = hf_constrained_greedy(hf_model, backend, PROMPT, params, 40)
    run = runs(async_scheduling=True)
    got = run.run([request("m", params, eos, min_tokens=30)])
    assert got["m"] == want and len(want) < 30
    assert run.client.final("m").finish_reason is FinishReason.STOP
    run.assert_clean()


def test_ignore_eos_goes_on_unconstrained_after_the_grammar_ends(runs, backend, hf_model,
                                                                 tokenizer):
    eos = tokenizer.eos_token_id
    params = EXAMPLES["choice"]
    want = hf_constrained_greedy(hf_model, backend, PROMPT, params, 40)
    run = runs(async_scheduling=True)
    got = run.run([request("i", params, eos, ignore_eos=True, max_tokens=len(want) + 6)])
    assert got["i"][:len(want)] == want  # the grammar's part, its EOS included
    assert len(got["i"]) == len(want) + 6
    assert run.client.final("i").finish_reason is FinishReason.LENGTH


def test_logprobs_are_the_raw_models(runs, backend, hf_model, tokenizer):
    """kvloom documents logprobs as the raw model's: a token the grammar
    forced that the model did not rank first shows its raw rank."""
    eos = tokenizer.eos_token_id
    params = EXAMPLES["json_schema"]
    run = runs(async_scheduling=True)
    got = run.run([request("l", params, eos, logprobs=2)])
    assert got["l"] == hf_constrained_greedy(hf_model, backend, PROMPT, params, 40)
    entries = [lp for o in run.client.of("l") for lp in (o.new_logprobs or [])]
    assert len(entries) == len(got["l"])
    assert any(e.rank > 1 for e in entries)
    assert all(e.logprob <= e.top_logprobs[0] + 1e-6 for e in entries)


def test_preempted_constrained_requests_finish_exact(runs, backend, hf_model, tokenizer):
    eos = tokenizer.eos_token_id
    params = regex(r"([a-z]-){12,15}")  # ~31 tokens on the tiny tokenizer
    prompts = [[11 + i, 200 + i, 37, 5 + i, 90, 61 + i] for i in range(4)]
    want = [hf_constrained_greedy(hf_model, backend, p, params, 34) for p in prompts]
    assert all(w[-1] == eos for w in want)
    # 4 requests of ~37 tokens in 4-token blocks need ~40 blocks: 24 forces preemption.
    run = runs(async_scheduling=True, num_blocks=24)
    run.watch_preemptions()
    deferred = watch_deferred(run)
    got = run.run([request(f"p{i}", params, eos, prompt=p, max_tokens=34)
                   for i, p in enumerate(prompts)])
    assert [got[f"p{i}"] for i in range(4)] == want
    assert run.engine.scheduler.num_preemptions > 0 and deferred
    run.assert_clean()


def test_a_cached_prefix_changes_nothing(runs, backend, hf_model, tokenizer):
    eos = tokenizer.eos_token_id
    params = EXAMPLES["regex"]
    want = hf_constrained_greedy(hf_model, backend, PROMPT * 3, params, 40)
    run = runs(async_scheduling=True)
    first = run.run([request("a", params, eos, prompt=PROMPT * 3)])
    second = run.run([request("b", params, eos, prompt=PROMPT * 3)])
    assert first["a"] == second["b"] == want
    assert run.client.final("b").num_cached_tokens > 0


def test_aborts_while_compiling_and_while_running_free_everything(runs, backend, tokenizer):
    eos = tokenizer.eos_token_id
    run = runs(async_scheduling=True)
    release = threading.Event()
    original = backend._compile
    backend._compile = lambda p: (release.wait(30), original(p))[1]
    try:
        compiling = request("w", regex(r"[q-z]{5}"), eos)
        run.engine.add_request(compiling)
        deadline = time.monotonic() + 30
        while run.engine.grammar.num_waiting != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert run.engine.grammar.num_waiting == 1
        run.engine.abort_requests(["w"])
        run.client.wait_finished("w")
        assert run.client.final("w").finish_reason is FinishReason.ABORT
    finally:
        backend._compile = original
        release.set()
    long_running = request("r", regex(r"[a-z]{30,38}"), eos)
    run.engine.add_request(long_running)
    run.client.wait_for(lambda: len(run.client.tokens("r")) >= 3)
    run.engine.abort_requests(["r"])
    run.client.wait_finished("r")
    assert run.client.final("r").finish_reason is FinishReason.ABORT
    run.assert_clean()
    assert run.engine.grammar.num_waiting == 0
    # The id again, another grammar: a fresh matcher.
    with run.client.cond:
        run.client.outputs.clear()  # the Client keys outputs by id
    again = run.run([request("r", EXAMPLES["choice"], eos)])
    assert re.fullmatch(CHOICE_RE, tokenizer.decode(again["r"][:-1]))

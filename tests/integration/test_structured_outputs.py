"""Structured outputs over live clusters: real controlplane and workerd
processes, real gRPC, requests built by the python client's build_request.

Greedy constrained requests must give, token for token, what transformers'
generate gives under xgrammar's logits processor on the grammar the
controlplane's backend compiles (kvloom_testing.structured), EOS included,
and their text must parse and match the constraint; unconstrained requests
in the same batches must give plain transformers greedy. Negative control:
unconstrained, the same prompt gives other tokens, so the grammar decided.

* Layouts (one cluster each, every request at once): TP=1 with async
  scheduling (masks deferred behind the step in flight) and without, PP=2,
  TP=2 x PP=2; the masks go to the output rank only.
* Seeded sampling under a grammar gives the same tokens at TP=1 async,
  TP=1 serial and PP=2, and stays inside the grammar; n=3 gives three.
* Preemption mid-grammar (a 6-block KV pool), a SIGKILLed rank mid-grammar
  under the supervisor, and a client cancelling mid-grammar (every block
  free after; the request id again, with another grammar, is exact).
* Malformed constraints are INVALID_ARGUMENT naming the field.

Hostile schemas: test_structured_hostile.py. The default tier runs TP=1
async, PP=2, the abort and the invalid specs; the rest is `slow`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, replace

import grpc
import pytest

pytest.importorskip("xgrammar", reason="xgrammar is not installed (scripts/install.sh)")

from controlplane.structured.params import StructuredOutputKind  # noqa: E402
from kvloom_testing.structured import (  # noqa: E402
    EXAMPLES,
    json_schema,
    regex,
)
from tests.integration.api_helpers import assert_no_leaked_blocks, stub_for  # noqa: E402
from tests.integration.conftest import running_cluster  # noqa: E402
from tests.integration.structured_helpers import (  # noqa: E402
    CALL_S,
    Ask,
    Sample,
    check_text,
    generate,
    grammar_steps_by_rank,
    metric,
    output_rank,
    status_and_details,
)

# A JSON object whose one string is 60-80 characters: ~50 tokens, the
# longest-running greedy request of a layout.
NOTE_SCHEMA = {
    "type": "object",
    "properties": {"note": {"type": "string", "minLength": 60, "maxLength": 80}},
    "required": ["note"],
    "additionalProperties": False,
}
SEEDED_RE = r"[a-z]{3,8}(-[0-9]{2}){1,3}"

GREEDY = [
    Ask("json", (12, 85, 301, 47, 9, 220, 18), EXAMPLES["json_schema"], 48),
    Ask("regex", (40, 7, 133, 260, 5), EXAMPLES["regex"], 48),
    Ask("choice", (77, 3, 19, 402), EXAMPLES["choice"], 16),
    Ask("note", (21, 140, 7, 33), json_schema(NOTE_SCHEMA), 96),
    Ask("free", (33, 41, 5, 77), None, 24),
    Ask("free-long", (9, 300, 12, 250, 61, 4), None, 40),
]
SEEDED = [
    Ask("seeded-json", (15, 90, 222, 8), EXAMPLES["json_schema"], 128, temperature=0.8,
        seed=11),
    Ask("seeded-regex", (101, 6, 58), regex(SEEDED_RE), 64, temperature=0.8, seed=12),
    Ask("seeded-n3", (64, 2, 310, 17, 45), regex(SEEDED_RE), 64, temperature=0.8, seed=13, n=3),
    Ask("seeded-free", (5, 6, 7, 8), None, 16, temperature=0.8, seed=14),
]


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    args: tuple[str, ...] = ()


LAYOUTS = {
    "tp1-async": Layout(1, 1),
    "tp1-serial": Layout(1, 1, ("--no-async-scheduling",)),
    "pp2": Layout(1, 2),
    "tp2xpp2": Layout(2, 2),
}


# ---- one cluster per layout ----------------------------------------------------------

@pytest.fixture(scope="module")
def tp1(tiny_model_dir):
    """TP=1, async scheduling (the default): the layouts' tp1-async cluster,
    shared with the abort and invalid-spec tests."""
    with running_cluster(tiny_model_dir) as cluster:
        yield cluster


@dataclass
class Served:
    results: dict[str, dict[int, Sample]]
    grammar_steps: list[float]  # per rank


_SERVED: dict[tuple[str, str], Served] = {}


def served(layout: str, request: pytest.FixtureRequest, model_dir: str) -> Served:
    """Every GREEDY and SEEDED request at once on `layout`'s cluster; run once
    per session and layout (the seeded test compares layouts)."""
    key = (model_dir, layout)
    if key not in _SERVED:
        if layout == "tp1-async":
            _SERVED[key] = _serve(request.getfixturevalue("tp1"))
        else:
            spec = LAYOUTS[layout]
            with running_cluster(model_dir, tp=spec.tp, pp=spec.pp, args=spec.args) as cluster:
                _SERVED[key] = _serve(cluster)
    return _SERVED[key]


def _serve(cluster) -> Served:
    async def scenario():
        async with grpc.aio.insecure_channel(cluster.api_address) as channel:
            stub = stub_for(channel)
            asks = [*GREEDY, *SEEDED]
            results = await asyncio.gather(*(generate(stub, a.request()) for a in asks))
            await assert_no_leaked_blocks(stub)
            return dict(zip((a.name for a in asks), results, strict=True))

    results = asyncio.run(scenario())
    return Served(results, grammar_steps_by_rank(cluster))


@pytest.mark.parametrize("layout", [
    "tp1-async",
    "pp2",
    pytest.param("tp1-serial", marks=pytest.mark.slow),
    pytest.param("tp2xpp2", marks=pytest.mark.slow),
])
def test_constrained_beside_free_requests_token_exact(layout, request, tiny_model_dir,
                                                       reference, tokenizer):
    got = served(layout, request, tiny_model_dir)
    for ask in GREEDY:
        reference.check(ask, got.results[ask.name], tokenizer, layout)
    # The masks went to the output rank, and to it alone.
    spec = LAYOUTS[layout]
    out = output_rank(spec.tp, spec.pp)
    steps = got.grammar_steps
    assert steps[out] > 0 and all(n == 0 for r, n in enumerate(steps) if r != out), steps


@pytest.mark.slow
def test_seeded_constrained_sampling_is_the_same_across_layouts(request, tiny_model_dir,
                                                                 tokenizer):
    """No reference for sampling: the same seeds give the same tokens at TP=1
    async, TP=1 serial and PP=2, and every sample is inside its grammar."""
    runs = {layout: served(layout, request, tiny_model_dir).results
            for layout in ("tp1-async", "tp1-serial", "pp2")}
    eos = tokenizer.eos_token_id
    for ask in SEEDED:
        by_layout = {layout: {i: s.tokens for i, s in res[ask.name].items()}
                     for layout, res in runs.items()}
        first = by_layout["tp1-async"]
        for layout, tokens in by_layout.items():
            assert tokens == first, f"{ask.name}: {layout} differs from tp1-async"
        samples = runs["tp1-async"][ask.name]
        assert sorted(samples) == list(range(ask.n or 1)), ask.name
        for i, s in samples.items():
            if ask.params is None:
                assert s.finish == "length" and len(s.tokens) == ask.max_tokens
                continue
            assert s.finish == "stop" and s.tokens[-1] == eos, f"{ask.name}[{i}] did not end"
            check_text(ask.params, tokenizer.decode(s.tokens[:-1]))
    n3 = runs["tp1-async"]["seeded-n3"]
    assert len({tuple(s.tokens) for s in n3.values()}) > 1, "n=3: the seeds did not sample"


# ---- preemption --------------------------------------------------------------------

PREEMPT_RE = r"([a-z]-){12,15}"  # ~31 tokens on the tiny tokenizer
PREEMPT_ASKS = [
    *(Ask(f"p{i}", (11 + i, 200 + i, 37, 5 + i, 90, 61 + i), regex(PREEMPT_RE), 40)
      for i in range(4)),
    Ask("p-note", (22, 141, 7, 34), json_schema(NOTE_SCHEMA), 64),
    Ask("p-free", (3, 9, 27, 81), None, 48),
]


@pytest.mark.slow
def test_preempted_mid_grammar_token_exact(tiny_model_dir, reference, tokenizer):
    """Six 16-token blocks for requests that need up to 16 together: the
    scheduler preempts (by recompute) constrained requests mid-grammar, whose
    matchers stay at their last real token."""
    args = ("--num-gpu-blocks-override", "6")
    with running_cluster(tiny_model_dir, args=args) as cluster:
        async def scenario():
            async with grpc.aio.insecure_channel(cluster.api_address) as channel:
                stub = stub_for(channel)
                results = await asyncio.gather(*(generate(stub, a.request())
                                                 for a in PREEMPT_ASKS))
                await assert_no_leaked_blocks(stub)
                return results

        results = asyncio.run(scenario())
        preemptions = metric(cluster.metrics_address, "kvloom_num_preemptions_total")
        waiting = metric(cluster.metrics_address, "kvloom_num_requests_waiting_for_grammar")
    assert preemptions >= 1, "the pool never ran short: nothing was preempted"
    assert waiting == 0
    for ask, got in zip(PREEMPT_ASKS, results, strict=True):
        reference.check(ask, got, tokenizer, "preempted")


# ---- a rank killed mid-grammar ---------------------------------------------------------

LONG_RE = r"([a-z][0-9]){60,70}"  # ~140 tokens
RECOVERY_ASKS = [
    Ask("k-a", (21, 140, 7, 33), regex(LONG_RE), 200),
    Ask("k-b", (22, 141, 7, 34), regex(LONG_RE), 200),
    Ask("k-free", (5, 6, 7, 8), None, 160),
]
# Tokens every stream has before the kill.
PROGRESS = 6


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "victim"), [(1, 2, 1), (1, 1, 0)],
                         ids=["pp2-output-rank", "tp1-async"])
def test_a_rank_killed_mid_grammar_loses_nothing(tiny_model_dir, reference, tokenizer,
                                                 tp, pp, victim):
    """The supervisor restarts the SIGKILLed rank; the group re-forms and the
    held constrained streams, recomputed from their tokens so far, finish
    exactly (the controlplane's matchers never saw the lost step's tokens)."""
    from tests.integration.test_recovery import _kill, supervised

    with supervised(tiny_model_dir, tp=tp, pp=pp) as cluster:
        async def scenario():
            async with grpc.aio.insecure_channel(cluster.api_address) as channel:
                stub = stub_for(channel)
                counts = {a.name: 0 for a in RECOVERY_ASKS}

                def progress(name):
                    def note(samples):
                        counts[name] = len(samples[0].tokens)
                    return note

                tasks = [asyncio.create_task(generate(stub, a.request(),
                                                      on_tokens=progress(a.name)))
                         for a in RECOVERY_ASKS]
                deadline = time.monotonic() + CALL_S
                while min(counts.values()) < PROGRESS:
                    ended = [a.name for a, t in zip(RECOVERY_ASKS, tasks, strict=True)
                             if t.done()]
                    assert not ended, f"ended before the kill: {ended}, {counts}"
                    assert time.monotonic() < deadline, f"no progress: {counts}"
                    await asyncio.sleep(0.005)
                _kill(cluster, victim)
                at_kill = dict(counts)
                results = await asyncio.wait_for(asyncio.gather(*tasks), CALL_S)
                await assert_no_leaked_blocks(stub)
                return at_kill, results

        at_kill, results = asyncio.run(scenario())
        recoveries = metric(cluster.metrics_address, "kvloom_recoveries_total")
        recovered = metric(cluster.metrics_address, "kvloom_requests_recovered_total")
        restarted = [r.rank for r in cluster.restarts]
    assert restarted == [victim]
    assert recoveries == 1 and recovered >= len(RECOVERY_ASKS), (recoveries, recovered)
    for ask, got in zip(RECOVERY_ASKS, results, strict=True):
        # The kill landed mid-grammar (mid-generation for the free one).
        assert at_kill[ask.name] < len(reference.want(ask)), (ask.name, at_kill)
        reference.check(ask, got, tokenizer, "after the kill")


# ---- a client walking away mid-grammar ----------------------------------------------------

def test_a_cancelled_constrained_stream_frees_everything(tp1, reference, tokenizer):
    """The client cancels a constrained stream mid-grammar: every block is
    free again, nothing waits for a grammar, the free request beside it is
    untouched, and the same request id with another constraint gets its own
    grammar (the choice, exactly)."""
    long_ask = Ask("reused-id", (21, 140, 7, 33), regex(LONG_RE), 200)
    again = replace(GREEDY[2], name="reused-id")  # the choice, under the same id
    free = Ask("beside", (33, 41, 5, 77), None, 24)

    async def scenario():
        async with grpc.aio.insecure_channel(tp1.api_address) as channel:
            stub = stub_for(channel)
            beside = asyncio.create_task(generate(stub, free.request()))
            call = stub.Generate(long_ask.request(), timeout=CALL_S)
            tokens: list[int] = []
            while len(tokens) < 3:
                msg = await asyncio.wait_for(call.read(), CALL_S)
                assert msg is not grpc.aio.EOF and not msg.HasField("finish"), tokens
                tokens.extend(msg.token_ids)
            call.cancel()
            await assert_no_leaked_blocks(stub)
            waiting = metric(tp1.metrics_address, "kvloom_num_requests_waiting_for_grammar")
            reused = await generate(stub, again.request())
            await assert_no_leaked_blocks(stub)
            return tokens, await beside, waiting, reused

    tokens, beside, waiting, reused = asyncio.run(scenario())
    want_long = reference.want(long_ask)
    assert tokens == want_long[:len(tokens)] and len(tokens) < len(want_long)
    assert waiting == 0
    reference.check(free, beside, tokenizer)
    reference.check(again, reused, tokenizer, "under a reused id")


# ---- invalid constraints -------------------------------------------------------------------

INVALID_SPECS = [
    ("sampling.json_schema", "multipleOf",
     {"json_schema": json.dumps({"type": "integer", "multipleOf": 3})}),
    # xgrammar's own refusal comes from the compile (off the API's threads),
    # before the request reaches the scheduler.
    ("sampling.regex", "is not a valid regular expression: Regex parsing error",
     {"regex": "([a-z"}),
    ("sampling.json_any_whitespace", "applies only to json_schema and json_object",
     {"regex": "[a-z]+", "json_any_whitespace": False}),
    ("sampling.choice.choices[1]", "is empty", {"choice": ["yes", ""]}),
]


def test_invalid_constraints_are_invalid_argument_naming_the_field(tp1):
    from kvloom.api import build_request

    async def scenario():
        async with grpc.aio.insecure_channel(tp1.api_address) as channel:
            stub = stub_for(channel)
            answers = [await status_and_details(
                stub, build_request([5, 6, 7], max_tokens=8, request_id=f"bad-{i}", **kw))
                for i, (_, _, kw) in enumerate(INVALID_SPECS)]
            await assert_no_leaked_blocks(stub)
            return answers

    answers = asyncio.run(scenario())
    for (field, words, _), (code, details) in zip(INVALID_SPECS, answers, strict=True):
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (field, code, details)
        assert field in details and words in details, (field, details)


def test_constraint_kinds_round_trip_through_the_client():
    """build_request puts each kind in its oneof branch (what the tests send)."""
    for params in (*EXAMPLES.values(), json_schema(NOTE_SCHEMA, any_whitespace=True)):
        sp = Ask("x", (1,), params, 4).request().sampling
        branch = sp.WhichOneof("constraint")
        expected = ("grammar" if params.kind is StructuredOutputKind.GRAMMAR
                    else params.kind.value)
        assert branch == expected
        if params.kind is StructuredOutputKind.JSON_SCHEMA:
            assert sp.json_any_whitespace is params.any_whitespace
        else:
            assert not sp.HasField("json_any_whitespace")

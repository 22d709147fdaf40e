"""Speculative decoding in process: the real Scheduler and EngineCore over a
real workerd Worker (InProcessExecutor), against transformers and against
the same engine without drafts.

Two proposers. The n-gram one (the product) on a tiny checkpoint with tied
embeddings, whose greedy output runs in repeats (so n-gram drafts are often
right and sometimes wrong). And an oracle that knows each prompt's reference
continuation and corrupts every third draft, so every test sees accepted
runs, rejections at every position and steps that emit several tokens,
whatever the model: verification must keep the output exact either way.
"""

from __future__ import annotations

import pytest

from controlplane.spec_decode.config import SpeculativeConfig
from kvloom_testing.checkpoints import make_tiny_llama
from tests.controlplane.core.helpers import make_request
from tests.controlplane.engine.test_engine import _prompt
from tests.inprocess.test_async_scheduling import Run
from tests.integration.reference import hf_greedy

NGRAM = SpeculativeConfig("ngram", 4, 2, 4)


@pytest.fixture(scope="module")
def echo_model_dir(tmp_path_factory) -> str:
    """Tied embeddings: the tiny model's greedy output repeats a token for a
    while, then moves on; n-gram drafts hit and miss."""
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny_echo"), tie_word_embeddings=True))


@pytest.fixture
def runs(echo_model_dir):
    opened: list[Run] = []

    def open_run(**kwargs) -> Run:
        run = Run(echo_model_dir, **kwargs)
        opened.append(run)
        return run

    yield open_run
    for run in opened:
        run.close()


class Oracle:
    """Proposes each prompt's reference continuation, every third draft
    (by output position) replaced by another token."""

    def __init__(self, references: dict[tuple[int, ...], list[int]]):
        self.references = references
        self.calls = 0

    def __call__(self, token_ids, k: int) -> list[int]:
        self.calls += 1
        for prompt, reference in self.references.items():
            if tuple(token_ids[:len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                return [t if (done + j) % 3 != 2 else (t + 1) % 500
                        for j, t in enumerate(reference[done:done + k])]
        return []


def _greedy(prompts: list[list[int]], max_tokens: int, **params):
    return [make_request(p, max_tokens=max_tokens, req_id=f"r{i}", temperature=0.0,
                         ignore_eos=True, **params) for i, p in enumerate(prompts)]


def _with_oracle(run: Run, references: dict) -> Oracle:
    oracle = Oracle(references)
    run.engine.scheduler.spec.proposer = oracle
    return oracle


PROMPTS = [_prompt(5, 40), _prompt(17, 41), _prompt(3, 42)]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "serial"])
def test_ngram_drafts_keep_greedy_output_exact(runs, echo_model_dir, async_scheduling):
    run = runs(async_scheduling=async_scheduling, speculative=NGRAM)
    requests = _greedy(PROMPTS, 40)
    got = run.run(requests)
    for request in requests:
        assert got[request.request_id] == hf_greedy(
            echo_model_dir, request.prompt_token_ids, request.max_tokens)
    stats = run.engine.scheduler.spec.stats
    # Drafts were verified, some accepted and some not, and steps emitted
    # several tokens: fewer steps than tokens.
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert len(run.client.records) < sum(r.max_tokens for r in requests)
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    run.assert_clean()


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "serial"])
def test_oracle_drafts_rejected_at_every_position_keep_output_exact(
        runs, echo_model_dir, async_scheduling):
    references = {tuple(p): hf_greedy(echo_model_dir, p, 30) for p in PROMPTS}
    run = runs(async_scheduling=async_scheduling, speculative=NGRAM)
    oracle = _with_oracle(run, references)
    got = run.run(_greedy(PROMPTS, 30))
    assert got == {f"r{i}": references[tuple(p)] for i, p in enumerate(PROMPTS)}
    stats = run.engine.scheduler.spec.stats
    assert oracle.calls and stats.num_accepted_tokens < stats.num_draft_tokens
    # Every draft position saw acceptances.
    assert all(n > 0 for n in stats.num_accepted_tokens_per_pos[:2])
    run.assert_clean()


def test_chunked_prefill_and_a_small_budget_cap_the_drafts(runs, echo_model_dir):
    prompts = [_prompt(29, 50), _prompt(23, 51), _prompt(31, 52)]
    references = {tuple(p): hf_greedy(echo_model_dir, p, 20) for p in prompts}
    run = runs(async_scheduling=True, speculative=NGRAM, max_num_batched_tokens=8)
    _with_oracle(run, references)
    got = run.run(_greedy(prompts, 20))
    assert got == {f"r{i}": references[tuple(p)] for i, p in enumerate(prompts)}
    # No step went over its budget, drafts included.
    assert max(r.num_scheduled_tokens for r in run.client.records) <= 8
    run.assert_clean()


def test_preemption_with_drafts_keeps_output_exact(runs, echo_model_dir):
    prompts = [_prompt(14, 60 + i) for i in range(6)]
    references = {tuple(p): hf_greedy(echo_model_dir, p, 34) for p in prompts}
    # 6 requests of up to 48 tokens in 4-token blocks need 72 blocks; 30 force
    # preemptions. (Drafts out hold the batch at PP = 1, so none is preempted
    # with its drafts out here: test_spec_decode_scheduler.py covers that.)
    run = runs(async_scheduling=True, speculative=NGRAM, num_blocks=30)
    _with_oracle(run, references)
    got = run.run(_greedy(prompts, 34))
    assert got == {f"r{i}": references[tuple(p)] for i, p in enumerate(prompts)}
    assert run.engine.scheduler.num_preemptions > 0
    run.assert_clean()


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 13])
def test_max_tokens_reached_inside_an_accepted_run(runs, echo_model_dir, max_tokens):
    prompt = _prompt(6, 70)
    reference = hf_greedy(echo_model_dir, prompt, max_tokens)
    run = runs(async_scheduling=True, speculative=NGRAM)
    # Drafts never wrong here: each step would run to max_tokens at once.
    run.engine.scheduler.spec.proposer = lambda ids, k: reference[len(ids) - 6:][:k]
    got = run.run(_greedy([prompt], max_tokens))
    assert got["r0"] == reference
    run.assert_clean()


def test_a_stop_token_inside_an_accepted_run_drops_the_rest(runs, echo_model_dir):
    prompt = _prompt(7, 80)
    reference = hf_greedy(echo_model_dir, prompt, 30)
    # The first token that differs from the one before: a run of accepted
    # drafts ends on it, and tokens after it were accepted in the same step.
    stop_at = next(i for i in range(3, 30) if reference[i] not in reference[:i])
    run = runs(async_scheduling=True, speculative=NGRAM)
    run.engine.scheduler.spec.proposer = lambda ids, k: reference[len(ids) - 7:][:k]
    request = make_request(prompt, max_tokens=30, req_id="s", temperature=0.0,
                           ignore_eos=True, stop_token_ids=[reference[stop_at]])
    got = run.run([request])
    assert got["s"] == reference[:stop_at + 1]
    # Several tokens per step, and the stop came inside a multi-token step.
    outputs = run.client.of("s")
    assert outputs[-1].finish_reason is not None and len(outputs) < stop_at + 1
    run.assert_clean()


def test_logprobs_and_min_tokens_match_the_run_without_drafts(runs, echo_model_dir):
    prompts = [_prompt(6, 90), _prompt(9, 91)]
    # EOS is a token the reference emits early: min_tokens must hold it back
    # in every row of a verified run, exactly as without drafts.
    reference = hf_greedy(echo_model_dir, prompts[0], 12)
    eos = reference[1]

    def requests():
        out = []
        for i, p in enumerate(prompts):
            r = make_request(p, max_tokens=16, req_id=f"r{i}", temperature=0.0, logprobs=2,
                             min_tokens=8, repetition_penalty=1.3)
            r.eos_token_ids = frozenset({eos})
            out.append(r)
        return out

    plain = runs(async_scheduling=True)
    want = plain.run(requests())
    spec = runs(async_scheduling=True, speculative=NGRAM)
    # The penalty leaves n-gram nothing to find: the oracle drafts from the plain run.
    _with_oracle(spec, {tuple(p): want[f"r{i}"] for i, p in enumerate(prompts)})
    got = spec.run(requests())
    assert got == want
    assert spec.engine.scheduler.spec.stats.num_accepted_tokens > 0
    for req_id in want:
        plain_lps = [lp for o in plain.client.of(req_id) for lp in o.new_logprobs or ()]
        spec_lps = [lp for o in spec.client.of(req_id) for lp in o.new_logprobs or ()]
        assert len(spec_lps) == len(want[req_id]) == len(plain_lps)
        for a, b in zip(plain_lps, spec_lps, strict=True):
            assert a.top_token_ids == b.top_token_ids and a.rank == b.rank
            assert abs(a.logprob - b.logprob) < 1e-4
    spec.assert_clean()


def test_seeded_sampling_with_drafts_is_reproducible(runs):
    # Serial steps: the drafts (and so the draws they consume) are the same
    # every run; async ones depend on which outputs are in when a step is
    # scheduled, which varies with timing.
    def requests():
        return [make_request(p, max_tokens=24, req_id=f"r{i}", temperature=0.8, seed=7 + i,
                             ignore_eos=True) for i, p in enumerate(PROMPTS)]

    first = runs(async_scheduling=False, speculative=NGRAM).run(requests())
    second = runs(async_scheduling=False, speculative=NGRAM).run(requests())
    assert first == second


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory) -> str:
    """Another tiny Llama (its own random weights) over the same tokenizer."""
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny_draft"), num_layers=1, seed=5))


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "serial"])
def test_a_draft_model_on_the_output_rank_keeps_greedy_output_exact(
        runs, echo_model_dir, other_draft_dir, async_scheduling):
    requests = _greedy(PROMPTS, 30)
    # The target drafting for itself: its greedy drafts are its own greedy
    # tokens, so nearly every draft is accepted.
    same = runs(async_scheduling=async_scheduling,
                speculative=SpeculativeConfig("draft_model", 4, model=echo_model_dir))
    got = same.run(requests)
    for request in requests:
        assert got[request.request_id] == hf_greedy(
            echo_model_dir, request.prompt_token_ids, request.max_tokens)
    stats = same.engine.scheduler.spec.stats
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 0
    same.assert_clean()
    assert same.executor.runner.drafter._caches == {}
    # Another model's drafts: mostly rejected, the output still the target's.
    other = runs(async_scheduling=async_scheduling,
                 speculative=SpeculativeConfig("draft_model", 4, model=other_draft_dir))
    assert other.run(_greedy(PROMPTS, 30)) == got
    stats = other.engine.scheduler.spec.stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    other.assert_clean()


@pytest.mark.parametrize("family", ["gemma3", "mistral-window", "qwen3-moe"])
def test_other_families_verify_drafts_exactly(tmp_path, family):
    """Sliding windows (blocks freed as they leave the window while drafts
    come and go), Gemma 3's local and global layers, MoE experts."""
    from kvloom_testing.families import make_tiny_checkpoint

    model_dir = str(make_tiny_checkpoint(tmp_path, family, seed=7))
    prompts = [_prompt(9, 100), _prompt(4, 101)]
    references = {tuple(p): hf_greedy(model_dir, p, 24) for p in prompts}
    run = Run(model_dir, async_scheduling=True, speculative=NGRAM)
    try:
        _with_oracle(run, references)
        got = run.run(_greedy(prompts, 24))
        assert got == {f"r{i}": references[tuple(p)] for i, p in enumerate(prompts)}
        stats = run.engine.scheduler.spec.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        run.assert_clean()
    finally:
        run.close()

"""The tiny Llama with the sampling knobs, under the real controlplane Scheduler
(each step through kvloom_testing.inprocess.InProcessExecutor: both wire modules, bytes,
a real Worker), against transformers on the same weights.

* Sampled-token logprobs (logprob, 1-based rank, top-N) equal log_softmax of
  transformers' logits at the same position, for greedy and seeded sampling,
  and requests that did not ask get None in the same batch.
* Prompt logprobs of a prompt prefilled in two chunks equal transformers' for
  every position >= 1; the partial chunk returns its share without sampling,
  and a recompute after preemption does not return them twice.
* Greedy with repetition_penalty equals generate(repetition_penalty=...),
  and min_tokens (the scheduler's stop ids, masked on the worker) holds EOS
  off like generate(min_new_tokens=...).
* (slow) TP=2 x PP=2 ranks replaying the same broadcast return the same logprobs.
"""

from __future__ import annotations

import pytest
import torch

from controlplane.core.request import FinishReason, Request, SamplingParams
from kvloom_testing.checkpoints import TOKENIZER_VOCAB_SIZE
from kvloom_testing.inprocess import (
    InProcessExecutor,
    ScheduleWatch,
    output_tokens,
    run_to_completion,
)
from kvloom_testing.replay import replay_layout, replayed_outputs
from kvloom_testing.scheduler import make_scheduler
from tests.controlplane.core.helpers import make_request

torch.set_num_threads(1)

ATOL = 1e-4


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab]: row q is log p(token q + 1 | tokens <= q)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _check_entry(entry, ref_row: torch.Tensor, token: int, num_top: int) -> None:
    want = ref_row[token].item()
    assert entry.logprob == pytest.approx(want, abs=ATOL)
    # Rank from the reference, allowing only float-level near-ties to differ.
    strictly_better = int((ref_row > want + ATOL).sum())
    assert strictly_better + 1 <= entry.rank <= int((ref_row > want - ATOL).sum()) + 1
    top = ref_row.topk(num_top)
    assert len(entry.top_token_ids) == len(entry.top_logprobs) == num_top
    assert entry.top_token_ids == top.indices.tolist()
    torch.testing.assert_close(torch.tensor(entry.top_logprobs), top.values, atol=ATOL, rtol=0)


def _prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, TOKENIZER_VOCAB_SIZE, (n,), generator=g).tolist() for n in lengths]


def _request(req_id, prompt, max_tokens, priority=0, arrival=0.0, **params):
    params.setdefault("temperature", 0.0)
    return make_request(
        prompt, max_tokens=max_tokens, req_id=req_id, priority=priority, arrival_time=arrival,
        ignore_eos=True, **params,
    )


def test_sampled_token_logprobs_match_transformers(tiny_model_dir, hf_model):
    params = {
        "g": dict(logprobs=5),
        "s": dict(temperature=1.0, seed=7, logprobs=0),
        "n": dict(),
        # Penalties change what is sampled, never the (raw) logprobs.
        "p": dict(logprobs=3, repetition_penalty=3.0),
    }
    prompts = dict(zip(params, _prompts([9, 6, 5, 7]), strict=True))
    executor = InProcessExecutor(tiny_model_dir, num_gpu_blocks=48)
    sched = make_scheduler(executor)
    reqs = [_request(r, prompts[r], 7, **params[r]) for r in params]
    steps = run_to_completion(sched, executor, {0: reqs})
    entries: dict[str, list] = {r: [] for r in params}
    for _, out, outputs in steps:
        if out.req_ids:
            # The worker's reply: aligned with req_ids, None for "did not ask".
            assert len(out.logprobs) == len(out.req_ids)
            for req_id, entry in zip(out.req_ids, out.logprobs, strict=True):
                assert (entry is None) == ("logprobs" not in params[req_id])
        for o in outputs:
            if o.new_logprobs is not None:
                entries[o.request_id].extend(o.new_logprobs)
    tokens = output_tokens(steps)
    ranks = []
    for req_id, p in params.items():
        if "logprobs" not in p:
            assert entries[req_id] == []
            continue
        outputs = tokens[req_id]
        assert len(entries[req_id]) == len(outputs) == 7
        ref = _hf_logprobs(hf_model, prompts[req_id] + outputs)
        for j, (token, entry) in enumerate(zip(outputs, entries[req_id], strict=True)):
            _check_entry(entry, ref[len(prompts[req_id]) - 1 + j], token, p["logprobs"])
            ranks.append(entry.rank)
    # Greedy rows rank 1; the sampled and penalized rows must reach lower ranks.
    assert all(e.rank == 1 for e in entries["g"])
    assert max(ranks) > 1


def test_prompt_logprobs_over_two_chunks_match_transformers(tiny_model_dir, hf_model):
    """a (11 tokens) arrives last under a 16-token budget: its prompt is split
    5 + 6. On 7 blocks without prefix cache, as the lowest priority, it is then
    preempted after sampling and recomputed from 0 in chunks."""
    a_prompt, b_prompt, z_prompt = _prompts([11, 5, 6])
    executor = InProcessExecutor(tiny_model_dir, num_gpu_blocks=7)
    sched = make_scheduler(
        executor, max_num_batched_tokens=16, enable_prefix_caching=False, policy="priority"
    )
    reqs = [
        _request("b", b_prompt, 10, arrival=0.0),
        _request("z", z_prompt, 10, arrival=1.0, prompt_logprobs=0),
        _request("a", a_prompt, 6, priority=9, arrival=2.0, prompt_logprobs=4, logprobs=2),
    ]
    watch = ScheduleWatch(sched, executor)
    steps = run_to_completion(sched, executor, {0: reqs}, on_step=watch)
    for event in ("preempted_after_sampling", "recomputed_in_chunks"):
        assert "a" in watch.events[event], event

    # Chunk 1 of a (5 of 11 tokens) samples nothing but returns positions 1..5:
    # its last position predicts token 5, the first one of the next chunk.
    (so, out, _), (_, out2, _) = steps[:2]
    assert so.num_scheduled_tokens == {"b": 5, "z": 6, "a": 5}
    assert sorted(out.req_ids) == ["b", "z"]
    chunks = {c.req_id: c for c in out.prompt_logprobs}
    assert {r: (c.start_position, len(c.positions)) for r, c in chunks.items()} == {
        "a": (1, 5),
        "z": (1, 5),
    }
    # Positions 6..10; position 10's logits predict the first output instead.
    (second,) = out2.prompt_logprobs
    assert (second.req_id, second.start_position, len(second.positions)) == ("a", 6, 5)
    assert out2.logprobs[out2.req_ids.index("a")] is not None

    # What the controlplane hands the client streams: each chunk exactly once,
    # none again for the recompute after preemption.
    streamed = {"a": [], "z": []}
    for _, _, outputs in steps:
        for o in outputs:
            if o.prompt_logprobs is not None:
                streamed[o.request_id].append(o.prompt_logprobs)
    assert [(c.start_position, len(c.positions)) for c in streamed["a"]] == [(1, 5), (6, 5)]
    for req_id, prompt, num_top in (("a", a_prompt, 4), ("z", z_prompt, 0)):
        ref = _hf_logprobs(hf_model, prompt)
        entries = [e for c in streamed[req_id] for e in c.positions]
        assert len(entries) == len(prompt) - 1
        for p, entry in enumerate(entries, start=1):
            _check_entry(entry, ref[p - 1], prompt[p], num_top)


def _hf_generate(hf_model, prompt, n, **kwargs):
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0, **kwargs
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_repetition_penalty_matches_transformers_generate(tiny_model_dir, hf_model):
    n = 10
    penalty = 1.8
    r0, r1 = _prompts([8, 12])
    prompts = {"r0": r0, "plain": r0, "r1": r1}
    executor = InProcessExecutor(tiny_model_dir, num_gpu_blocks=64)
    # r1 arrives last under a 21-token budget: it prefills in two chunks
    # next to the others (plain shares r0's prompt, so it hits r0's blocks).
    sched = make_scheduler(executor, max_num_batched_tokens=21)
    reqs = [
        _request("r0", r0, n, repetition_penalty=penalty),
        _request("plain", r0, n),
        _request("r1", r1, n, repetition_penalty=penalty),
    ]
    watch = ScheduleWatch(sched, executor)
    tokens = output_tokens(run_to_completion(sched, executor, {0: reqs}, on_step=watch))
    assert watch.events["chunked_prefill"] == {"r1"}
    differs = False
    for req_id in ("r0", "r1"):
        expected = _hf_generate(hf_model, prompts[req_id], n, repetition_penalty=penalty)
        assert len(expected) >= 3
        assert tokens[req_id][: len(expected)] == expected, req_id
        differs |= expected != _hf_generate(hf_model, prompts[req_id], n)[: len(expected)]
    # The penalty must matter for the comparison to mean anything, and the
    # unpenalized row in the same batch must stay plain greedy.
    assert differs
    plain = _hf_generate(hf_model, prompts["plain"], n)
    assert tokens["plain"][: len(plain)] == plain


def test_min_tokens_holds_off_eos_like_transformers(tiny_model_dir, hf_model):
    """A prompt whose greedy continuation hits EOS early: with min_tokens the
    scheduler sends EOS as a stop id the worker masks, and the request keeps
    generating exactly like generate(min_new_tokens=...)."""
    eos = hf_model.config.eos_token_id
    # Find a prompt whose plain greedy output contains EOS within a few tokens.
    prompt = None
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        cand = torch.randint(2, TOKENIZER_VOCAB_SIZE, (6,), generator=g).tolist()
        if eos in _hf_generate(hf_model, cand, 6):
            prompt = cand
            break
    if prompt is None:
        pytest.skip("no prompt of the tiny model reaches EOS quickly")
    n = 8
    executor = InProcessExecutor(tiny_model_dir, num_gpu_blocks=64)
    sched = make_scheduler(executor)
    params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)
    req = Request("m", prompt, params, eos_token_ids=frozenset({eos}))
    steps = run_to_completion(sched, executor, {0: [req]})
    expected = _hf_generate(hf_model, prompt, n, min_new_tokens=n, eos_token_id=eos)
    tokens = output_tokens(steps)["m"]
    assert eos not in tokens
    assert tokens == expected
    assert steps[-1][2][-1].finish_reason is FinishReason.LENGTH


@pytest.mark.slow
def test_tp2_pp2_ranks_return_the_same_logprobs(tiny_model_dir, tmp_path):
    """Prompt-logprob rows widen the last stage's compute_logits, a TP
    collective: every rank must choose the same rows or the step hangs."""
    a_prompt, b_prompt, c_prompt = _prompts([10, 6, 7])
    executor = InProcessExecutor(tiny_model_dir, num_gpu_blocks=48)
    # a arrives second under a 10-token budget: its prompt is split 4 + 6.
    sched = make_scheduler(executor, max_num_batched_tokens=10)
    arrivals = {
        0: [
            _request("b", b_prompt, 4, temperature=0.8, seed=5, logprobs=0,
                     repetition_penalty=1.3),
            _request("a", a_prompt, 4, prompt_logprobs=2, logprobs=1),
        ],
        1: [_request("c", c_prompt, 4)],
    }
    run_to_completion(sched, executor, arrivals)
    tp, pp = 2, 2
    replay_layout(executor, tiny_model_dir, str(tmp_path), tp, pp)
    got = replayed_outputs(tmp_path / f"rank{(pp - 1) * tp}.pt")

    def flat(out):
        entries = [e for e in out.logprobs if e is not None]
        entries += [e for c in out.prompt_logprobs for e in c.positions]
        return entries

    for want, have in zip(executor.replies, got, strict=True):
        assert (have.req_ids, have.sampled_token_ids) == (want.req_ids, want.sampled_token_ids)
        assert [None if e is None else e.rank for e in have.logprobs] == [
            None if e is None else e.rank for e in want.logprobs
        ]
        assert [(c.req_id, c.start_position) for c in have.prompt_logprobs] == [
            (c.req_id, c.start_position) for c in want.prompt_logprobs
        ]
        for h, w in zip(flat(have), flat(want), strict=True):
            assert h.logprob == pytest.approx(w.logprob, abs=ATOL)
            assert h.top_token_ids == w.top_token_ids
    assert any(out.prompt_logprobs for out in executor.replies)
    assert any(len(c.positions) == 4 for out in executor.replies for c in out.prompt_logprobs)

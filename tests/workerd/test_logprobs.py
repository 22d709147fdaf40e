"""The tiny Llama through the model runner with the new sampling knobs, against
transformers on the same weights.

* Sampled-token logprobs (logprob, 1-based rank, top-N) equal log_softmax of
  transformers' logits at the same position, for greedy and seeded sampling,
  and requests that did not ask get None in the same batch.
* Prompt logprobs of a prompt prefilled in two chunks equal transformers' for
  every position >= 1; the partial chunk returns its share without sampling,
  and a recompute after preemption does not return them twice.
* Greedy with repetition_penalty equals generate(repetition_penalty=...),
  and min_tokens holds EOS off like generate(min_new_tokens=...).
* (slow) TP=2 x PP=2 ranks replaying the same steps return the same logprobs.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.workerd.runner_harness import (
    Controlplane,
    free_port,
    make_prompts,
    make_runner,
    replay_rank,
)
from workerd.sched_output import SamplingParams

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


def test_sampled_token_logprobs_match_transformers(tiny_model_dir, hf_model):
    params = {
        "g": SamplingParams(temperature=0.0, logprobs=5),
        "s": SamplingParams(temperature=1.0, seed=7, logprobs=0),
        "n": SamplingParams(temperature=0.0),
        # Penalties change what is sampled, never the (raw) logprobs.
        "p": SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=3.0),
    }
    runner = make_runner(tiny_model_dir)
    prompts = dict(
        zip(params, make_prompts(runner.model.vocab_size, [9, 6, 5, 7]).values(), strict=True)
    )
    cp = Controlplane(runner, num_blocks=48, params=params)
    entries: dict[str, list] = {r: [] for r in params}
    out = cp.step({r: -1 for r in params}, new=prompts)
    for _ in range(6):
        assert len(out.logprobs) == len(out.req_ids)
        for req_id, entry in zip(out.req_ids, out.logprobs, strict=True):
            assert (entry is None) == (params[req_id].logprobs is None)
            entries[req_id].append(entry)
        out = cp.decode(*params)
    ranks = []
    for req_id, p in params.items():
        if p.logprobs is None:
            continue
        outputs = cp.outputs(req_id)[: len(entries[req_id])]
        ref = _hf_logprobs(hf_model, prompts[req_id] + outputs)
        for j, (token, entry) in enumerate(zip(outputs, entries[req_id], strict=True)):
            _check_entry(entry, ref[len(prompts[req_id]) - 1 + j], token, p.logprobs)
            ranks.append(entry.rank)
    # Greedy rows rank 1; the sampled and penalized rows must reach lower ranks.
    assert all(e.rank == 1 for e in entries["g"])
    assert max(ranks) > 1


def test_prompt_logprobs_over_two_chunks_match_transformers(tiny_model_dir, hf_model):
    params = {
        "a": SamplingParams(temperature=0.0, prompt_logprobs=4, logprobs=2),
        "b": SamplingParams(temperature=0.0),
        "z": SamplingParams(temperature=0.0, prompt_logprobs=0),
    }
    runner = make_runner(tiny_model_dir)
    lengths = [11, 5, 6]
    prompts = dict(
        zip(params, make_prompts(runner.model.vocab_size, lengths).values(), strict=True)
    )
    cp = Controlplane(runner, num_blocks=48, params=params)
    # Chunk 1 of a (5 of 11 tokens) samples nothing but returns positions 1..5:
    # its last position predicts token 5, the first one of the next chunk.
    out = cp.step({"a": 5, "b": -1, "z": -1}, new=prompts)
    assert out.req_ids == ["b", "z"]
    chunks = {c.req_id: c for c in out.prompt_logprobs}
    assert set(chunks) == {"a", "z"}
    first = chunks["a"]
    assert (first.start_position, len(first.positions)) == (1, 5)
    assert (chunks["z"].start_position, len(chunks["z"].positions)) == (1, 5)
    out = cp.step({"a": -1, "b": 1, "z": 1})
    (second,) = out.prompt_logprobs
    # Positions 6..10; position 10's logits predict the first output instead.
    assert (second.req_id, second.start_position, len(second.positions)) == ("a", 6, 5)
    assert "a" in out.req_ids and out.logprobs[out.req_ids.index("a")] is not None

    for req_id, chunk_list, num_top in (("a", [first, second], 4), ("z", [chunks["z"]], 0)):
        prompt = prompts[req_id]
        ref = _hf_logprobs(hf_model, prompt)
        entries = [e for c in chunk_list for e in c.positions]
        assert len(entries) == len(prompt) - 1
        for p, entry in enumerate(entries, start=1):
            _check_entry(entry, ref[p - 1], prompt[p], num_top)

    # Preempted after its prompt was done, then recomputed from 0 in two
    # chunks: no prompt logprobs the second time.
    cp.decode("a", "b", "z")
    cp.step({"b": 1, "z": 1}, preempted=["a"])
    out = cp.step({"a": 6, "b": 1, "z": 1}, resumed=["a"])
    out2 = cp.step({"a": -1, "b": 1, "z": 1})
    assert out.prompt_logprobs == [] and out2.prompt_logprobs == []
    assert "a" in out2.req_ids


def _hf_generate(hf_model, prompt, n, **kwargs):
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0, **kwargs
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_repetition_penalty_matches_transformers_generate(tiny_model_dir, hf_model):
    n = 10
    penalty = 1.8
    params = {
        "r0": SamplingParams(temperature=0.0, repetition_penalty=penalty),
        "r1": SamplingParams(temperature=0.0, repetition_penalty=penalty),
        "plain": SamplingParams(temperature=0.0),
    }
    runner = make_runner(tiny_model_dir, num_blocks=64)
    lengths = [8, 12, 8]
    prompts = dict(
        zip(params, make_prompts(runner.model.vocab_size, lengths).values(), strict=True)
    )
    prompts["plain"] = prompts["r0"]
    cp = Controlplane(runner, num_blocks=64, params=params)
    # r1 prefills in two chunks next to the others.
    cp.step({"r0": -1, "r1": 5, "plain": -1}, new=prompts)
    cp.step({"r0": 1, "r1": -1, "plain": 1})
    while len(cp.outputs("r1")) < n:
        cp.decode(*[r for r in params if len(cp.outputs(r)) < n])
    differs = False
    for req_id in ("r0", "r1"):
        expected = _hf_generate(hf_model, prompts[req_id], n, repetition_penalty=penalty)
        assert len(expected) >= 3
        assert cp.outputs(req_id)[: len(expected)] == expected, req_id
        differs |= expected != _hf_generate(hf_model, prompts[req_id], n)[: len(expected)]
    # The penalty must matter for the comparison to mean anything, and the
    # unpenalized row in the same batch must stay plain greedy.
    assert differs
    plain = _hf_generate(hf_model, prompts["plain"], n)
    assert cp.outputs("plain")[: len(plain)] == plain


def test_min_tokens_holds_off_eos_like_transformers(tiny_model_dir, hf_model):
    """A prompt whose greedy continuation hits EOS early: with min_tokens the
    runner keeps generating exactly like generate(min_new_tokens=...)."""
    eos = hf_model.config.eos_token_id
    runner = make_runner(tiny_model_dir, num_blocks=64)
    vocab = runner.model.vocab_size
    # Find a prompt whose plain greedy output contains EOS within a few tokens.
    prompt = None
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        cand = torch.randint(2, vocab, (6,), generator=g).tolist()
        if eos in _hf_generate(hf_model, cand, 6):
            prompt = cand
            break
    if prompt is None:
        pytest.skip("no prompt of the tiny model reaches EOS quickly")
    n = 8
    params = SamplingParams(temperature=0.0, min_tokens=n, min_tokens_stop_ids=(eos,))
    cp = Controlplane(runner, num_blocks=64, params={"m": params})
    cp.step({"m": -1}, new={"m": prompt})
    while len(cp.outputs("m")) < n:
        cp.decode("m")
    expected = _hf_generate(hf_model, prompt, n, min_new_tokens=n, eos_token_id=eos)
    assert eos not in cp.outputs("m")
    assert cp.outputs("m") == expected


@pytest.mark.slow
def test_tp2_pp2_ranks_return_the_same_logprobs(tiny_model_dir, tmp_path):
    """Prompt-logprob rows widen the last stage's compute_logits, a TP
    collective: every rank must choose the same rows or the step hangs."""
    params = {
        "a": SamplingParams(temperature=0.0, prompt_logprobs=2, logprobs=1),
        "b": SamplingParams(temperature=0.8, seed=5, logprobs=0, repetition_penalty=1.3),
        "c": SamplingParams(temperature=0.0),
    }
    runner = make_runner(tiny_model_dir)
    lengths = [10, 6, 7]
    prompts = dict(
        zip(params, make_prompts(runner.model.vocab_size, lengths).values(), strict=True)
    )
    cp = Controlplane(runner, num_blocks=48, params=params)
    cp.step({"a": 4, "b": -1}, new={"a": prompts["a"], "b": prompts["b"]})
    cp.step({"a": -1, "b": 1, "c": -1}, new={"c": prompts["c"]})
    for _ in range(3):
        cp.decode("a", "b", "c")
    tp, pp = 2, 2
    mp.spawn(
        replay_rank,
        args=(tp, pp, free_port(), tiny_model_dir, cp.history, str(tmp_path)),
        nprocs=tp * pp,
        join=True,
    )
    got = torch.load(tmp_path / f"rank{(pp - 1) * tp}.pt", weights_only=False)

    def flat(out):
        entries = [e for e in out.logprobs if e is not None]
        entries += [e for c in out.prompt_logprobs for e in c.positions]
        return entries

    for (_, want), have in zip(cp.history, got, strict=True):
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
    assert any(out.prompt_logprobs for _, out in cp.history)
